"""One MoE layer's grouped GEMMs against their floors, per projection and batch, for several launch configs.

The layer is flash-16e's (5120 wide, 16 routed experts top-6 in MXFP4, one 2304-wide shared expert in FP8,
gate fp32), built on the GPU with random weights (``ExpertWeights.random_``). One run prints and (``--json``)
writes:

1. ``variants``: for each candidate ``MoEGemmConfig`` in VARIANTS (both projections under it) and each batch
   (1 / 8 / 64 tokens): the whole expert op checked against the reference (worst row's relative RMS <= TOL)
   and for batch invariance (the first and last token alone == in the batch, bit for bit), then each launch
   timed alone (CUDA-graph replay median, weights far larger than L2):

       bytes  = routed experts the batch selects x the projection's MXFP4 bytes + the shared expert's FP8
                bytes + activations in and out
       flops  = 2 x (pairs + tokens for the shared expert) x rows x K
       floor  = max(bytes / copy rate, flops / bf16 dense peak); copy rate = a 2 GiB device-to-device copy
                (bytes read + written) measured in this run; peak from PEAK_BF16 by device name
       ratio  = time / floor

   A variant that fails to compile, or fails a check, is reported and left out of the choice.
2. ``best``: per projection the passing variant with the lowest worst-batch ratio; ``--tune-out PATH``
   writes them as a config table for ``kernels/moe/gemm_config.py`` (keyed by weight shape and device).
3. ``layer``: the whole layer (``MoE.forward``: route + experts + combine) under the tuned table at each batch:
   touched bytes / copy rate vs CUDA-graph time, as in earlier docs/perf/moe.json files.

``--smoke`` runs the same code on the CPU at a tiny size with TRITON_INTERPRET=1 (timings are meaningless
there; it checks the script and the checks).

Usage: python3 -P benchmarks/moe_bench.py [--preset flash-16e] [--variants 0:8] [--json docs/perf/moe.json]
       [--tune-out kernels/moe/gemm_configs.json]
       TRITON_INTERPRET=1 python3 -P benchmarks/moe_bench.py --smoke
(flashtier importable)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
import traceback

import torch
import triton

from flashtier.engine.model.config import preset
from flashtier.engine.model.expert_weights import ExpertWeights
from flashtier.engine.model.moe import MoE
from flashtier.kernels.moe import gemm_config
from flashtier.kernels.moe.align import moe_align
from flashtier.kernels.moe.gemm_config import ConfigKey, MoEFfnConfig, table_entry
from flashtier.kernels.moe.grouped_gemm import moe_grouped_ffn
from flashtier.kernels.moe.grouped_gemm_kernel import TOKEN_TILE, MoEGemmConfig, launch_moe_gemm
from flashtier.kernels.quant.fp8 import fp8_qdq

BATCHES, SMOKE_BATCHES = (1, 8, 64), (1, 3, 17)
TOL = 5e-3  # worst row's relative RMS vs the reference (tests/kernels/test_moe_grouped_gemm.py, GPU test)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core FLOP/s (SXM), by device-name substring
C = MoEGemmConfig
VARIANTS = [  # candidate launch configs (each used for both projections; the table may mix them)
    # the hardware-conversion decoder ("cvt", ~9 instructions and 2 conversions per weight element)
    C(decode="cvt"),                             # 64 rows, 64 K, 4 x 16 token tiles, 4 warps, no split
    C(split_k=2, decode="cvt"), C(split_k=4, decode="cvt"), C(split_k=8, decode="cvt"),
    C(block_n=32, split_k=4, decode="cvt"), C(block_n=128, num_warps=8, split_k=2, decode="cvt"),
    C(block_k=128, split_k=2, decode="cvt"), C(num_stages=1, split_k=4, decode="cvt"),
    C(sub_tiles=2, split_k=4, decode="cvt"),
    # the integer decoder ("bits", the default: ~3 instructions per weight element, no conversion)
    C(), C(split_k=2), C(split_k=4), C(split_k=8),
    C(block_n=128, num_warps=8, split_k=2), C(block_n=128, num_warps=4, split_k=4),
    C(block_k=128, split_k=2), C(block_k=128, split_k=4),
    C(sub_tiles=2, split_k=4),
    # loads staged through shared memory by the compiler (``pipeline`` stages), activations as whole rows; gated
    # programs stack block_n / 2 w1 rows over the matching w3 rows. An H100 (2026-12-07): 2.6-3.7x at 1 / 8
    # tokens, 4.5-5.2x at 64, against 3.7-5.7x for the register double buffer; ncu: issue-bound at 12-18%
    # occupancy (registers), DRAM 20-28% busy. ``maxnreg`` caps registers for a fourth or fifth program per SM.
    C(sub_tiles=1, split_k=4, pipeline=3), C(block_n=128, sub_tiles=4, split_k=4, pipeline=3),
    C(sub_tiles=1, split_k=4, pipeline=4, maxnreg=128), C(sub_tiles=1, split_k=2, pipeline=4, maxnreg=128),
    C(sub_tiles=2, split_k=4, pipeline=4, maxnreg=128), C(sub_tiles=2, split_k=2, pipeline=4, maxnreg=128),
    C(sub_tiles=2, split_k=4, pipeline=5, maxnreg=128), C(sub_tiles=2, split_k=4, pipeline=4, maxnreg=96),
    C(block_n=128, sub_tiles=2, split_k=4, pipeline=3, maxnreg=168),
    C(block_n=128, sub_tiles=4, split_k=2, pipeline=3), C(block_n=128, sub_tiles=4, split_k=4, pipeline=4),
]


def build_layer(preset_name: str, device: str, seed: int = 0) -> MoE:
    cfg = preset(preset_name)
    d, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        moe = MoE(cfg, e, cfg.num_experts_per_tok, torch.float32)
    moe.gate.to_empty(device=device)
    moe.gate.weight.data = torch.randn(e, d, generator=g, device=device) / d**0.5
    moe.gate.bias.data = 0.1 * torch.randn(e, generator=g, device=device)
    moe.experts = ExpertWeights(e, d, i, i * cfg.n_shared_experts, device).random_(seed)
    moe.experts.impl = "triton"
    moe.shared_experts = None
    return moe


def copy_rate(device: str) -> float:
    """Bytes read + written per second by a device-to-device copy (2 GiB on CUDA)."""
    x = torch.randint(0, 256, ((2 << 30) if device == "cuda" else (64 << 20),), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() / (timed_us(lambda: y.copy_(x), device, graph=False) * 1e-6)


def bf16_peak(device: str) -> float:
    if device != "cuda":
        return 1e12
    name = torch.cuda.get_device_name()
    for key, peak in PEAK_BF16.items():
        if key in name:
            return peak
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)  # unknown card: a measured lower bound
    return 2 * 8192**3 / (timed_us(lambda: a @ a, device, graph=False) * 1e-6)


def timed_us(fn, device: str, graph: bool = True, reps: int = 100) -> float:
    """Median µs of ``fn``: replayed from a CUDA graph (no host in the loop) or do_bench; on the CPU one call."""
    if device != "cuda":
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    from triton.testing import do_bench

    if not graph:
        return 1e3 * do_bench(fn, warmup=10, rep=reps, return_mode="median")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        fn()
    return 1e3 * do_bench(cuda_graph.replay, warmup=10, rep=reps, return_mode="median")


@dataclasses.dataclass
class Batch:
    """One batch's inputs, routing, reference output and the launch inputs of each projection."""

    x: torch.Tensor
    idx: torch.Tensor
    w: torch.Tensor
    ref: torch.Tensor
    used: int  # routed experts selected


