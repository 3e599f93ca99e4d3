"""FP8 linears of flash-16e (the V4.1-Flash geometry) at decode sizes: the two-launch path against the fused one.

For every FP8 weight shape of the model (N x K as stored: e4m3 + e8m0 per 32 x 32) and batch M in 1, 8, 64, with
fp32 activations x [M, K] (what the model hands the linear), each variant computes y = linear(x) [M, N] fp32:

    two_launch_reduce  act_quant launch, GEMM launch, split-K reduce launch (the form before the fused kernel)
    two_launch         act_quant launch, GEMM launch (split-K summed in the GEMM: the ordered fix-up)
    fused              one launch: x quantised in registers (hardware e4m3 conversion), fp8 MMA per 32-block
    fused_bits         the same with the quantiser's integer rounding instead of the hardware conversion
    fused_bf16mma      one launch, operands decoded to bf16 with the scales folded in, one MMA chain (other bits)

wo_a (grouped, activation not quantised) runs its one form (``fp8_gemm`` with bf16 x, as a bf16 model calls it) as
``float_act``.

    floor_us = max(bytes / copy rate, 2 M N K / fp8 dense peak)
    bytes    = weight + weight scales + x (fp32; bf16 for wo_a) + y (fp32): what any implementation must move once
    copy rate= bytes read + written by a 2 GiB device-to-device copy, measured in this run
    ratio    = us / floor_us (the goal: <= 1.3 at M = 1, 8, 64)

Times: CUDA-graph replays of C calls on C copies of the weight (C x weight bytes >= 3 x L2, so every call reads
its weight from HBM as in a decode step), median of 5 replays / C. Checks (``--smoke`` too): each variant against
the reference (``quantize_fp8`` + ``fp8_gemm_reference``): |y - ref| <= tol * sum |a*w| with tol 2^-10 for the
fp8 MMA (Hopper's fp8 MMA adds a block's 32 products with ~14 bits), 2^-12 for the bf16 MMA chain and the float
activation; bit-exact: fused, fused_bits, two_launch and two_launch_reduce are torch.equal; batch invariance:
rows 0..M-1 of the fused call at M = 1 and 8, and of an 80-row call (quantise launch, then the GEMM), equal the
same rows at M = 64. Exit status 1 if any check fails.

Then the float linear whose CUDA-core FMA dot was replaced by six bf16 tensor-core products
(kernels/invariant_linear mode 2): the mHC mixes, fp32 x [M, 20480] by fp32 w [24, 20480], timed the same way,
checked against float64 (2^-18 of sum |x*w|) and for batch invariance.

``--tune`` (instead of the rows) times launches per weight shape, the decode path's call (act_quant + GEMM; the
float-activation GEMM for wo_a) in CUDA graphs as above: first the tile of each row bucket (16: M = 1 + 8 summed,
32: M = 32, 64: M = 64; ``TUNE_TILES``) at the shape's current reduction, then the reduction (split_k x MMA form)
with the lowest worst ratio to the floor over M = 1, 8, 64 with those tiles, then whether each bucket's tile
quantises inside the GEMM's loads (one launch) or launches act_quant first. The chosen launches are checked
(tolerance, and rows equal across the buckets' tiles) before they are printed and written to ``--tune-out`` in
``kernels/fp8_gemm/gemm_configs.json``'s format. ``--jobs`` processes compile the candidate launches first.

Usage: python3 -P benchmarks/fp8_gemm_bench.py --json OUT.json   (flashtier importable, TRITON_INTERPRET=0)
       python3 -P benchmarks/fp8_gemm_bench.py --tune --tune-out TABLE.json [--shapes wq_b,wo_b]
       TRITON_INTERPRET=1 python3 -P benchmarks/fp8_gemm_bench.py --smoke  (tiny shapes on the CPU: checks only)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import statistics
import sys
import time

import torch
import triton

from flashtier.kernels.fp8_gemm import tuning
from flashtier.kernels.fp8_gemm.kernel import Fp8GemmConfig, default_config, fp8_gemm_triton, split_counters
from flashtier.kernels.fp8_gemm.op import fp8_gemm, fp8_gemm_fused
from flashtier.kernels.invariant_linear.op import linear as invariant_linear
from flashtier.kernels.quant.fp8 import quantize_fp8

# name: (N, K per group, groups): the FP8 linears of one V4.1 layer (+ indexer, Engram, DSpark)
SHAPES = {
    "wq_a": (1280, 5120, 1), "wq_b": (32768, 1280, 1), "wkv": (512, 5120, 1), "wo_a(G8)": (8192, 4096, 8),
    "wo_b": (5120, 8192, 1), "idx_wq_b": (4096, 1280, 1), "engram_wkv": (25600, 6144, 1),
    "main_proj": (5120, 15360, 1),
}
SMOKE_SHAPES = {"small": (96, 256, 1), "split": (40, 1024, 1), "grouped": (64, 128, 2)}
# the float linear whose FMA dot was replaced (kernels/invariant_linear, mode 2): the mHC mixes, fp32 [24, 4 x 5120]
MHC = (24, 20480)
SMOKE_MHC = (24, 1024)
MHC_TOL = 2**-18  # of sum |x*w|: six bf16 part products (dropped terms < 2^-32), fp32 tensor-core accumulation
BATCHES = (1, 8, 64)
TOL = {"fp8": 2**-10, "bf16": 2**-12}
# dense fp8 tensor-core peak (FLOP/s) by device name; the floor's FLOP term
FP8_PEAK = {"H100 PCIe": 1513e12, "H100": 1979e12, "H200": 1979e12, "H20": 296e12, "L40S": 733e12}
# --tune: (block_n, block_k, warps, stages) tried at every row bucket (block_m = the bucket; the first is the default
# tile), the batches timed for each bucket, the split-K counts and MMA forms tried for the reduction
TUNE_TILES = ((64, 128, 4, 4), (32, 128, 4, 4), (64, 256, 4, 3), (64, 128, 4, 6), (64, 64, 4, 8), (64, 128, 8, 4),
              (128, 64, 4, 4), (128, 128, 4, 4), (128, 128, 8, 3), (128, 64, 8, 5), (128, 256, 8, 3),
              (256, 64, 8, 3), (256, 128, 8, 3))
TUNE_ROWS = {16: (1, 8), 32: (32,), 64: (64,)}
TUNE_SPLITS = (1, 2, 4, 8, 16, 32)
MMA_TRIED = ("fp8", "bf16")


@dataclasses.dataclass(frozen=True)
class Case:
    """One weight and its activations, made on the device."""

    name: str
    w: torch.Tensor  # uint8 e4m3 codes [N, K per group]
    ws: torch.Tensor  # uint8 e8m0 [N / 32, K per group / 32]
    x: torch.Tensor  # [max batch, groups * K]: fp32 (quantised linears), bf16 (grouped: wo_a)
    groups: int


def make_case(name: str, n: int, k: int, groups: int, rows: int, dev: str, seed: int = 0) -> Case:
    g = torch.Generator(device=dev).manual_seed(seed)
    w = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8, device=dev) & 0xF7  # never a NaN code
    ws = torch.randint(118, 131, (-(-n // 32), k // 32), generator=g, dtype=torch.uint8, device=dev)
    spread = torch.exp2(torch.randint(-6, 6, (rows, groups * k // 32), generator=g, device=dev).float())
    x = torch.randn(rows, groups * k, generator=g, device=dev) * spread.repeat_interleave(32, 1)
    # the grouped linear (wo_a) reads a bf16 model's activations as bf16 (Fp8Linear.grouped)
    return Case(name, w, ws, x.to(torch.bfloat16) if groups > 1 else x, groups)


def variants(case: Case, m: int) -> dict:
    """name -> (callable(x, w, ws) -> y, MMA form for the tolerance)."""
    dev = case.x.device
    n, k = case.w.shape
    cfg = default_config(m, n, k, dev)
    cnt = split_counters(triton.cdiv(n, 16), dev)
    if case.groups > 1:
        return {"float_act": (lambda x, w, ws: fp8_gemm(x, None, w, ws, groups=case.groups, impl="triton",
                                                          counters=cnt), "bf16")}

    def two(reduce_launch):
        def run(x, w, ws):
            codes, scales = quantize_fp8(x, impl="triton")
            out = torch.empty((x.shape[0], n), dtype=torch.float32, device=dev)
            return fp8_gemm_triton(codes, scales, w, ws, 32, 1, out, cfg, counters=cnt, reduce_launch=reduce_launch)
        return run

    bits = dataclasses.replace(cfg, quant="bits")
    bf16 = dataclasses.replace(cfg, mma="bf16")
    return {
        "two_launch_reduce": (two(True), "fp8"),
        "two_launch": (two(False), "fp8"),
        "fused": (lambda x, w, ws: fp8_gemm_fused(x, w, ws, impl="triton", config=cfg, counters=cnt, fuse=True), "fp8"),
        "fused_bits": (lambda x, w, ws: fp8_gemm_fused(x, w, ws, impl="triton", config=bits, counters=cnt, fuse=True), "fp8"),
        "fused_bf16mma": (lambda x, w, ws: fp8_gemm_fused(x, w, ws, impl="triton", config=bf16, counters=cnt, fuse=True),
                          "bf16"),
    }


def reference(case: Case, x: torch.Tensor, absolute: bool = False) -> torch.Tensor:
    """The spec on the device; ``absolute``: the same sum over |a| and |w| (the error bound's scale)."""
    w = case.w & 0x7F if absolute else case.w
    if case.groups > 1:
        return fp8_gemm(x.abs() if absolute else x, None, w, case.ws, groups=case.groups, impl="reference")
    codes, scales = quantize_fp8(x, impl="reference")
    return fp8_gemm(codes & 0x7F if absolute else codes, scales, w, case.ws, impl="reference")


def check(case: Case) -> list[str]:
    """Failures of one shape's checks (empty when all pass): tolerance, bit-exactness, batch invariance."""
    bad = []
    x64 = case.x[:64]
    ref, bound = reference(case, x64), reference(case, x64, absolute=True)
    outs = {}
    for name, (fn, form) in variants(case, 64).items():
        y = outs[name] = fn(x64, case.w, case.ws)
        worst = float(((y - ref).abs() / bound.clamp_min(1e-30)).max())
        if not worst <= TOL[form]:
            bad.append(f"{case.name} {name}: {worst:.2e} of sum |a*w| > {TOL[form]:.1e}")
    same = [v for v in ("two_launch_reduce", "two_launch", "fused", "fused_bits") if v in outs]
    for v in same[1:]:
        if not torch.equal(outs[v], outs[same[0]]):
            bad.append(f"{case.name}: {v} differs from {same[0]} (expected bit-identical)")
    for name in ("fused", "fused_bf16mma", "float_act"):
        if name not in outs:
            continue
        for m in (1, 8):
            fn = variants(case, m)[name][0]
            if not torch.equal(fn(case.x[:m], case.w, case.ws), outs[name][:m]):
                bad.append(f"{case.name} {name}: rows of an M={m} call differ from the same rows at M=64")
        if case.x.shape[0] > 64:
            fn = variants(case, case.x.shape[0])[name][0]
            if not torch.equal(fn(case.x, case.w, case.ws)[:64], outs[name]):
                bad.append(f"{case.name} {name}: rows of an M={case.x.shape[0]} call differ from M=64")
    return bad


def graph_us(fn, x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Median time of one call: a CUDA graph of one call per weight copy, replayed 5 times (CPU: one call's wall
    time, for ``--smoke`` only)."""
    if not x.is_cuda:
        t = time.perf_counter()
        fn(x, *weights[0])
        return (time.perf_counter() - t) * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w, ws in weights[:2]:  # compile and warm outside the capture
            fn(x, w, ws)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w, ws in weights:
            fn(x, w, ws)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(weights))
    del graph
    return statistics.median(times)


def copy_rate(dev: str) -> float:
    """Bytes read + written per second by a device-to-device copy (2 GiB; 64 MiB on the CPU)."""
    x = torch.empty((2 << 30) if dev == "cuda" else (64 << 20), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    y.copy_(x)
    sync()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync()
    rate = 2 * x.numel() * 10 / (time.perf_counter() - t)
    del x, y
    return rate


def fp8_peak(name: str) -> float:
    for key, peak in FP8_PEAK.items():  # "H100 PCIe" before "H100"
        if key in name:
            return peak
    return 1979e12


def floor_bytes(case: Case, m: int) -> int:
    n, k = case.w.shape
    return case.w.numel() + case.ws.numel() + m * case.groups * k * case.x.element_size() + m * n * 4


def weight_copies(case: Case, l2_bytes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    c = max(2, -(-3 * l2_bytes // case.w.numel()))
    return [(case.w, case.ws)] + [(case.w.clone(), case.ws.clone()) for _ in range(c - 1)]


def _linear(case: Case, cfg: Fp8GemmConfig, cnt: torch.Tensor):
    """The decode path's call for ``case`` under launch ``cfg``: ``fp8_gemm_fused`` (act_quant + GEMM, or one
    launch when ``cfg.fuse``) for the quantised linears, the float-activation grouped GEMM for wo_a."""
    if case.groups > 1:
        return lambda x, w, ws: fp8_gemm(x, None, w, ws, groups=case.groups, config=cfg, counters=cnt,
                                         impl="triton")
    return lambda x, w, ws: fp8_gemm_fused(x, w, ws, config=cfg, counters=cnt, impl="triton")


_CASES: dict[tuple[int, int, int], Case] = {}  # a compile worker's random weights, by shape


def _precompile_one(job: tuple) -> None:
    """Pool worker: compile (into the shared Triton cache) the launch ``job`` = (N, K, groups, rows, config
    fields, device) by running it once on random data of the real shapes (same specialisations as the timed
    calls)."""
    n, k, groups, m, fields, dev = job
    case = _CASES.get((n, k, groups))
    if case is None:
        case = _CASES[(n, k, groups)] = make_case("compile", n, k, groups, 80, dev)
    _linear(case, Fp8GemmConfig(**fields), split_counters(triton.cdiv(n, 16), dev))(case.x[:m], case.w, case.ws)
    if dev == "cuda":
        torch.cuda.synchronize()


def precompile(case: Case, launches: list[tuple[int, Fp8GemmConfig]], jobs: int) -> None:
    """Compile ``launches`` ((rows, config) pairs) of ``case``'s shape in ``jobs`` processes at once, so the
    serial timing loop finds them in the Triton cache (compiling one takes seconds; timing it, milliseconds)."""
    if jobs <= 1 or not launches:
        return
    n, k = case.w.shape
    work = [(n, k, case.groups, m, dataclasses.asdict(cfg), case.x.device.type) for m, cfg in launches]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(jobs, len(work)), mp_context=ctx) as pool:
        list(pool.map(_precompile_one, work))


def tune(case: Case, copies, dev_name: str, rate: float, peak: float, jobs: int) -> tuple[list[dict], list[dict]]:
    """Table entries for one weight shape (``tuning.read_table``'s format): the fastest tile per row bucket
    (``TUNE_ROWS``' batches summed) at the shape's current reduction, then the reduction whose worst ratio to
    the floor over M = 1, 8, 64 is lowest with those tiles; then the chosen launches are checked (tolerance
    against the reference, and rows of M = 1 and 8 equal to the same rows at M = 64 across the buckets'
    different tiles). Prints what it times; a check that fails raises (nothing unchecked reaches a table)."""
    n, k = case.w.shape
    dev = case.x.device
    cnt = split_counters(triton.cdiv(n, 16), dev)
    red = tuning.reduction_for(n, k, dev)
    floor = {m: max(floor_bytes(case, m) / rate, 2 * m * n * case.groups * k / peak) * 1e6 for m in BATCHES}

    def config(tile: tuning.Fp8Tile, r: tuning.Fp8Reduction) -> Fp8GemmConfig:
        return Fp8GemmConfig(tile.block_m, tile.block_n, tile.block_k, r.split_k, tile.num_warps, tile.num_stages,
                             mma=r.mma, fuse=tile.fuse)

    def timed(m: int, tile: tuning.Fp8Tile, r: tuning.Fp8Reduction) -> float:
        return graph_us(_linear(case, config(tile, r), cnt), case.x[:m], copies)

    grids = {b: [tuning.Fp8Tile(b, *t) for t in TUNE_TILES] for b in TUNE_ROWS}
    precompile(case, [(TUNE_ROWS[b][0], config(t, red)) for b in grids for t in grids[b]], jobs)
    best_tiles: dict[int, tuning.Fp8Tile] = {}
    ranked: dict[int, list[tuning.Fp8Tile]] = {}
    notes: dict[int, str] = {}
    for b, grid in grids.items():
        default = tuning.tile_for(TUNE_ROWS[b][0], n, k, dev)
        times = {t: sum(timed(m, t, red) for m in TUNE_ROWS[b]) for t in grid}
        ranked[b] = sorted(times, key=times.get)
        best_tiles[b] = ranked[b][0]
        base = times.get(default) or sum(timed(m, default, red) for m in TUNE_ROWS[b])
        notes[b] = (f"M={'+'.join(map(str, TUNE_ROWS[b]))}: {times[best_tiles[b]]:.1f} us (default tile "
                    f"{base:.1f} us), split_k {red.split_k} {red.mma}")
        print(f"  {case.name} rows<={b}: best {best_tiles[b]} {notes[b]}", flush=True)
    splits = [s for s in TUNE_SPLITS if k // s >= 128]
    reds = [tuning.Fp8Reduction(split_k=s, mma=mma) for mma in MMA_TRIED for s in splits]
    bucket = {m: tuning.row_bucket(m) for m in BATCHES}
    precompile(case, [(m, config(best_tiles[bucket[m]], r)) for r in reds for m in BATCHES], jobs)
    worst = {}
    for r in reds:
        ratios = [timed(m, best_tiles[bucket[m]], r) / floor[m] for m in BATCHES]
        worst[r] = max(ratios)
        print(f"  {case.name} {r}: " + " / ".join(f"{v:.2f}x" for v in ratios), flush=True)
    best = min(worst, key=worst.get)
    # A tile may change the MMA instruction (64 weight rows per warp group for wgmma; fewer fall back to
    # mma.sync, whose bf16 chain rounds differently): the smaller buckets take their fastest tile whose rows
    # equal the same rows at M = 64, so a row's bits never follow the batch
    top = max(TUNE_ROWS)
    full = _linear(case, config(best_tiles[top], best), cnt)(case.x[:top], case.w, case.ws)
    for b in sorted(TUNE_ROWS)[:-1]:
        keep = next((t for t in ranked[b] if all(
            torch.equal(_linear(case, config(t, best), cnt)(case.x[:m], case.w, case.ws), full[:m])
            for m in TUNE_ROWS[b])), None)
        if keep is None:
            raise RuntimeError(f"{case.name}: no tile of rows <= {b} gives the bits of M = {top} under {best}")
        if keep != best_tiles[b]:
            notes[b] += f"; fastest tile with the bits of M = {top} under {best}: {keep}"
            print(f"  {case.name} rows<={b}: {best_tiles[b]} changes the bits under {best}; takes {keep}", flush=True)
            best_tiles[b] = keep
    if case.groups == 1:  # quantise inside the GEMM's loads where one launch beats two (same bits)
        for b, tile in best_tiles.items():
            fused = dataclasses.replace(tile, fuse=True)
            two, one = (sum(timed(m, t, best) for m in TUNE_ROWS[b]) for t in (tile, fused))
            notes[b] += f"; act_quant + GEMM {two:.1f} us, quantised in the loads {one:.1f} us"
            if one < two:
                best_tiles[b] = fused
    problems = check_launches(case, {m: config(best_tiles[bucket[m]], best) for m in BATCHES}, cnt)
    if problems:
        raise RuntimeError(f"{case.name}: the tuned launches fail their checks: {problems}")
    final = [timed(m, best_tiles[bucket[m]], best) / floor[m] for m in BATCHES]
    stamp = f"benchmarks/fp8_gemm_bench.py --tune ({dev_name}) {time.strftime('%Y-%m-%d')}"
    reductions = [tuning.reduction_entry((dev_name, n, k), best, f"{stamp}: ratio to floor at M = 1 / 8 / 64 "
                                         + " / ".join(f"{v:.2f}x" for v in final)
                                         + f" (default launches {worst.get(red, float('nan')):.2f}x worst)")]
    tiles = [tuning.tile_entry((dev_name, n, k, b), t, f"{stamp}: {notes[b]}") for b, t in best_tiles.items()]
    return reductions, tiles


def check_launches(case: Case, launches: dict[int, Fp8GemmConfig], cnt: torch.Tensor) -> list[str]:
    """Failures of the launches a tuning run chose (``launches``: rows -> config, one reduction): each within
    tolerance of the reference at its row count, and the rows of every call equal to the same rows of the
    largest call (the buckets' tiles differ; the bits must not)."""
    bad = []
    top = max(launches)
    outs = {m: _linear(case, cfg, cnt)(case.x[:m], case.w, case.ws) for m, cfg in launches.items()}
    form = "bf16" if case.groups > 1 else launches[top].mma
    ref, bound = reference(case, case.x[:top]), reference(case, case.x[:top], absolute=True)
    worst = float(((outs[top] - ref).abs() / bound.clamp_min(1e-30)).max())
    if not worst <= TOL[form]:
        bad.append(f"{worst:.2e} of sum |a*w| > {TOL[form]:.1e}")
    for m, y in outs.items():
        if not torch.equal(y, outs[top][:m]):
            bad.append(f"rows of an M={m} call differ from the same rows at M={top}")
    return bad


def float_linear_rows(shape: tuple[int, int], dev: str, rate: float, l2: int, bad: list[str]) -> list[dict]:
    """The mHC mixes through ``invariant_linear`` (fp32 x, fp32 w) at M = 1, 8, 64: checked against float64
    (``MHC_TOL``) and for batch invariance (appends failures to ``bad``), timed like the FP8 rows."""
    n, k = shape
    g = torch.Generator(device=dev).manual_seed(7)
    w = torch.randn(n, k, generator=g, device=dev) * 0.05
    x = torch.randn(64, k, generator=g, device=dev)
    full = invariant_linear(x, w, impl="triton")
    ref = (x.double() @ w.double().T)
    bound = x.double().abs() @ w.double().abs().T
    worst = float(((full.double() - ref).abs() / bound).max())
    if not worst <= MHC_TOL:
        bad.append(f"mhc mixes: {worst:.2e} of sum |x*w| > {MHC_TOL:.1e}")
    # the interpreter's fp32 dot (numpy) sums in an order that follows the tile shape: invariance is a GPU check
    for m in (1, 8) if x.is_cuda else ():
        if not torch.equal(invariant_linear(x[:m], w, impl="triton"), full[:m]):
            bad.append(f"mhc mixes: rows of an M={m} call differ from the same rows at M=64")
    copies = [(w, None)] + [(w.clone(), None) for _ in range(max(1, 3 * l2 // w.nbytes))]
    out = []
    for m in BATCHES:
        floor_us = (w.nbytes + m * k * 4 + m * n * 4) / rate * 1e6
        us = graph_us(lambda xx, ww, _: invariant_linear(xx, ww, impl="triton"), x[:m], copies)
        out.append(dict(linear="mhc_mixes_fp32", n=n, k=k, m=m, floor_us=round(floor_us, 2), us=round(us, 2),
                        ratio=round(us / floor_us, 2), err=float(f"{worst:.2e}")))
        print(f"  mhc mixes N={n} K={k} M={m:<3} floor {floor_us:7.2f} us  invariant_linear {us:.1f} "
              f"({us / floor_us:.2f}x)  err {worst:.1e}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None, help="write the rows, device and command here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1): checks only")
    ap.add_argument("--tune", action="store_true",
                    help="tune instead: time tiles and reductions per shape, check the chosen launches, print them")
    ap.add_argument("--tune-out", default=None, help="with --tune: write the chosen entries here (gemm_configs.json's "
                    "format; FLASHTIER_FP8_GEMM_CONFIGS=FILE tries them, then copy them into the checked-in table)")
    ap.add_argument("--jobs", type=int, default=12, help="with --tune: processes compiling launches before timing")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of " + ",".join(SHAPES))
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = {k: shapes[k] for k in args.shapes.split(",") if k in shapes}  # in the order given
    torch.backends.cuda.matmul.allow_tf32 = False
    if dev == "cuda":
        props = torch.cuda.get_device_properties(0)
        dev_name, l2 = props.name, getattr(props, "L2_cache_size", 50 << 20)
    else:
        dev_name, l2 = "cpu (TRITON_INTERPRET=1: times are the interpreter's, not a measurement)", 1 << 20
    rate, peak = copy_rate(dev), fp8_peak(dev_name)
    print(f"{dev_name}, torch {torch.__version__}, triton {triton.__version__}; copy {rate / 1e12:.3f} TB/s "
          f"(read + write); fp8 dense peak {peak / 1e12:.0f} TFLOP/s (spec)", flush=True)
    if args.tune:
        return tune_main(args, shapes, dev, dev_name, l2, rate, peak)
    bad, rows = [], []
    for name, (n, k, groups) in shapes.items():
        case = make_case(name, n, k, groups, 80, dev)
        found = check(case)
        bad += found
        for line in found:
            print("  CHECK FAILED:", line, flush=True)
        copies = weight_copies(case, l2)
        for m in BATCHES:
            fl_bytes, flops = floor_bytes(case, m), 2 * m * n * groups * k
            floor_us = max(fl_bytes / rate, flops / peak) * 1e6
            row = dict(linear=name, n=n, k=k * groups, groups=groups, m=m, floor_us=round(floor_us, 2),
                       floor_bytes=fl_bytes, split_k=default_config(m, n, k, case.x.device).split_k, us={}, ratio={})
            for vname, (fn, _) in variants(case, m).items():
                us = graph_us(fn, case.x[:m], copies)
                row["us"][vname], row["ratio"][vname] = round(us, 2), round(us / floor_us, 2)
            rows.append(row)
            print(f"{name:>11} M={m:<3} floor {floor_us:7.2f} us  " + "  ".join(
                f"{v} {row['us'][v]:.1f} ({row['ratio'][v]:.2f}x)" for v in row["us"]), flush=True)
        del case, copies
        if dev == "cuda":
            torch.cuda.empty_cache()
    mhc_rows = float_linear_rows(SMOKE_MHC if args.smoke else MHC, dev, rate, l2, bad)
    print("\nsum over the quantised shapes (us):")
    for m in BATCHES:
        sums: dict[str, float] = {}
        for r in rows:
            if r["m"] == m and r["groups"] == 1:
                for v, us in r["us"].items():
                    sums[v] = sums.get(v, 0.0) + us
        print(f"  M={m:<3} " + "  ".join(f"{v} {us:.1f}" for v, us in sums.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=dev_name, torch=torch.__version__, triton=triton.__version__,
                           command="python3 -P " + " ".join(sys.argv), copy_TBps=round(rate / 1e12, 3),
                           fp8_peak_TFLOPs=round(peak / 1e12), meaning=" ".join(__doc__.split("\n\n")[1:5]),
                           rows=rows, mhc_rows=mhc_rows, failed_checks=bad), f, indent=1)
    print(f"\n{len(bad)} check(s) failed" + "".join(f"\n  {b}" for b in bad))
    return 1 if bad else 0


def tune_main(args, shapes, dev: str, dev_name: str, l2: int, rate: float, peak: float) -> int:
    """``--tune``: every shape's entries, printed and written to ``--tune-out``."""
    table = {"reductions": [], "tiles": []}
    failed = 0
    for name, (n, k, groups) in shapes.items():
        case = make_case(name, n, k, groups, 80, dev)
        try:
            reductions, tiles = tune(case, weight_copies(case, l2), dev_name, rate, peak, args.jobs)
        except RuntimeError as exc:  # this shape keeps its current launches; the others still get tuned
            print(f"  {name}: NOT TUNED: {exc}", flush=True)
            failed += 1
            continue
        table["reductions"] += reductions
        table["tiles"] += tiles
        if args.tune_out:  # after every shape: a run cut short keeps what it finished
            with open(args.tune_out, "w") as f:
                json.dump(table, f, indent=1)
        del case
        if dev == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(table, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
