"""Decode step time against its byte floor at long contexts (4K / 128K / 1M tokens), the context made synthetically.

For each batch B and context N (``--batches`` x ``--contexts``, batch-major): an engine with the batched forward
and a pool sized for B x N, B requests prefilled from ``--prompt``-token random prompts, each grown to N tokens of
context by ``synthetic_context.SyntheticContext`` (random-but-valid FP4 / MXFP4 entries and FP8 window records for
every KV source and layer; no prefill of N tokens), checked by ``check_context``. Then one decode step with the
MoE routing recorded (the weight floor's experts), ``--warmup`` steps and ``--steps`` timed steps (each
``Engine.step()`` whole: schedule, forward, sampling, postprocess; synchronised); the median is reported.

    floor = (weights touched + KV bytes read) / copy rate, both measured in this run (benchmarks/_step_floor.py);
    the KV read grows with N: the Full indexer layers score every visible entry (layer 20: N keys, 2 / 8 / 14: N/2)

A cell whose pool (B x N x 890 B for the real geometry, plus rings and ``--margin-gib`` of workspace) does not fit
the device's free memory is skipped and listed with its reason. The decoded positions run a few tokens past N, so
the engine's context limit is raised to N + those tokens where N is the model's maximum.

Output: each row as it completes, a table, and ``--json``: device, versions, command, copy rate, rows
``{batch, context, step_ms, floor_ms, ratio, tokens_per_s, ...}``, skipped cells, and ``ratio_1m_to_4k`` per
batch (tok/s at the longest context run / at the shortest; ``ratio_contexts`` names the two).

GPU: python3 -P benchmarks/decode_floor_bench.py --preset flash-16e --batches 1,8,64 \\
         --contexts 4096,131072,1048576 --json docs/perf/decode_floor.json
CPU: TRITON_INTERPRET=1 python3 -P benchmarks/decode_floor_bench.py --preset tiny --device cpu \\
         --contexts 256,1024 --batches 1,3 --steps 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.kv.manager import SequenceSpec
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.layout import BlockLayout

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules (run as python3 -P)
from _step_floor import (  # noqa: E402
    copy_rate, kv_bytes, make_model, profile_ops, routed_experts_chosen, sync, weight_bytes,
)
from synthetic_context import SyntheticContext, check_context  # noqa: E402

GiB = 1 << 30


def free_bytes(device: torch.device) -> int:
    """Free device memory now (CUDA), or the host's available physical memory (CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def decoded_tokens(args) -> int:
    """Tokens each request decodes in a cell: the first (prefill), the routing step, warmup, timed, profiled."""
    return 2 + args.warmup + args.steps + int(args.ops)