def make_batches(moe: MoE, sizes: tuple[int, ...], device: str) -> dict[int, Batch]:
    ew = moe.experts
    gen = torch.Generator(device=device).manual_seed(2)
    out = {}
    for n in sizes:
        x = torch.randn(n, ew.dim, generator=gen, device=device)
        idx, w = moe.route(x)
        ref = moe_grouped_ffn(x, idx, w, ew.routed(), ew.shared(), moe.limit, impl="reference")
        out[n] = Batch(x, idx, w, ref, int(torch.unique(idx).numel()))
    return out


def projection_cost(moe: MoE, b: Batch, gated: bool) -> tuple[int, int]:
    """(bytes, flops) one projection must move / do for batch ``b`` (module docstring)."""
    ew = moe.experts
    r, s = ew.routed(), ew.shared()
    n, k = b.idx.shape
    if gated:
        w_bytes = b.used * (r.w13_codes[0].numel() + r.w13_scales[0].numel()) + s.w13_codes.numel() + s.w13_scales.numel()
        rows, depth, act = 2 * ew.inter, ew.dim, n * ew.dim * 2 + (n * k + n) * ew.inter * 2
    else:
        w_bytes = b.used * (r.w2_codes[0].numel() + r.w2_scales[0].numel()) + s.w2_codes.numel() + s.w2_scales.numel()
        rows, depth, act = ew.dim, ew.inter, (n * k + n) * (ew.inter * 2 + ew.dim * 4)
    return w_bytes + act, 2 * (n * k + n) * rows * depth


