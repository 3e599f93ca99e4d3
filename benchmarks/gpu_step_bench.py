"""One decode step of the engine on one GPU: step time, per-op time, and the step's byte floor, same run.

The model (``--preset``, random weights made on the GPU) runs in the engine with the batched forward. For each
batch size B: B requests with ``--prompt``-token prompts are prefilled, then ``--steps`` decode steps are timed
(each ``Engine.step()`` whole: schedule, forward, sampling, postprocess; synchronised). One more step runs
under torch.profiler for the per-op table.

    floor = (weight bytes the step reads + KV bytes it reads) / copy rate, measured in this run
    (the accounting is benchmarks/_step_floor.py, shared with decode_floor_bench.py)

Usage: python3 -P benchmarks/gpu_step_bench.py --preset flash-16e --batches 1,64 --json OUT.json
(flashtier importable, TRITON_INTERPRET=0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared floor accounting (run as python3 -P)
from _step_floor import (copy_rate, kv_bytes, make_model, profile_by_weight, profile_ops, step_phases,  # noqa: E402
                         routed_experts_chosen, weight_bytes)

BLOCK = 64
HOST_PROFILE = False
BY_WEIGHT = False
PHASES = False


def run_batch(model, batch: int, prompt: int, steps: int, rate: float, graphs: bool = True) -> dict:
    cfg = model.cfg
    blocks = batch * (-(-(prompt + 2 * steps + 12) // BLOCK) + 1) + 8
    ecfg = EngineConfig(device="cuda", dtype="bfloat16", forward="batched", max_num_seqs=batch,
                        max_num_batched_tokens=4096, cuda_graphs=graphs)
    engine = Engine(model, ecfg, KVStoreConfig(block_size=BLOCK, num_blocks=blocks))
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 12, ignore_eos=True)  # timed, profiled, phases
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(3, cfg.vocab_size - 1, (prompt,), generator=g).tolist(), params)
    t0 = time.perf_counter()
    while sum(1 for r in engine.requests.values() for s in r.seqs if s.output) < batch:
        engine.step()
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    print(f"B={batch}: prefilled in {prefill_s:.1f} s", flush=True)
    chosen = routed_experts_chosen(engine)
    engine.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    phases = step_phases(engine, torch.device("cuda"), steps) if PHASES and graphs else None
    ops = profile_ops(engine, torch.device("cuda"))
    by_weight = profile_by_weight(engine, torch.device("cuda"), rate) if BY_WEIGHT else None
    if HOST_PROFILE:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        engine.step()
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    step_ms = sorted(times)[len(times) // 2] * 1e3
    wb, kb = weight_bytes(model, chosen), kv_bytes(cfg, batch, prompt + steps)
    floor_ms = (wb + kb) / rate * 1e3
    return {"batch": batch, "cuda_graphs": graphs, "step_ms": round(step_ms, 3), "floor_ms": round(floor_ms, 3),
            "ratio": round(step_ms / floor_ms, 2), "tokens_per_s": round(batch / step_ms * 1e3, 1),
            "weight_bytes": wb, "kv_bytes": kb, "prefill_s": round(prefill_s, 2),
            "experts_touched_per_layer": round(sum(chosen.values()) / max(len(chosen), 1), 2), "ops_ms": ops} | (
                {"by_weight": by_weight} if by_weight is not None else {}) | (
                {"phases_ms": phases} if phases is not None else {})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash-16e")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--formats", choices=("checkpoint", "bf16"), default="checkpoint",
                    help="weights as the checkpoint stores them (default) or every linear in bf16")
    ap.add_argument("--host-profile", action="store_true", help="print a cProfile of one decode step")
    ap.add_argument("--by-weight", action="store_true",
                    help="one more step, eager, profiled per FP8 / invariant-linear weight shape and MoE layer "
                         "(device ms, calls, ratio to each call's byte floor): the rows' by_weight")
    ap.add_argument("--phases", action="store_true",
                    help="as many more steps, timed at the graph replay's edges (host phases, the replay's device "
                         "time): the rows' phases_ms")
    ap.add_argument("--graphs", default="on", help="on | off | on,off: decode steps replayed from CUDA graphs")
    args = ap.parse_args()
    global HOST_PROFILE, BY_WEIGHT, PHASES
    HOST_PROFILE, BY_WEIGHT, PHASES = args.host_profile, args.by_weight, args.phases
    rate = copy_rate(torch.device("cuda"))
    t = time.perf_counter()
    model = make_model(args.preset, torch.device("cuda"), args.formats)
    made_s = time.perf_counter() - t
    print(f"model made in {made_s:.1f} s", flush=True)
    rows = []
    for b in args.batches.split(","):
        for mode in args.graphs.split(","):
            rows.append(run_batch(model, int(b), args.prompt, args.steps, rate, mode == "on"))
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("ops_ms", "by_weight")}), flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
           "preset": args.preset, "weights": args.formats, "copy_GBps": round(rate / 1e9, 1),
           "model_create_s": round(made_s, 1), "rows": rows}
    print(f"copy {rate / 1e9:.0f} GB/s; model made on the GPU in {made_s:.1f} s")
    print(f"{'B':>4} {'graphs':>6} {'step ms':>9} {'floor ms':>9} {'ratio':>6} {'tok/s':>8}")
    for r in rows:
        print(f"{r['batch']:>4} {str(r['cuda_graphs']):>6} {r['step_ms']:>9.2f} {r['floor_ms']:>9.3f} {r['ratio']:>6.1f} {r['tokens_per_s']:>8.1f}")
        for k, v in list(r["ops_ms"].items())[:8]:
            print(f"      {v:8.3f} ms  {k}")
        if "phases_ms" in r:
            print("      phases ms: " + ", ".join(f"{k} {v}" for k, v in r["phases_ms"].items()))
        for k, v in list(r.get("by_weight", {}).items())[:12]:
            print(f"      {v.get('ms', 0):8.3f} ms  {v.get('calls', 0):4d} calls  {v.get('ratio', '-'):>6}x  {k}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
