"""Ready means fast: the first batch's TTFT and ITL against a warm batch of the same shape, with and without the
warm-up (engine/warmup.py), and a restart's time to ready with the compiled kernels kept.

    python3 -P benchmarks/warmup_bench.py --preset flash-16e --batches 1,8,64 --json docs/perf/warmup.json

Three fresh processes (each its own Triton cache state, as a restarted server has):
    cold     empty Triton cache, no warm-up: what the first requests met before (compiles on the request path)
    warm     empty Triton cache, warm-up at every graph size up to the largest batch before the first request
    restart  the warm process's Triton cache kept (serve puts it in CACHE_DIR/triton), warm-up again: the
             time to ready of a restart
In each, per batch size b (in order): b requests of ``--prompt`` tokens (distinct, no prefix sharing), greedy,
``--tokens`` new tokens: TTFT = until every request has its first token; ITL = the mean decode step after it.
Then the same shape again with new prompts (the warm reference measured in the same process). The ratios
first / warm are what the acceptance reads (<= 1.5 with the warm-up). Each row also counts the Triton kernels
compiled while it ran (after a warm-up that covered the shapes: 0); ``--profile-first`` prints where each first
batch's time went and what it compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

START = time.monotonic()


def run_batch(engine, b: int, prompt: int, tokens: int, salt: str) -> dict:
    import torch

    from flashtier.engine.sample.params import SamplingParams

    vocab = engine.model.cfg.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(b):
        base = (hash((salt, b, i)) % (vocab - prompt - 10)) + 5
        engine.add_request(f"{salt}-{b}-{i}", [base + j for j in range(prompt)], params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first: set[str] = set()
    ttft, steps, t_first = None, 0, None
    while engine.has_unfinished():
        outs = engine.step()
        for out in outs:
            if any(c.token_ids for c in out.choices):
                first.add(out.request_id)
        if ttft is None and len(first) == b:
            torch.cuda.synchronize()
            t_first = time.perf_counter()
            ttft = t_first - t0
        elif ttft is not None:
            steps += 1
    torch.cuda.synchronize()
    itl = (time.perf_counter() - t_first) / max(steps, 1)
    return {"ttft_s": ttft, "itl_s": itl, "decode_steps": steps}


@contextlib.contextmanager
def _compile_log():
    """The Triton kernels compiled inside the block (Triton's post-compile hook: an in-process cache miss, from
    its disk cache or not): a list of their launch reprs, filled as they come."""
    from triton import knobs

    compiled: list[str] = []
    hook = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiled.append(str(kw.get("repr", "?"))[:400])
    try:
        yield compiled
    finally:
        knobs.runtime.jit_post_compile_hook = hook


@contextlib.contextmanager
def _profiled(on: bool, label: str, compiled: list[str]):
    """With ``on``: what the block spent its time in (cProfile, top functions by cumulative time) and the
    kernels it compiled, printed to stderr: what the warm-up missed."""
    if not on:
        yield
        return
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
        print(f"PROFILE {label}: {len(compiled)} Triton compiles", *compiled, out.getvalue(), sep="\n",
              file=sys.stderr, flush=True)


def child(args) -> dict:
    from flashtier.engine.config import EngineConfig
    from flashtier.engine.factory import build_engine
    from flashtier.engine.warmup import warm_up
    from flashtier.kvstore.config import KVStoreConfig

    batches = [int(b) for b in args.batches.split(",")]
    graph_sizes = tuple(int(b) for b in args.graph_sizes.split(",")) if args.graph_sizes else ()
    config = EngineConfig(preset=args.preset, device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
                          max_num_batched_tokens=args.budget, cuda_graph_sizes=graph_sizes)
    engine = build_engine(config, KVStoreConfig(block_size=64))
    built = time.monotonic() - START
    report = warm_up(engine) if args.mode != "cold" else None
    ready = time.monotonic() - START
    # progress lines as it goes, so that a run cut short still tells what it measured
    print("PROGRESS " + json.dumps({"mode": args.mode, "built_s": built, "ready_s": ready,
                                    "warmup_s": None if report is None else report.total_s}), flush=True)
    rows = []
    for b in batches:
        with _compile_log() as compiled, _profiled(args.profile_first, f"{args.mode} b={b} first", compiled):
            first = run_batch(engine, b, args.prompt, args.tokens, "first")
        first["compiles"] = len(compiled)
        with _compile_log() as compiled:
            again = run_batch(engine, b, args.prompt, args.tokens, "again")
        again["compiles"] = len(compiled)
        rows.append({"batch": b, "first": first, "warm": again,
                     "ttft_ratio": first["ttft_s"] / again["ttft_s"], "itl_ratio": first["itl_s"] / again["itl_s"]})
        print("PROGRESS " + json.dumps({"mode": args.mode, **rows[-1]}), flush=True)
    return {"mode": args.mode, "built_s": built, "ready_s": ready,
            "warmup_s": None if report is None else report.total_s,
            "warmup_sizes": None if report is None else list(report.sizes),
            "warmup_size_s": None if report is None else [round(t, 3) for t in report.seconds], "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="flash-16e")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--modes", default="cold,warm,restart", help="which processes to run (restart needs warm)")
    ap.add_argument("--graph-sizes", help="the captured (and warmed) decode sizes, as serve's --cuda-graph-sizes "
                    "(default: every capture size up to the largest batch)")
    ap.add_argument("--json")
    ap.add_argument("--kept-cache", help="the Triton cache the warm and restart processes share (default: a "
                    "temporary folder); name serve's CACHE_DIR/triton to start a server from it afterwards")
    ap.add_argument("--profile-first", action="store_true",
                    help="profile the first batch of each size (stderr): where a first request's time goes")
    ap.add_argument("--mode", choices=["cold", "warm", "restart"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    import torch

    results = []
    kept = contextlib.nullcontext(args.kept_cache) if args.kept_cache else tempfile.TemporaryDirectory()
    with tempfile.TemporaryDirectory() as cold_cache, kept as kept_cache:
        for mode, cache in (("cold", cold_cache), ("warm", kept_cache), ("restart", kept_cache)):
            if mode not in args.modes.split(","):
                continue
            argv = [sys.executable, "-P", __file__, *sys.argv[1:], "--mode", mode]
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True) as proc:
                result = None
                for line in proc.stdout:  # echoed as they come (the child's stderr passes through)
                    if line.startswith("PROGRESS "):
                        print(line[9:], end="", flush=True)
                    elif line.startswith("RESULT "):
                        result = json.loads(line[7:])
            if proc.returncode or result is None:
                raise SystemExit(f"the {mode} process failed (exit {proc.returncode})")
            results.append(result)
    print(f"{'mode':8} {'ready s':>8} {'warm-up s':>9} | first batch against a warm one: TTFT, ITL ratios")
    for res in results:
        print(f"{res['mode']:8} {res['ready_s']:8.1f} {res['warmup_s'] or 0:9.1f} | " + " | ".join(
            f"b={r['batch']}: TTFT x{r['ttft_ratio']:.2f} ({r['first']['ttft_s']:.2f}s) ITL x{r['itl_ratio']:.2f}"
            f" {r['first']['compiles']} compiles"
            for r in res["rows"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python3 -P benchmarks/warmup_bench.py " + shlex.join(sys.argv[1:]),
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "python": platform.python_version(), "results": results}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