def launches(moe: MoE, b: Batch, cfg: MoEGemmConfig) -> dict[str, object]:
    """The two launches of the expert op for batch ``b`` under ``cfg``, as callables (inputs prepared here)."""
    ew = moe.experts
    n, k = b.idx.shape
    xq = fp8_qdq(b.x).to(torch.bfloat16)
    al = moe_align(b.idx, ew.n_experts, TOKEN_TILE)
    n_tiles = al.block_expert.numel() + triton.cdiv(n, TOKEN_TILE)
    act = torch.zeros((n_tiles * TOKEN_TILE, max(ew.inter, ew.shared_inter)), dtype=torch.bfloat16, device=b.x.device)
    out = torch.empty((n * k + n, ew.dim), device=b.x.device)
    r, s = ew.routed(), ew.shared()
    common = dict(ids=al.sorted_ids, block_expert=al.block_expert, first_block=al.first_block, n_tok=n, top_k=k,
                  config=cfg)
    w13 = lambda: launch_moe_gemm(xq, act, (r.w13_codes, r.w13_scales), (s.w13_codes, s.w13_scales),  # noqa: E731
                                  gated=True, k_r=ew.dim, k_s=ew.dim, n_r=ew.inter, n_s=ew.shared_inter,
                                  route_w=b.w.reshape(-1), limit=moe.limit, **common)
    w13()  # the w2 launch reads real activations
    w2 = lambda: launch_moe_gemm(act, out, (r.w2_codes, r.w2_scales), (s.w2_codes, s.w2_scales),  # noqa: E731
                                 gated=False, k_r=ew.inter, k_s=ew.shared_inter, n_r=ew.dim, n_s=ew.dim, **common)
    return {"w13": w13, "w2": w2}


def check(moe: MoE, batches: dict[int, Batch], cfg: MoEFfnConfig) -> tuple[float, bool]:
    """(worst row's relative RMS vs the reference over all batches, batch invariance at the largest batch)."""
    ew = moe.experts
    run = lambda b, sl=slice(None): moe_grouped_ffn(b.x[sl], b.idx[sl], b.w[sl], ew.routed(), ew.shared(),  # noqa: E731
                                                    moe.limit, impl="triton", config=cfg)
    err = 0.0
    for b in batches.values():
        out = run(b).double()
        ref = b.ref.double()
        err = max(err, float(((out - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)).max()))
    big = batches[max(batches)]
    whole = run(big)
    n = big.x.shape[0]
    invariant = all(torch.equal(run(big, slice(t, t + 1))[0], whole[t]) for t in (0, n - 1))
    return err, invariant


