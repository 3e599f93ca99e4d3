"""Where one decode step of the engine waits for the GPU, and how many kernels it launches (CUDA graph readiness).

A step that reads a device value on the host (``.item()``, ``.tolist()``, ``int(t)``, ``nonzero``, a
data-dependent shape) cannot be captured in a CUDA graph and stalls the host until the GPU drains. This runs a few
decode steps of the engine (batched forward, checkpoint formats) under ``torch.cuda.set_sync_debug_mode("warn")``
and lists every synchronising call site (file:line, count per step), then counts the kernel launches of one step
with the profiler and times the step's host-side wall time against its GPU time.

Usage: python3 -P benchmarks/host_sync_audit.py [--preset flash-16e] [--batch 8] [--json OUT]
(flashtier importable, a CUDA GPU, TRITON_INTERPRET=0)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections import Counter

import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.model.config import preset
from flashtier.engine.model.device_loader import place_in_formats_
from flashtier.engine.model.init import random_model_on_device
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig


def build(preset_name: str, batch: int, prompt: int) -> Engine:
    model = place_in_formats_(random_model_on_device(preset(preset_name), "cuda", with_dspark=False), "cuda")
    ecfg = EngineConfig(device="cuda", dtype="bfloat16", forward="batched", max_num_seqs=batch,
                        max_num_batched_tokens=4096)
    engine = Engine(model, ecfg, KVStoreConfig(block_size=64, num_blocks=batch * 8 + 16))
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(3, model.cfg.vocab_size - 1, (prompt,), generator=g).tolist(), params)
    while sum(1 for r in engine.requests.values() for s in r.seqs if s.output) < batch:
        engine.step()
    engine.step()
    torch.cuda.synchronize()
    return engine


def sync_sites(engine: Engine, steps: int) -> list[tuple[str, float]]:
    sites: Counter[str] = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            sites[f"{w.filename.split('flashtier/')[-1]}:{w.lineno}"] += 1
    return [(site, n / steps) for site, n in sites.most_common()]


def launches_and_times(engine: Engine) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        engine.step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t) * 1e3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0) for e in kernels) / 1e3
    return {"kernel_launches": len(kernels), "gpu_busy_ms": round(gpu_ms, 2), "profiled_wall_ms": round(wall_ms, 2)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash-16e")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    engine = build(args.preset, args.batch, args.prompt)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    sites = sync_sites(engine, args.steps)
    counts = launches_and_times(engine)
    print(f"step {sorted(times)[2]:.1f} ms (median of 5); {counts}", flush=True)
    print(f"{len(sites)} synchronising call sites, {sum(n for _, n in sites):.0f} syncs per step:")
    for site, n in sites[:40]:
        print(f"  {n:6.1f}  {site}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "command": " ".join(["python3 -P", *sys.argv]), "preset": args.preset, "batch": args.batch,
                       "step_ms": round(sorted(times)[2], 2), **counts,
                       "syncs_per_step": round(sum(n for _, n in sites), 1),
                       "sites": [{"site": s, "per_step": n} for s, n in sites]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
