"""Sparse MQA decode attention: Triton kernel vs the plain-torch reference, and the reference vs the engine.

Grids (named cases of ragged batches; with count lists of unequal length the rows run through every
(selected, window) pair, so B = 17 covers all twelve):
- "small" (CPU, Triton interpreted): the real record formats (D = 512, W = 128, 64 entries per block,
  the real 890 B/token block layout) with 16 heads; B in {1, 3, 17, 64}; selected counts {0, 1, 37, 512};
  window counts {0, 1, 128}; entry ids drawn from contexts up to 70K tokens (up to 1094 blocks per row).
  Also the tiny preset's geometry (4 heads, D = 64, W = 16).
- "real" (``-m gpu``, compiled Triton): 64 heads, D = 512, the same counts and contexts, inputs made on the GPU.

Tolerance, per row, against the reference computed in fp32 on the same q values:
- fp32 q: rel-RMS <= 2e-4 and max|err| <= 1e-3 * max|ref|. The kernel splits q and p into bf16 high + low
  parts (about 16 significant bits) with fp32 accumulation, so a logit is off by ~2^-17 * scale * sum|q_d k_d|:
  measured ~4e-6 here, <= 7e-5 on the benchmark's keys (6x the norm of real post-RMSNorm latents).
- bf16 q: rel-RMS <= 5e-3 and max|err| <= 2e-2 * max|ref|. p is rounded to bf16 for P @ V and the output
  to bf16 (2^-9 relative each); measured <= 2e-3. One flipped block-table entry among 512 selected
  entries moves a row by ~2e-2, so the comparison fails on it (test_corrupted_inputs_fail).
Rows with no visible key must be exactly 0. Outputs start as NaN, so an unwritten element fails.
"""

import os

import pytest
import torch

from flashtier.engine.kv.block_table import BlockTable
from flashtier.engine.model.attention import sparse_attention
from flashtier.engine.kv.paged_entries import PagedEntries
from flashtier.engine.kv.window_rings import WindowRings
from flashtier.kernels.quant.fp4 import pack_fp4_record, quantize_fp4
from flashtier.kernels.quant.fp8 import fp8_qdq, pack_fp8_record, quantize_fp8
from flashtier.kernels.sparse_mqa.op import SparseMQAConfig, sparse_mqa_decode
from flashtier.kvstore.kv_pool import GlobalKVPool
from flashtier.kvstore.layout import BlockLayout, KVGeometry

TOL = {torch.float32: (2e-4, 1e-3), torch.bfloat16: (5e-3, 2e-2)}
SEL, WIN = [0, 1, 37, 512], [0, 1, 128]
S20 = 3  # the decoder's stream (ratio 1: 64 entries per 64-token block)
NO_SPLIT = SparseMQAConfig(block_h=16, block_n=16, chunk=0, num_warps=4)  # the default is single-pass too
SPLIT_64 = SparseMQAConfig(block_h=16, block_n=32, chunk=64, num_warps=4)
SPLIT_128 = SparseMQAConfig(block_h=16, block_n=16, chunk=128, num_warps=4)