def time_variants(moe, batches, variants, rate, peak, device) -> list[dict]:
    rows = []
    for cfg in variants:
        row = dict(config=dataclasses.asdict(cfg))
        try:
            err, inv = check(moe, batches, MoEFfnConfig(cfg, cfg))
            row.update(err=float(f"{err:.2e}"), batch_invariant=inv, ok=err <= TOL and inv, proj={})
            for n, b in batches.items():
                for name, fn in launches(moe, b, cfg).items():
                    nbytes, flops = projection_cost(moe, b, name == "w13")
                    floor = max(nbytes / rate, flops / peak) * 1e6
                    us = timed_us(fn, device)
                    row["proj"][f"{name}@{n}"] = dict(us=round(us, 1), floor_us=round(floor, 1),
                                                      ratio=round(us / floor, 2), MB=round(nbytes / 1e6, 2),
                                                      GFLOP=round(flops / 1e9, 2))
        except Exception as exc:  # a variant that does not compile or run: reported, never chosen
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[-3000:], trace=traceback.format_exc()[-3000:])
        rows.append(row)
        print_variant(row)
    return rows


def print_variant(row: dict) -> None:
    c = row["config"]
    name = (f"n{c['block_n']} k{c['block_k']} t{c['sub_tiles']} w{c['num_warps']} s{c['num_stages']} "
            f"split{c['split_k']} {c.get('decode', 'cvt')} p{c.get('pipeline', 0)} r{c.get('maxnreg') or '-'}")
    if "error" in row:
        print(f"  {name:<34} FAILED: {row['error'][-300:]}", flush=True)
        return
    verdict = "ok " if row["ok"] else "BAD"
    cells = "  ".join(f"{k} {v['us']:7.1f}/{v['floor_us']:6.1f}={v['ratio']:5.2f}" for k, v in row["proj"].items())
    print(f"  {name:<34} err {row['err']:.1e} inv {row['batch_invariant']!s:<5} {verdict} {cells}", flush=True)


DECODE_MAX = 64  # the table is chosen by decode sizes; larger batches (prefill chunks) are reported, not scored


def _scored_keys(row: dict, proj: str) -> list[str]:
    """The ``proj@tokens`` cells a variant is scored by: the decode batches, or every batch if none is that small."""
    keys = [k for k in row["proj"] if k.startswith(proj + "@")]
    return [k for k in keys if int(k.split("@")[1]) <= DECODE_MAX] or keys


def best_per_projection(rows: list[dict]) -> dict[str, dict]:
    """Per projection, the passing variant whose worst ratio over its scored batches (``_scored_keys``) is lowest."""
    best = {}
    for proj in ("w13", "w2"):
        scored = [(max(r["proj"][k]["ratio"] for k in _scored_keys(r, proj)), r) for r in rows if r.get("ok")]
        if scored:
            score, r = min(scored, key=lambda t: t[0])
            best[proj] = dict(config=r["config"], worst_ratio=score,
                              ratios={k: v["ratio"] for k, v in r["proj"].items() if k.startswith(proj + "@")})
    return best


