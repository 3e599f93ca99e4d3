"""TTFT of a returning long agent turn: snapshot hit and snapshot miss, each against the same turn cold.

One ``flashtier serve`` with the HBM prefix cache off (``--no-prefix-caching``), so that a returning turn can
only come back from the SSD tier (a fresh ``--kv-dir``) and the snapshot pool (embedded, or ``--redis-url``):

    cold  ``--prompt`` token ids, ``max_tokens`` 1, streamed: TTFT = request start -> first streamed token
    hit   the same ids + ``--append`` new ones: SSD blocks + the cold turn's prompt-end snapshot (exact resume)
    miss  the same ids + other new ones after the snapshot pool was emptied (embedded pool: the server restarts
          on the same --kv-dir, whose blocks survive; Redis: FLUSHDB): SSD blocks + encoder bounded replay

Each turn records the response's ``usage.flashtier`` and the /metrics counters it moved, and is checked: cold
must be cold, hit an exact resume with SSD tokens and a snapshot hit, miss a replay with SSD tokens. Before
hit and miss the SSD files' pages are evicted (posix_fadvise DONTNEED, plus drop_caches when writable).
Restore GB/s = SSD + snapshot bytes read / the server's queue time of the turn (arrival -> first scheduled:
the LOADING tier lookup, SSD reads and install on an idle server; the server exposes no restore timer).
Ceilings in the same run: sequential read of the tier's segment files (cold pages, best of 3) and pinned H2D of
1 GiB (best of 3).
Warm-ups (salted, never measured) compile the kernels and exercise both resume paths first; with ``--fit``
(default) a prompt whose cold turn would not fit the budget (rate from the warm-up) is shortened, and said so.

A failed stage records its error and the run goes on; ``--budget-s`` skips what no longer fits; ``--json`` is
always written; the server is stopped by the pid this script started.

    python3 -P benchmarks/returning_turn_bench.py --json OUT.json                  (CUDA: flash-16e, 100K)
    OMP_NUM_THREADS=1 python3 -P benchmarks/returning_turn_bench.py --device cpu --prompt 600
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules (run as python3 -P)
from _turn_evidence import evidence, fit_prompt, moved, problems, prompt_ids  # noqa: E402
from _serve_child import ServeChild  # noqa: E402
from tier_restore_bench import evict, raw_sequential, segment_files  # noqa: E402


def h2d_ceiling(nbytes: int = 1 << 30, reps: int = 3) -> dict:
    """Pinned host -> device copy of ``nbytes`` (one warm-up, best of ``reps``); frees what it made."""
    x = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    x.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        y = x.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        del y
    del x
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "GBps": round(nbytes / min(times) / 1e9, 2), "times_s": [round(t, 4) for t in times]}


def run(a: argparse.Namespace, out: dict, work: Path, deadline: float) -> None:
    """The stages into ``out``; a stage's failure lands in out["errors"][stage], one that no longer fits the
    budget in out["skipped"]. Mutates ``out`` and files under ``work``; stops every server it started."""
    errors, skipped, turns = out["errors"], out["skipped"], out["turns"]
    left = lambda: deadline - time.monotonic()  # noqa: E731

    def stage(name: str, fn, need_s: float = 0.0):
        if left() < need_s:
            skipped[name] = f"{left():.0f} s of the budget left, {need_s:.0f} s needed"
            return None
        try:
            return fn()
        except Exception:  # noqa: BLE001 - recorded, the run goes on
            errors[name] = traceback.format_exc()[-2500:]
            return None

    if a.device.startswith("cuda"):
        out["ceilings"]["h2d_pinned"] = stage("h2d", h2d_ceiling)
    kv_dir = work / "kv"
    argv = ["serve", "--device", a.device, *([a.model_dir] if a.model_dir else ["--preset", a.preset]),
            "--cache-dir", str(work / "cache"), "--kv-dir", str(kv_dir), "--kv-disk-budget", "8G",
            "--no-prefix-caching", "--max-num-batched-tokens", str(a.max_num_batched_tokens),
            "--num-blocks", str(2 * -(-(a.prompt + 2 * a.append + 64) // a.block_size) + 64),
            "--block-size", str(a.block_size), "--max-num-seqs", "4", "--drain-timeout", "5",
            "--log-level", "warning",
            *(["--redis-url", a.redis_url] if a.redis_url else []), *a.serve_arg]
    out["server_command"] = "flashtier " + " ".join(argv)
    base = prompt_ids(a.prompt, seed=1)
    w = min(a.warmup_tokens or a.max_num_batched_tokens, a.prompt)
    warm_a, warm_b, tail_a, tail_b = (prompt_ids(w, 2), prompt_ids(w, 3), prompt_ids(a.append, 4),
                                      prompt_ids(a.append, 5))
    server = stage("start", lambda: ServeChild(argv, work, a.threads, left()), need_s=30)
    if server is None:
        return
    out["ready_s"] = [server.ready_s]

    def measured(name: str, ids: list[int], srv: ServeChild) -> None:
        before = srv.metrics()
        ttft, usage = srv.turn(ids, None, left())
        time.sleep(0.3)  # the engine's counters after its last step
        ev = evidence(usage, moved(before, srv.metrics()))
        turns[name] = {"ttft_s": round(ttft, 4), **ev, "problems": problems(name, ev)}

    def settle(srv: ServeChild, blocks: int, before: float) -> None:
        """Wait (bounded) until the SSD writer made ``blocks`` more blocks durable, then evict their pages."""
        t0, last = time.monotonic(), None
        while time.monotonic() - t0 < min(60.0, left()):
            now = srv.metrics().get("flashtier_ssd_blocks_written_total", 0.0)
            if now - before >= blocks and now == last:  # enough, and the writer is idle
                break
            last = now
            time.sleep(0.2)
        out["page_cache"] = evict(segment_files(kv_dir)) if a.evict else "warm"

    try:
        t = time.monotonic()
        first = stage("warmup_a", lambda: server.turn(warm_a, "warm-a", left()))  # compiles; cold
        t_first = time.monotonic() - t
        rate = stage("warmup_b", lambda: w / server.turn(warm_b, "warm-b", left())[0])  # cold, compiled
        t = time.monotonic()
        stage("warmup_return", lambda: server.turn(warm_a + tail_a, "warm-a", left()))  # exact resume path
        t_ret = time.monotonic() - t
        out["warmup"] = {"tokens": w, "first_s": round(t_first, 2), "rate_tok_s": rate and round(rate, 1),
                         "return_s": round(t_ret, 2), "first_ok": first is not None}
        if a.fit and rate:
            reserve = (0 if a.redis_url else server.ready_s + t_first) + 2 * t_ret + 40
            n = fit_prompt(a.prompt, rate, left() - reserve, a.block_size, floor=2 * a.block_size + 1)
            if n < a.prompt:
                out["prompt_fitted"] = {"requested": a.prompt, "used": n, "reserve_s": round(reserve, 1)}
                base = base[:n]
        out["prompt_tokens"] = len(base)
        written = server.metrics().get("flashtier_ssd_blocks_written_total", 0.0)
        stage("cold", lambda: measured("cold", base, server), need_s=10)
        if "cold" not in turns:
            return
        stage("settle", lambda: settle(server, len(base) // a.block_size, written))
        stage("hit", lambda: measured("hit", base + tail_a, server), need_s=10)
        if a.redis_url:  # the snapshot pool outlives the server: empty it
            import redis

            time.sleep(0.5)  # the hit turn's fire-and-forget snapshot puts land first
            stage("flush", lambda: redis.Redis.from_url(a.redis_url).flushdb())
        else:  # the embedded pool dies with the server; the SSD tier on --kv-dir survives it
            out["server_exit"] = [server.stop()]
            out["server_logs"] = [server.log()]
            server = stage("restart", lambda: ServeChild(argv, work, a.threads, left()), need_s=server.ready_s + 20)
            if server is None:
                return
            out["ready_s"].append(server.ready_s)
        stage("warmup_miss", lambda: server.turn(warm_b + tail_b, "warm-b", left()), need_s=15)  # replay path
        out["page_cache"] = stage("evict", lambda: evict(segment_files(kv_dir)) if a.evict else "warm")
        stage("miss", lambda: measured("miss", base + tail_b, server), need_s=5)
    finally:
        if server is not None:
            out.setdefault("server_exit", []).append(server.stop())
            out.setdefault("server_logs", []).append(server.log())
        segs = segment_files(kv_dir) if kv_dir.is_dir() else []

        def disk() -> dict:
            """Best of 3 cold sequential reads (a turn's ~0.1 GB reads in tens of ms: one read is noisy)."""
            how, rates, nbytes = "", [], 0
            for _ in range(3):
                how = evict(segs)
                spent = raw_sequential(segs)
                rates.append(round(spent.rate / 1e9, 3))
                nbytes = spent.nbytes
            return {"bytes": nbytes, "GBps": max(rates), "runs_GBps": rates, "files": len(segs), "pages": how}

        out["ceilings"]["disk_read"] = stage("disk_read", disk) if segs else None


def summarise(out: dict) -> None:
    """Ratios to cold and to the ceilings, and whether every measured turn took its path; mutates ``out``."""
    t, c = out["turns"], out["ceilings"]
    cold = (t.get("cold") or {}).get("ttft_s")
    for name, target in (("hit", 0.03), ("miss", 0.05)):
        x = (t.get(name) or {}).get("ttft_s")
        out[f"ttft_{name}_s"] = x
        out[f"{name}_over_cold"] = round(x / cold, 4) if x and cold else None
        out[f"{name}_target"] = target
        rate = (t.get(name) or {}).get("restore_GBps")
        for ceil in ("disk_read", "h2d_pinned"):
            top = (c.get(ceil) or {}).get("GBps")
            out[f"{name}_restore_over_{ceil}"] = round(rate / top, 3) if rate and top else None
    out["ttft_cold_s"] = cold
    out["paths_verified"] = bool(t) and all(not v["problems"] for v in t.values()) and len(t) == 3


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--preset", default=None, help="default: flash-16e on cuda, tiny on the cpu")
    ap.add_argument("--model-dir", default=None, help="serve this checkpoint instead of a preset")
    ap.add_argument("--prompt", type=int, default=None, help="first-turn tokens (default: 100000 on cuda, 600 on cpu)")
    ap.add_argument("--append", type=int, default=100, help="new tokens of the returning turn")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--warmup-tokens", type=int, default=None, help="default: one prefill chunk")
    ap.add_argument("--redis-url", default=None, help="snapshot pool in Redis (miss: FLUSHDB, no restart)")
    ap.add_argument("--threads", type=int, default=None, help="server torch threads ($OMP_NUM_THREADS, else 4/1)")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more serve flag (repeatable)")
    ap.add_argument("--budget-s", type=float, default=280.0, help="hard time budget; later stages are skipped")
    ap.add_argument("--fit", action=argparse.BooleanOptionalAction, default=True,
                    help="shorten a prompt whose cold turn would not fit the budget (recorded)")
    ap.add_argument("--evict", action=argparse.BooleanOptionalAction, default=True,
                    help="evict the SSD files' pages before hit and miss")
    ap.add_argument("--work-dir", default=None, help="parent of the run's temporary directory")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    on_gpu = a.device.startswith("cuda")
    a.prompt = a.prompt or (100_000 if on_gpu else 600)
    a.preset = a.preset or ("flash-16e" if on_gpu else "tiny")
    a.threads = a.threads or int(os.environ.get("OMP_NUM_THREADS") or (4 if on_gpu else 1))
    if a.prompt < 2 * a.block_size + 1 or a.append < 1:
        ap.error(f"--prompt {a.prompt} / --append {a.append}: need > 2 blocks and >= 1")
    deadline = time.monotonic() + a.budget_s
    out: dict = {"device": torch.cuda.get_device_name() if on_gpu and cuda else platform.processor() or "cpu",
                 "cpus": os.cpu_count(), "versions": {"python": platform.python_version(), "torch": torch.__version__,
                 "flashtier": _dist_version("flashtier"), "triton": _dist_version("triton")},
                 "command": "python3 -P benchmarks/returning_turn_bench.py " + " ".join(sys.argv[1:] if argv is None
                                                                                       else argv),
                 "preset": a.model_dir or a.preset, "prompt_requested": a.prompt, "append": a.append,
                 "snapshot_pool": "redis" if a.redis_url else "embedded", "budget_s": a.budget_s,
                 "turns": {}, "ceilings": {}, "errors": {}, "skipped": {}}
    work = Path(tempfile.mkdtemp(prefix="flashtier-return-", dir=a.work_dir))
    t0 = time.monotonic()
    try:
        run(a, out, work, deadline)
    except (Exception, SystemExit):  # noqa: BLE001 - still write the JSON
        out["errors"]["run"] = traceback.format_exc()[-2500:]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        summarise(out)
        out["wall_s"] = round(time.monotonic() - t0, 1)
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
    print(f"{'turn':>5} {'TTFT s':>9} {'/cold':>7} {'kind':>7} {'hbm':>6} {'ssd':>7} {'snap':>5} {'replay':>6} "
          f"{'GB/s':>7}  problems")
    for name, r in out["turns"].items():
        print(f"{name:>5} {r['ttft_s']:>9.3f} {out.get(name + '_over_cold')!s:>7} "
              f"{(r['resume'] or {}).get('kind')!s:>7} {r['hbm']!s:>6} {r['ssd']!s:>7} {r['snapshot']!s:>5} "
              f"{r['approximate_replay_tokens']!s:>6} {r['restore_GBps']!s:>7}  {'; '.join(r['problems']) or 'none'}")
    print("ceilings:", json.dumps(out["ceilings"]), "| skipped:", out["skipped"] or "none", f"| {out['wall_s']} s")
    for stage, err in out["errors"].items():
        print(f"{stage} failed:\n{err}", file=sys.stderr)
    return 0 if out["paths_verified"] and not out["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