def geometry(d: int, w: int) -> KVGeometry:
    return KVGeometry(head_dim=d, index_head_dim=max(32, d // 4), source_ratios=(2, 2, 2, 1), window=w,
                      n_window_layers=2, n_encoder_window_layers=1)


def make_case(b, heads, dtype, device="cpu", *, d=512, w=128, sel=SEL, win=WIN, ctx=70_000, seed=0, n_phys=48):
    """Random decode inputs for B rows with ``sel`` / ``win`` counts: a real-layout pool (every block's S20 records valid FP4, the rest random bytes),
    per-row block tables over ``ctx`` tokens, sorted -1-padded selections, FP8 rings (layer 1 of 2)."""
    g = torch.Generator(device=device).manual_seed(seed)
    layout = BlockLayout(geometry(d, w), 64)
    image = torch.randint(0, 256, (n_phys, layout.block_bytes), generator=g, dtype=torch.uint8, device=device)
    pool = layout.split(image)[S20][0]
    e = pool.shape[1]
    pool.copy_(pack_fp4_record(*quantize_fp4(torch.randn(n_phys * e, d, generator=g, device=device))).view(pool.shape))
    if len(sel) == len(win):  # explicit (selected, window) pairs
        counts, wins = [sel[i % len(sel)] for i in range(b)], [win[i % len(win)] for i in range(b)]
    else:  # every pair in turn
        counts, wins = [sel[i % len(sel)] for i in range(b)], [win[(i // len(sel)) % len(win)] for i in range(b)]
    ctxs = [max(ctx >> (i % 4), max(counts[i], 1)) for i in range(b)]  # 70K, 35K, 17.5K, 8.75K tokens
    k_cap = max(max(counts), 1)
    idx = torch.full((b, k_cap), -1, dtype=torch.int32, device=device)
    for i, c in enumerate(counts):
        idx[i, :c] = torch.randperm(ctxs[i], generator=g, device=device)[:c].sort().values.int()
    table = torch.randint(0, n_phys, (b, -(-max(ctxs) // e)), generator=g, dtype=torch.int32, device=device)
    rings = pack_fp8_record(*quantize_fp8(torch.randn(b * 2 * w, d, generator=g, device=device)))
    q = (2 * torch.randn(b, heads, d, generator=g, device=device)).to(dtype)
    return dict(
        q=q, sel_idx=idx, sel_count=torch.tensor(counts, dtype=torch.int32, device=device), pool=pool,
        block_table=table, window=rings.view(b, 2, w, -1)[:, 1],
        win_start=torch.randint(0, w, (b,), generator=g, dtype=torch.int32, device=device),
        win_count=torch.tensor(wins, dtype=torch.int32, device=device),
        sink=torch.randn(heads, generator=g, device=device), scale=d**-0.5,
    )


def run(case, impl, config=None, **override):
    args = {**case, **override}
    out = torch.full_like(args["q"], float("nan"))  # poisoned: an unwritten element stays NaN
    return sparse_mqa_decode(**args, out=out, impl=impl, config=config)


def reference(case, **override):
    """The reference in fp32 on the same q values (the spec the kernel is held to)."""
    args = {**case, **override}
    return sparse_mqa_decode(**{**args, "q": args["q"].float()}, impl="reference")


def assert_close_rows(out, ref, dtype, name=""):
    rel_rms_tol, rel_max_tol = TOL[dtype]
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), f"{name}: non-finite or unwritten output"
    for i in range(ref.shape[0]):
        scale = ref[i].abs().max()
        if scale == 0:
            assert (out[i] == 0).all(), f"{name}: row {i} has no visible key and must be exactly 0"
            continue
        err = out[i] - ref[i]
        rel_rms = float(err.norm() / ref[i].norm())
        rel_max = float(err.abs().max() / scale)
        assert rel_rms <= rel_rms_tol and rel_max <= rel_max_tol, (
            f"{name}: row {i} rel-RMS {rel_rms:.2e} (tol {rel_rms_tol:.0e}), rel-max {rel_max:.2e} (tol {rel_max_tol:.0e})"
        )


SMALL = {  # name -> (B, heads, dtypes, extra make_case arguments)
    "b1_full": (1, 16, (torch.float32, torch.bfloat16), dict(sel=[512], win=[128])),
    "b1_empty": (1, 16, (torch.float32, torch.bfloat16), dict(sel=[0], win=[0])),
    "b3_ragged": (3, 16, (torch.float32, torch.bfloat16), dict(sel=[0, 37, 512], win=[128, 1, 0])),
    "b17_all_pairs": (17, 16, (torch.float32, torch.bfloat16), {}),
    "b64_all_pairs": (64, 16, (torch.bfloat16,), {}),
    "tiny_geometry": (3, 4, (torch.float32, torch.bfloat16), dict(d=64, w=16, sel=[0, 1, 8], win=[16, 3, 0], ctx=300)),
}
SMALL_PARAMS = [pytest.param(n, dt, id=f"{n}-{str(dt)[6:]}") for n, (_, _, dts, _) in SMALL.items() for dt in dts]


@pytest.mark.parametrize("name,dtype", SMALL_PARAMS)
def test_kernel_matches_reference_small(name, dtype):
    b, heads, _, extra = SMALL[name]
    case = make_case(b, heads, dtype, **extra)
    ref = reference(case)
    assert_close_rows(run(case, "triton"), ref, dtype, f"{name} default")
    if b <= 3:  # another tile size and the split-K paths (partials + combine)
        assert_close_rows(run(case, "triton", NO_SPLIT), ref, dtype, f"{name} no split")
        assert_close_rows(run(case, "triton", SPLIT_64), ref, dtype, f"{name} split 64")
        assert_close_rows(run(case, "triton", SPLIT_128), ref, dtype, f"{name} split 128")


def test_corrupted_inputs_fail():
    """One flipped block-table entry (or a window start off by one) must break the comparison."""
    case = make_case(4, 16, torch.bfloat16, sel=[1, 37, 512, 0], win=[0, 0, 128, 100])
    ref = reference(case)
    e = case["pool"].shape[1]
    for row in range(3):
        table = case["block_table"].clone()
        logical = int(case["sel_idx"][row, 0]) // e
        table[row, logical] = (table[row, logical] + 1) % case["pool"].shape[0]
        with pytest.raises(AssertionError, match=f"row {row} rel-RMS"):
            assert_close_rows(run(case, "triton", block_table=table), ref, torch.bfloat16, "flipped table")
    start = case["win_start"].clone()
    start[3] += 1
    with pytest.raises(AssertionError, match="row 3 rel-RMS"):
        assert_close_rows(run(case, "triton", win_start=start), ref, torch.bfloat16, "window start")


def test_row_result_does_not_depend_on_the_batch():
    """Batch invariance: a row alone (with other padding) gives the same bits as inside a ragged batch."""
    case = make_case(17, 16, torch.bfloat16)
    batch = run(case, "triton")
    for i in (0, 3, 7, 14):
        n = max(int(case["sel_count"][i]), 1)
        row = {k: (v[i : i + 1] if torch.is_tensor(v) and k not in ("pool", "sink") else v) for k, v in case.items()}
        row["sel_idx"] = row["sel_idx"][:, :n].contiguous()
        assert torch.equal(run(row, "triton")[0], batch[i]), f"row {i} changed with the batch"


def test_auto_on_cpu_is_the_reference():
    case = make_case(3, 16, torch.float32, sel=[0, 37, 512], win=[128, 1, 0])
    assert torch.equal(sparse_mqa_decode(**case), sparse_mqa_decode(**case, impl="reference"))


# ------------------------------------------------------------------ the reference is the engine's math


@pytest.mark.parametrize("stream", [0, S20], ids=["S2_ratio2", "S20_ratio1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_equals_engine_decode_step(stream, dtype):
    """A decode step as the engine runs it today (PagedEntries over GlobalKVPool, WindowRings, the ring keys
    plus the new token, attend's window mask, engine.model.attention.sparse_attention), one sequence at a
    time, equals the batched reference on the packed bytes after the step's ring write."""
    h, d, w = 8, 512, 128
    g = torch.Generator().manual_seed(5)
    layout = BlockLayout(geometry(d, w), 64)
    kv_pool = GlobalKVPool(layout, num_blocks=60)
    ratio = geometry(d, w).source_ratios[stream]
    e = layout.entries_per_block[stream]
    # (position p of the new token, decoder window truncation, selected count, count passed to the op)
    rows = [(1100, 0, 512, 512), (130, 100, 37, 40), (50, 0, 5, 5), (700, 0, 0, 0)]
    blocks = torch.randperm(60, generator=g).tolist()
    q = torch.randn(len(rows), h, d, generator=g, dtype=torch.float64).to(dtype)
    sink = torch.randn(h, generator=g)
    tables, idxs, windows, starts, counts, wcounts, expect = [], [], [], [], [], [], []
    for b, (p, dec_start, k, count) in enumerate(rows):
        n_ent = (p + 1) // ratio
        table = BlockTable([blocks.pop() for _ in range(-(-n_ent // e))])
        index_dim = layout.geometry.index_head_dim
        store = PagedEntries(kv_pool, stream, e, ratio, table, d, index_dim, dtype)
        store.write(torch.arange(n_ent), torch.randn(n_ent, d, generator=g), torch.randn(n_ent, index_dim, generator=g))
        rings = WindowRings(1, w, d, dtype, "cpu")
        old = torch.arange(max(0, p - w), p)
        rings.write(0, torch.randn(old.numel(), d, generator=g), old)
        idx = torch.full((512,), -1, dtype=torch.long)
        idx[:k] = torch.randperm(n_ent, generator=g)[:k].sort().values
        # the engine's attend(): ring keys before the write + this token's FP8-qdq kv, window mask
        local = rings.keys(0, dec_start)
        kv_raw = torch.randn(1, d, generator=g)
        keys = torch.cat((local.kv, fp8_qdq(kv_raw).to(dtype)))
        kpos = torch.cat((local.pos, torch.tensor([p])))
        lo = max(p - w + 1, dec_start)
        mask = ((kpos >= lo) & (kpos <= p) & (kpos >= 0))[None, :]
        gkv = store.main_rows(idx.clamp(min=0))[None]
        expect.append(sparse_attention(q[b : b + 1], keys, mask, gkv, (idx >= 0)[None], sink, d**-0.5)[0])
        rings.write(0, kv_raw, torch.tensor([p]))  # the step's ring write; the op reads the ring after it
        tables.append(table.ids + [0] * (20 - len(table)))
        idxs.append(idx)
        windows.append(rings.data[0])
        starts.append(lo % w)
        counts.append(count)
        wcounts.append(p - lo + 1)
    i32 = dict(dtype=torch.int32)
    out = sparse_mqa_decode(
        q, torch.stack(idxs).int(), torch.tensor(counts, **i32), kv_pool.streams[stream][0],
        torch.tensor(tables, **i32), torch.stack(windows), torch.tensor(starts, **i32), torch.tensor(wcounts, **i32),
        sink, d**-0.5, impl="reference",
    )
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(out, torch.stack(expect), **tol)
    assert out.abs().max() > 0.01  # not a vacuous comparison


# ------------------------------------------------------------------ argument checks


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(sel_idx=lambda c: c["sel_idx"].long()), "sel_idx must be int32"),
        (dict(pool=lambda c: c["pool"][..., :-1]), r"pool must have shape \[\*, \*, 288\]"),
        (dict(window=lambda c: c["window"][:2]), r"window must have shape \[3, \*, 528\]"),
        (dict(sink=lambda c: c["sink"][:3]), r"sink must have shape \[16\]"),
        (dict(q=lambda c: c["q"].half()), "q must be float32 or bfloat16 or float64"),
        (dict(scale=lambda c: 0.0), "scale must be a positive finite number"),
        (dict(win_count=lambda c: c["win_count"][None]), r"win_count must have shape \[3\]"),
    ],
)
def test_invalid_arguments_raise(change, match):
    case = make_case(3, 16, torch.float32, sel=[0, 37, 512], win=[128, 1, 0])
    bad = {k: (f(case) if k in change else v) for k, v in case.items() for f in [change.get(k)]}
    with pytest.raises(ValueError, match=match):
        sparse_mqa_decode(**bad)


def test_triton_path_rejects_what_it_cannot_run():
    case = make_case(1, 4, torch.float32, d=96, w=16, sel=[3], win=[2], ctx=100)
    with pytest.raises(ValueError, match="D a power of two"):
        sparse_mqa_decode(**case, impl="triton")
    assert torch.isfinite(sparse_mqa_decode(**case, impl="reference")).all()  # the reference takes D = 96
    with pytest.raises(ValueError, match="fp64 runs with impl='reference'"):
        sparse_mqa_decode(**make_case(1, 4, torch.float64, sel=[3], win=[2]), impl="triton")


# ------------------------------------------------------------------ real geometry on a GPU


REAL = {  # B -> counts: B = 1 is the full set; larger batches are ragged
    1: dict(sel=[512], win=[128]),
    3: dict(sel=[0, 37, 512], win=[128, 1, 0]),
    17: {},
    64: {},
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b", list(REAL))
@pytest.mark.parametrize("config", [None, SPLIT_128], ids=["default", "split128"])
def test_kernel_matches_reference_real_gpu(b, dtype, config):
    case = make_case(b, 64, dtype, "cuda", seed=b, n_phys=4096, **REAL[b])
    ref = reference(case)
    assert_close_rows(run(case, "triton", config), ref, dtype, f"real B={b}")
    row = max(i for i in range(b) if int(case["sel_count"][i]) > 0)
    table = case["block_table"].clone()
    logical = int(case["sel_idx"][row, 0]) // case["pool"].shape[1]
    table[row, logical] = (table[row, logical] + 1) % case["pool"].shape[0]
    with pytest.raises(AssertionError, match=f"row {row} rel-RMS"):
        assert_close_rows(run(case, "triton", config, block_table=table), ref, dtype, "flipped table")