def layer_rows(moe: MoE, sizes, rate, device) -> list[dict]:
    """The whole layer (route + experts + combine) under the default (table) configs."""
    ew, rows = moe.experts, []
    gen = torch.Generator(device=device).manual_seed(1)
    for n in sizes:
        x = torch.randn(n, ew.dim, generator=gen, device=device)
        with torch.no_grad():
            n_used = int(torch.unique(moe.route(x)[0]).numel())
            touched = (n_used * ew.expert_nbytes() + sum(t.numel() for t in ew.shared())
                       + moe.gate.weight.numel() * 4 + 2 * x.numel() * 4)
            us = timed_us(lambda: moe(x), device)
            out = moe(x)
            ew.impl = "reference"
            ref = moe(x)
            ew.impl = "triton"
            err = float(((out.double() - ref.double()).norm(dim=1) / ref.double().norm(dim=1)).max())
            invariant = torch.equal(moe(x[-1:])[0], out[-1])
        floor = touched / rate * 1e6
        rows.append(dict(tokens=n, experts_used=n_used, touched_MB=round(touched / 1e6, 2), floor_us=round(floor, 1),
                         graph_us=round(us, 1), ratio=round(us / floor, 2), rel_err=float(f"{err:.2e}"),
                         batch_invariant=invariant))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash-16e")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, TRITON_INTERPRET=1: checks the script")
    ap.add_argument("--variants", default=":", metavar="START:END",
                    help="only VARIANTS[START:END] (comma-separated slices or indices)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)),
                    help="token counts (the choice of best covers them all; a prefill chunk is 512 tokens)")
    ap.add_argument("--json", default=None, help="write the results (e.g. docs/perf/moe.json)")
    ap.add_argument("--tune-out", default=None, help="write the best config per weight shape as a config table")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    preset_name = "tiny" if args.smoke else args.preset
    sizes = SMOKE_BATCHES if args.smoke else tuple(int(b) for b in args.batches.split(","))
    variants = []
    for part in args.variants.split(","):  # "START:END" slices and single indices, e.g. "14,17,18:"
        start, colon, end = part.partition(":")
        variants += VARIANTS[int(start or 0) : int(end) if end else None] if colon else [VARIANTS[int(part)]]
    if args.smoke:
        variants = [C(), C(split_k=3, sub_tiles=1)]
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in true fp32
    dev = (f"{torch.cuda.get_device_name()}, " if device == "cuda" else "cpu (interpreted), ") + \
        f"torch {torch.__version__}, triton {triton.__version__}"
    rate, peak = copy_rate(device), bf16_peak(device)
    moe = build_layer(preset_name, device)
    ew = moe.experts
    print(f"{dev}; copy {rate / 1e12:.2f} TB/s; bf16 peak {peak / 1e12:.0f} TFLOP/s; {preset_name}: {ew}", flush=True)
    print(f"variants (per projection@tokens: us / floor us = ratio; tolerance {TOL} worst-row rel RMS):", flush=True)
    batches = make_batches(moe, sizes, device)
    with torch.no_grad():
        rows = time_variants(moe, batches, variants, rate, peak, device)
    best = best_per_projection(rows)
    print("\nbest per projection (lowest worst-batch ratio):")
    for proj, b in best.items():
        print(f"  {proj}: {b['config']}  ratios {b['ratios']}")
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    entries = []
    for proj, b in best.items():
        codes = ew.routed().w13_codes if proj == "w13" else ew.routed().w2_codes
        key = ConfigKey(name, "mxfp4", codes.shape[1], codes.shape[2] * 2)
        entries.append(table_entry(key, MoEGemmConfig(**b["config"]),
                                   f"benchmarks/moe_bench.py {datetime.date.today()}: {b['ratios']}"))
    if args.tune_out:
        with open(args.tune_out, "w") as f:
            json.dump({"entries": entries}, f, indent=1)
        print(f"wrote {args.tune_out}")
    # the whole layer under the table just chosen (read through the same lookup the op uses)
    gemm_config._table.cache_clear()
    table = gemm_config._table()
    table.update({ConfigKey(e["device"], e["format"], e["n"], e["k"]): MoEGemmConfig(**e["config"]) for e in entries})
    layer = layer_rows(moe, sizes, rate, device)
    print(f"\n{'tokens':>6} {'experts':>7} {'MB':>7} {'floor us':>8} {'time us':>8} {'ratio':>6} {'rel err':>8} inv")
    for r in layer:
        print(f"{r['tokens']:>6} {r['experts_used']:>7} {r['touched_MB']:>7} {r['floor_us']:>8} {r['graph_us']:>8} "
              f"{r['ratio']:>6} {r['rel_err']:>8} {r['batch_invariant']}")
    bad = sum(not r["batch_invariant"] or r["rel_err"] > TOL for r in layer) + (not best)
    if args.json:
        doc = dict(date=datetime.date.today().isoformat(), device=dev,
                   command="python3 -P benchmarks/moe_bench.py " + " ".join(sys.argv[1:]), preset=preset_name,
                   copy_TBps=round(rate / 1e12, 3), bf16_peak_TFLOPs=round(peak / 1e12), tolerance=TOL,
                   meaning=("variants: per projection (w13 = w1+w3 gated, w2) and batch, CUDA-graph us of the launch "
                            "alone; floor = max(bytes / copy rate, flops / bf16 peak); bytes = selected experts' MXFP4 "
                            "bytes + the shared expert's FP8 bytes + activations; ratio = us / floor. layer: route + "
                            "experts + combine under the best configs; floor = touched bytes / copy rate"),
                   variants=rows, best=best, table=entries, layer=layer)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