def plan_pool(model, device: torch.device, batch: int, context: int, args) -> tuple[int, str | None]:
    """(blocks for B sequences of ``context`` + the decoded tokens, None) or (0, why the cell cannot run)."""
    cfg = model.cfg
    spec = SequenceSpec.from_config(cfg, model.compute_dtype, device)
    layout = BlockLayout(spec.geometry, args.block_size)
    blocks = batch * (-(-(context + decoded_tokens(args)) // args.block_size) + 1) + 8
    rings = 2 * batch * cfg.num_hidden_layers * cfg.sliding_window * spec.geometry.window_slot_bytes
    need, free = blocks * layout.block_bytes + rings + int(args.margin_gib * GiB), free_bytes(device)
    if need > free:
        return 0, (f"pool {blocks * layout.block_bytes / 1e9:.1f} GB ({blocks} blocks of {layout.block_bytes} B) "
                   f"+ rings {rings / 1e9:.2f} GB + workspace {args.margin_gib} GiB > {free / 1e9:.1f} GB free")
    return blocks, None


def start_engine(model, device: torch.device, batch: int, context: int, blocks: int, args) -> tuple[Engine, float]:
    """An engine holding ``batch`` requests decoding right after their first token; (engine, prefill seconds)."""
    cfg = model.cfg
    extra = decoded_tokens(args)
    ecfg = EngineConfig(device=device.type, dtype="bfloat16" if device.type == "cuda" else "float32",
                        forward="batched", max_num_seqs=batch,
                        max_num_batched_tokens=batch * 2 * args.prompt + 16,  # prefill + replay in one step
                        max_model_len=max(cfg.max_position_embeddings, context + extra + 8))
    engine = Engine(model, ecfg, KVStoreConfig(block_size=args.block_size, num_blocks=blocks))
    params = SamplingParams(temperature=0, max_tokens=extra + 8, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(3, cfg.vocab_size - 1, (args.prompt,), generator=g).tolist(), params)
    t = time.perf_counter()
    while any(not r.seqs or not r.seqs[0].output for r in engine.requests.values()):
        engine.step()
    sync(device)
    return engine, time.perf_counter() - t


def run_cell(model, device: torch.device, batch: int, context: int, blocks: int, rate: float, filler, args) -> dict:
    """One (batch, context) cell: engine, synthetic context (checked), routing step, warmup, timed steps -> its row.
    RuntimeError when the state check fails or a request stops early; the engine is dropped on return."""
    engine, prefill_s = start_engine(model, device, batch, context, blocks, args)
    t = time.perf_counter()
    synth = SyntheticContext(engine, seed=context + batch, distinct=args.distinct, filler=filler)
    for rid in list(engine.requests):
        synth.extend(rid, context)
    check_context(engine, dict.fromkeys(engine.requests, context))
    sync(device)
    build_s = time.perf_counter() - t
    chosen = routed_experts_chosen(engine)  # the first decode step at this context
    for _ in range(args.warmup):
        engine.step()
    sync(device)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - t)
    ops = profile_ops(engine, device) if args.ops else None
    if len(engine.requests) != batch:
        raise RuntimeError(f"{batch - len(engine.requests)} requests finished before the timed steps ended")
    step_ms = statistics.median(times) * 1e3
    wb, kb = weight_bytes(model, chosen), kv_bytes(model.cfg, batch, context)
    floor_ms = (wb + kb) / rate * 1e3
    row = {"batch": batch, "context": context, "step_ms": round(step_ms, 3), "floor_ms": round(floor_ms, 3),
           "ratio": round(step_ms / floor_ms, 2), "tokens_per_s": round(batch / step_ms * 1e3, 2),
           "weight_bytes": wb, "kv_bytes": kb, "steps_ms": [round(x * 1e3, 3) for x in times],
           "experts_touched_per_layer": round(sum(chosen.values()) / max(len(chosen), 1), 2),
           "pool_blocks": blocks, "prefill_s": round(prefill_s, 2), "build_s": round(build_s, 2)}
    if ops is not None:
        row["ops_ms"] = ops
    return row


def long_to_short(rows: list[dict]) -> tuple[dict[str, float], list[int]]:
    """Per batch: tok/s at the longest context run ÷ at the shortest (both must have run)."""
    ctx = sorted({r["context"] for r in rows})
    out = {}
    for b in sorted({r["batch"] for r in rows}):
        by = {r["context"]: r for r in rows if r["batch"] == b}
        if len(ctx) > 1 and ctx[0] in by and ctx[-1] in by:
            out[str(b)] = round(by[ctx[-1]]["tokens_per_s"] / by[ctx[0]]["tokens_per_s"], 3)
    return out, ctx[:1] + ctx[-1:] if len(ctx) > 1 else ctx


def ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise SystemExit(f"--{name} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"--{name} must list positive integers, got {text!r}")
    return vals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="flash-16e")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="4096,131072,1048576")
    ap.add_argument("--prompt", type=int, default=16, help="real prompt tokens prefilled before the synthetic rest")
    ap.add_argument("--steps", type=int, default=3, help="timed decode steps per cell (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps after the routing step")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--distinct", type=int, default=4096, help="distinct entry records per stream, tiled")
    ap.add_argument("--margin-gib", type=float, default=6.0, help="device memory kept free for the step")
    ap.add_argument("--formats", choices=("checkpoint", "bf16"), default="checkpoint")
    ap.add_argument("--ops", action="store_true", help="profile one more step per cell: top ops by self time")
    ap.add_argument("--json")
    args = ap.parse_args()
    batches, contexts = ints(args.batches, "batches"), ints(args.contexts, "contexts")
    if min(contexts) <= args.prompt or args.prompt < 1 or args.steps < 1 or args.warmup < 0:
        raise SystemExit("need 1 <= --prompt < every context, --steps >= 1 and --warmup >= 0")
    device = torch.device(args.device)
    rate = copy_rate(device)
    t = time.perf_counter()
    model = make_model(args.preset, device, args.formats)
    made_s = time.perf_counter() - t
    filler = torch.randint(3, model.cfg.vocab_size - 1, (max(contexts),), generator=torch.Generator().manual_seed(7))
    filler = filler.tolist()
    print(f"copy {rate / 1e9:.1f} GB/s; model {args.preset} made in {made_s:.1f} s", flush=True)
    rows, skipped = [], []
    for b in batches:
        for n in contexts:
            blocks, why = plan_pool(model, device, b, n, args)
            if why is None:
                try:
                    rows.append(run_cell(model, device, b, n, blocks, rate, filler, args))
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "ops_ms"}), flush=True)
                except torch.cuda.OutOfMemoryError as exc:
                    why = f"out of memory while running: {str(exc).splitlines()[0][:160]}"
            if why is not None:
                skipped.append({"batch": b, "context": n, "reason": why})
                print(f"B={b} N={n}: skipped: {why}", flush=True)
            gc.collect()  # the engine and its pool go before the next cell's pool is allocated
            if device.type == "cuda":
                torch.cuda.empty_cache()
            report(args, device, rate, made_s, rows, skipped, final=False)
    report(args, device, rate, made_s, rows, skipped, final=True)


def report(args, device: torch.device, rate: float, made_s: float, rows: list[dict], skipped: list[dict], *,
           final: bool) -> None:
    """Write ``--json`` (after every cell, so a run cut short keeps its rows); ``final`` also prints the table."""
    ratios, ends = long_to_short(rows)
    if final:
        print(f"{'B':>4} {'context':>9} {'step ms':>9} {'floor ms':>9} {'ratio':>6} {'tok/s':>9}")
        for r in rows:
            print(f"{r['batch']:>4} {r['context']:>9} {r['step_ms']:>9.2f} {r['floor_ms']:>9.3f} "
                  f"{r['ratio']:>6.1f} {r['tokens_per_s']:>9.1f}")
        for b, x in ratios.items():
            print(f"B={b}: tok/s at {ends[-1]} / at {ends[0]} = {x}")
        for s in skipped:
            print(f"skipped B={s['batch']} N={s['context']}: {s['reason']}")
    if not args.json:
        return
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "triton": triton.__version__,
           "command": shlex.join(["python3", "-P", *sys.argv]), "preset": args.preset,
           "weights": args.formats if device.type == "cuda" else "float32 (made on the host)",
           "copy_GBps": round(rate / 1e9, 1), "model_create_s": round(made_s, 1), "block_size": args.block_size,
           "prompt": args.prompt, "steps": args.steps, "warmup": args.warmup, "distinct": args.distinct,
           "complete": final, "rows": rows, "skipped": skipped, "ratio_1m_to_4k": ratios, "ratio_contexts": ends}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
