"""Decode throughput with DSpark speculative decoding against plain decoding, same model, same prompts.

For each batch size B: B greedy requests (``--prompt`` random tokens, ``--tokens`` generated) run with
speculation off, then on with ``--depth`` drafts:

    plain      one token per sequence and step
    drafter    the model's own drafter; with random weights its drafts are almost never accepted, so this
               row is the cost of speculating (drafting + wider verify steps) with nothing gained
    accept=a   the drafter still runs (same cost), then its drafts are replaced by the plain run's own
               continuation, each kept with probability a (the first miss and everything after it wrong):
               what a trained drafter with per-draft acceptance a would buy

Each row: decode wall time (prefill excluded: the clock starts once every request has its first token),
generated tokens/s, engine steps, mean drafts accepted per verify, and the seconds spent in the forward vs
the drafter. Greedy outputs are checked equal to the plain run's (exact in float64; on CUDA in fp32/bf16 the
engine is not batch-invariant, so a mismatch count is reported instead of failing).

    python3 -P benchmarks/spec_bench.py --preset flash-16e --device cuda --batches 1,16,64 --json OUT.json
    python3 -P benchmarks/spec_bench.py --preset tiny --device cpu --dtype float32 --batches 4 --tokens 16
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.model.config import preset
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def build(args) -> torch.nn.Module:
    dtype = _DTYPES[args.dtype]
    if args.device == "cuda":
        from flashtier.engine.model.init import random_model_on_device
        from flashtier.engine.model.moe_convert import convert_experts_
        from flashtier.engine.model.placement import quantize_linears_

        model = random_model_on_device(preset(args.preset), "cuda", dtype=dtype, with_dspark=True)
        quantize_linears_(model, "cuda")
        convert_experts_(model, "cuda")
        return model
    from flashtier.engine.model.init import random_model

    return random_model(preset(args.preset), seed=0, dtype=dtype, with_dspark=True)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def force(engine: Engine, want: dict[str, list[int]], accept: float, rng: random.Random) -> None:
    """After the real drafter ran, keep its cost but replace its drafts by the plain continuation."""
    real = engine.drafter._propose

    def propose(live):
        real(live)
        for req, seq in live:
            done, cont = len(seq.output), want[req.request_id]
            drafts = list(seq.spec.drafts)
            for k in range(len(drafts)):
                if rng.random() >= accept or done + k >= len(cont):
                    break
                drafts[k] = cont[done + k]
            seq.spec.drafts, seq.spec.q, seq.spec.confidence = tuple(drafts), None, None

    engine.drafter._propose = propose


def run(model, args, batch: int, depth: int, want=None, accept=None) -> tuple[dict, dict[str, list[int]]]:
    cfg = EngineConfig(max_num_batched_tokens=max(512, batch * args.prompt), max_num_seqs=max(batch, 1),
                       dtype=args.dtype, device=args.device, speculative_tokens=depth,
                       speculative_min_confidence=0.0)
    eng = Engine(model, cfg, KVStoreConfig(block_size=64, num_blocks=args.blocks))
    if accept is not None:
        force(eng, want, accept, random.Random(0))
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"b{i}", torch.randint(3, 128000, (args.prompt,), generator=g).tolist(), params)
    timers = {"forward_s": 0.0, "drafter_s": 0.0}
    execute = eng.runner.execute

    def timed_execute(batch_):
        t = time.perf_counter()
        out = execute(batch_)
        _sync(model.device)
        timers["forward_s"] += time.perf_counter() - t
        return out

    eng.runner.execute = timed_execute
    if eng.drafter is not None:
        after = eng.drafter.after_step

        def timed_after(sched, result):
            t = time.perf_counter()
            after(sched, result)
            _sync(model.device)
            timers["drafter_s"] += time.perf_counter() - t

        eng.drafter.after_step = timed_after
    out: dict[str, list[int]] = {}
    steps, start = 0, None
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(t for c in o.choices for t in c.token_ids)
        steps += 1
        if start is None and len(out) == batch:  # every request has its first token: decoding starts
            _sync(model.device)
            start, steps, base = time.perf_counter(), 0, sum(map(len, out.values()))
            timers = dict.fromkeys(timers, 0.0)
    _sync(model.device)
    wall = time.perf_counter() - start
    s = eng.stats()
    decoded = sum(map(len, out.values())) - base
    row = {"batch": batch, "depth": depth, "accept": accept, "decode_s": round(wall, 3), "steps": steps,
           "tokens_per_s": round(decoded / wall, 1), "mean_accepted": round(s.spec_accepted_tokens / s.spec_drafts, 3)
           if s.spec_drafts else 0.0, **{k: round(v, 3) for k, v in timers.items()}}
    return row, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash-16e")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--accepts", default="0.6,0.9")
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    t = time.perf_counter()
    model = build(args)
    print(f"model made in {time.perf_counter() - t:.1f} s", flush=True)
    rows = []
    for b in map(int, args.batches.split(",")):
        plain, want = run(model, args, b, 0)
        rows.append(plain)
        print(json.dumps(plain), flush=True)
        for accept in [None, *map(float, args.accepts.split(","))]:
            row, got = run(model, args, b, args.depth, want, accept)
            row["mismatched_requests"] = sum(got[k] != want[k] for k in want)
            row["speedup"] = round(row["tokens_per_s"] / plain["tokens_per_s"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        info = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "torch": torch.__version__, "command": " ".join(sys.argv), "rows": rows}
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
