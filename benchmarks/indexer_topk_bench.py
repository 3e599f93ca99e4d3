"""Indexer top-k on one CUDA GPU: bit-exact check against the reference on the real geometry, a variant sweep,
and the byte floor.

Real geometry: 32 heads x 128, k = 512, the decoder stream S20 (64 entries per 64-token block, 68 B
MXFP4 index-K records) of a pool laid out exactly as kvstore/layout.py (890 B/token block images), each
row its own blocks. Keys are random e2m1 codes with e8m0 scale bytes in [118, 130]; q is random fp32
(quantised by the op); every input is made on the GPU.

    floor = packed index-K bytes the rows must read (68 B per visible or candidate entry) / copy rate
    copy rate = bytes read + written by a 2 GiB device-to-device copy, measured in this run
    ratio = op time / floor

Modes: "plain" (Full layer: top-512 of all visible entries), "layer20" (plus the candidate pool: top-2048
of 8-entry block maxima, newest block pinned), "reindex" (top-512 inside the 2048 candidate blocks,
16384 entries). Times are medians of triton.testing.do_bench (L2 cleared before every run) of CUDA-graph
replays (GPU time: the op makes no host sync, so it captures whole) of the op (q quantisation + scoring +
torch.topk + two finalize launches) and of each part alone; ``eager_us`` is the plain call, host launch
overhead included (it dominates at small B). Every timed configuration is first checked against the
reference (same device): sel_idx, counts, candidate blocks and score bits must be identical.

Usage: python3 -P benchmarks/indexer_topk_bench.py --json OUT.json [--sweep] (flashtier importable, TRITON_INTERPRET=0)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
from triton.testing import do_bench

from flashtier.kernels.indexer_topk.kernel import IndexerTopKConfig, finalize, score_keys, select_from_keys
from flashtier.kernels.indexer_topk.op import DEFAULT_CONFIG, indexer_topk, indexer_topk_with_candidates
from flashtier.kernels.quant.mxfp4 import quantize_mxfp4
from flashtier.kvstore.layout import BlockLayout, KVGeometry

IH, ID, K, CTX, NBLK, CB = 32, 128, 512, 70_000, 2048, 8
BATCHES, SWEEP_BATCHES = (1, 3, 17, 64), (1, 64)
GEO = KVGeometry(head_dim=512, index_head_dim=ID, source_ratios=(2, 2, 2, 1), window=128, n_window_layers=40,
                 n_encoder_window_layers=20)
LAYOUT = BlockLayout(GEO, 64)
E = LAYOUT.entries_per_block[3]
REC = GEO.index_entry_bytes  # 68
SWEEP = [  # (block_n, num_warps, swar_decode, normal_decode, tiles per program: 0 = auto)
    (128, 4, True, False, 0), (128, 4, True, False, 1), (128, 4, True, False, 4), (128, 4, True, False, 16),
    (128, 4, False, False, 0), (128, 4, False, True, 0), (64, 4, True, False, 0), (256, 8, True, False, 0),
]
FINAL_SWEEP = [(1024, 4, 4), (1024, 1, 4), (1024, 16, 4), (2048, 2, 8), (512, 8, 4)]  # (final_block, tiles, warps)


def make_inputs(b: int, ctx: int, seed: int = 0) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    cols = -(-ctx // E)
    image = torch.randint(0, 256, (b * cols, LAYOUT.block_bytes), generator=g, dtype=torch.uint8, device=dev)
    pool = LAYOUT.split(image)[3][1]
    pool[..., ID // 2 :] = torch.randint(118, 131, pool[..., ID // 2 :].shape, generator=g, dtype=torch.uint8, device=dev)
    table = torch.randperm(b * cols, generator=g, device=dev).view(b, cols).int()
    return dict(q=2 * torch.randn(b, IH, ID, generator=g, device=dev),
                weights=torch.randn(b, IH, generator=g, device=dev) * (ID**-0.5 * IH**-0.5),
                index_pool=pool, block_table=table, n_visible=torch.full((b,), ctx, dtype=torch.int32, device=dev))


def same(out, ref) -> bool:
    ok = True
    for f in ("sel_idx", "counts", "cand_blocks", "cand_counts", "scores", "block_scores"):
        a, r = getattr(out, f), getattr(ref, f)
        if r is not None:
            ok &= bool(torch.equal(a, r))
    return ok


def run_mode(inp: dict, mode: str, cfg: IndexerTopKConfig, cand=None, **kw):
    if mode == "layer20":
        return indexer_topk_with_candidates(**inp, k=K, n_blocks=NBLK, cand_block=CB, config=cfg, **kw)
    return indexer_topk(**inp, k=K, candidates=cand if mode == "reindex" else None, cand_block=CB, config=cfg, **kw)


def check(inp, mode, cfg, cand=None) -> bool:
    out = run_mode(inp, mode, cfg, cand, impl="triton", return_scores=True)
    ref = run_mode(inp, mode, cfg, cand, impl="reference", return_scores=True)
    return same(out, ref)


def us(fn) -> float:
    return 1e3 * do_bench(fn, warmup=25, rep=200, return_mode="median")


def graph_us(fn) -> float:
    """GPU time of ``fn`` replayed from a CUDA graph (no host launch overhead)."""
    fn()  # compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return us(g.replay)


def score_us(inp, cfg) -> float:
    qc, qs = quantize_mxfp4(inp["q"])
    args = (qc, qs, inp["weights"], inp["index_pool"], inp["block_table"], inp["n_visible"], None, None, CB, 0, cfg)
    return graph_us(lambda: score_keys(*args))


def parts(inp, mode, cfg, cand=None) -> dict:
    """Median µs of the op and of each launch alone (validation and allocation are host work)."""
    qc, qs = quantize_mxfp4(inp["q"])
    cc, cn = cand if mode == "reindex" else (None, None)
    nb = NBLK if mode == "layer20" else 0
    args = (qc, qs, inp["weights"], inp["index_pool"], inp["block_table"], inp["n_visible"], cc, cn, CB, nb, cfg)
    keys, bkeys = score_keys(*args)
    lens, mode_id = (inp["n_visible"], 0) if cc is None else (cn, 2)
    top = torch.topk(keys, min(K, keys.shape[1]), dim=1, sorted=False).values
    out = dict(
        us=graph_us(lambda: run_mode(inp, mode, cfg, cand, impl="triton")),
        eager_us=us(lambda: run_mode(inp, mode, cfg, cand, impl="triton")),
        quant_us=graph_us(lambda: quantize_mxfp4(inp["q"])),
        score_us=graph_us(lambda: score_keys(*args)),
        topk_us=graph_us(lambda: torch.topk(keys, min(K, keys.shape[1]), dim=1, sorted=False)),
        final_us=graph_us(lambda: finalize(keys, top, top.shape[1], K, lens, mode_id, cc, CB, cfg)),
    )
    if nb:
        out["pool_select_us"] = graph_us(lambda: select_from_keys(bkeys, NBLK, inp["n_visible"], 1, None, CB, cfg))
    del top
    return out


def copy_rate() -> float:
    x = torch.randint(0, 256, (2 << 30,), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (do_bench(lambda: y.copy_(x), warmup=10, rep=100, return_mode="median") * 1e-3)


def gemm_rate() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.float16) for _ in range(2))
    return 2 * 8192**3 / (do_bench(lambda: a @ b, warmup=10, rep=100, return_mode="median") * 1e-3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time the scoring variants (tile, warps, decode)")
    args = ap.parse_args()
    dev = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    rate, flops = copy_rate(), gemm_rate()
    print(f"{dev}; D2D copy {rate / 1e12:.2f} TB/s (read + write); fp16 GEMM {flops / 1e12:.0f} TFLOP/s", flush=True)
    bad, sweep, rows = 0, [], []
    if args.sweep:
        print("\nsweep (plain mode, 70K entries per row): scoring kernel us per config and B", flush=True)
        inputs = {b: make_inputs(b, CTX, seed=b) for b in SWEEP_BATCHES}
        for bn, nw, swar, normal, tiles in SWEEP:
            cfg = IndexerTopKConfig(block_n=bn, num_warps=nw, swar_decode=swar, normal_decode=normal, tiles=tiles)
            ok = all(check(inputs[b], "plain", cfg) for b in SWEEP_BATCHES)
            bad += not ok
            t = {b: score_us(inputs[b], cfg) for b in SWEEP_BATCHES}
            sweep.append(dict(config=cfg.__dict__, exact=ok, score_us={str(b): round(v, 1) for b, v in t.items()}))
            print(f"  n{bn:<4}w{nw} swar={swar:d} normal={normal:d} tiles={tiles:<3} {'exact' if ok else 'DIFFERS'} "
                  + " ".join(f"B{b}={v:8.1f}" for b, v in t.items()), flush=True)
        print("finalize (count + write) us per (block, tiles, warps) and B, plain mode", flush=True)
        for fb, ft, fw in FINAL_SWEEP:
            cfg = IndexerTopKConfig(final_block=fb, final_tiles=ft, final_warps=fw)
            ok = all(check(inputs[b], "plain", cfg) for b in SWEEP_BATCHES)
            bad += not ok
            t = {b: parts(inputs[b], "plain", cfg)["final_us"] for b in SWEEP_BATCHES}
            sweep.append(dict(config=cfg.__dict__, exact=ok, final_us={str(b): round(v, 1) for b, v in t.items()}))
            print(f"  block {fb:<5} tiles {ft:<3} w{fw} {'exact' if ok else 'DIFFERS'} "
                  + " ".join(f"B{b}={v:8.1f}" for b, v in t.items()), flush=True)
        del inputs
    cfg = DEFAULT_CONFIG
    print(f"\nrows with {cfg}", flush=True)
    for b in BATCHES:
        inp = make_inputs(b, CTX, seed=b)
        l20 = indexer_topk_with_candidates(**inp, k=K, n_blocks=NBLK, cand_block=CB, config=cfg)
        cand = (l20.cand_blocks, l20.cand_counts)
        for mode in ("plain", "layer20", "reindex"):
            ok = check(inp, mode, cfg, cand)
            bad += not ok
            p = parts(inp, mode, cfg, cand)
            entries = b * (NBLK * CB if mode == "reindex" else CTX)
            floor = entries * REC / rate * 1e6
            mma = 2 * IH * ID * entries / flops * 1e6
            rows.append(dict(batch=b, mode=mode, entries_per_row=entries // b, exact=ok,
                             **{k: round(v, 2) for k, v in p.items()}, floor_us=round(floor, 3),
                             ratio=round(p["us"] / floor, 1), score_ratio=round(p["score_us"] / floor, 1),
                             mma_floor_us=round(mma, 3)))
            print(f"  B={b} {mode}: {rows[-1]}", flush=True)
        del inp
    hdr = (f"{'B':>3} {'mode':>8} {'us':>7} {'eager':>7} {'score':>7} {'topk':>7} {'final':>7} {'floor':>7} "
           f"{'ratio':>6} {'s/floor':>7} exact")
    print("\n" + hdr)
    for r in rows:
        print(f"{r['batch']:>3} {r['mode']:>8} {r['us']:>7.1f} {r['eager_us']:>7.1f} {r['score_us']:>7.1f} "
              f"{r['topk_us']:>7.1f} {r['final_us']:>7.1f} {r['floor_us']:>7.2f} {r['ratio']:>6.1f} "
              f"{r['score_ratio']:>7.1f} {r['exact']}")
    if args.json:
        with open(args.json, "w") as f:
            cmd = "python3 -P benchmarks/indexer_topk_bench.py" + (" --sweep" if args.sweep else "") + " --json docs/perf/indexer_topk.json"
            json.dump(dict(device=dev, command=cmd, copy_TBps=round(rate / 1e12, 3), fp16_gemm_TFLOPs=round(flops / 1e12),
                           config=cfg.__dict__, rows=rows, sweep=sweep), f, indent=1)
    print(f"\n{bad} check(s) not bit-exact")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
