"""moe_grouped_ffn: grouped expert GEMMs + combine (Triton) against the plain-torch reference.

CPU grids (kernels interpreted): tokens N in {1, 3, 17, 64, 300} with (experts, top-k) (16, 6) or (8, 2),
on the tiny preset's geometry (D = 64, I = 32) and on D = 128, I = 96 (two K steps, a half-empty N tile).
Routed experts are random MXFP4 stacks, the shared expert random FP8 with 32 x 32 blocks, the routing from
``moe_route``. N = 1, 3 run the default config (4 token tiles per chunk); 17, 64, 300 chunks of 2 and 1 tiles
(an expert's tiles span several chunks at 64 and 300 tokens).
Expert subsets (``expert_ids``, expert parallelism): 1, some and all experts of a stack, ragged (unsorted ids,
experts no pair uses), against the reference subset; a partition's outputs summed against the full op; in
float64 the reference subset bit for bit against a per-expert loop.
GPU (``-m gpu``): the flash-16e geometry (D = 5120, I = 2304, 16 experts, top-6, shared I = 2304).

Tolerance, per token row, relative RMS against the fp32 reference:
- The GEMMs multiply exactly (bf16 operands hold the MXFP4 / FP8 values exactly; fp32 operands under the
  interpreter) and differ from the reference only in summation order: <= 1e-6 (measured ~1e-8 on the CPU).
- That noise can move an activation across an FP8 rounding boundary before w2 (probability ~1e-6 per
  element on the CPU); the element then moves one e4m3 step (<= 1/8 of it), which moves its row by up to
  ~1e-2 at I = 32. So: at most 1% of rows above 1e-6, none above 5e-2. On the GPU (I = 2304) the noise is
  ~1e-6 and a flip moves a row by ~1e-3: median <= 1e-5, every row <= 5e-3.
Stages are also checked alone: w2 on identical activations (<= 1e-6, no quantisation between) and the
combine (bit-identical to the reference's summation order). A corrupted weight byte fails the check.
"""

import dataclasses
import os

import pytest
import torch

from flashtier.kernels.moe.combine_kernel import moe_combine_triton
from flashtier.kernels.moe.gemm_config import MoEFfnConfig
from flashtier.kernels.moe.grouped_gemm_kernel import TOKEN_TILE, MoEGemmConfig, launch_moe_gemm
from flashtier.kernels.quant.fp8_weight import as_raw_bytes, quantize_fp8_weight
from flashtier.kernels.moe.align import moe_align
from flashtier.kernels.moe.grouped_gemm import moe_grouped_ffn
from flashtier.kernels.moe.grouped_gemm_reference import (
    act_qdq, combine_reference, dense_fp8_expert, dense_mxfp4_expert, expert_ffn_reference, moe_ffn_reference,
)
from flashtier.kernels.moe import grouped_gemm_reference
from flashtier.kernels.moe.route import moe_route
from flashtier.kernels.moe.weights import FP8Expert, MXFP4Experts
from flashtier.kernels.quant.mxfp4 import quantize_mxfp4

SMALL_CHUNKS = MoEFfnConfig(MoEGemmConfig(sub_tiles=2), MoEGemmConfig(sub_tiles=1))
GRID = [  # (N, experts, top-k, D, I, config)
    (1, 16, 6, 64, 32, None),
    (3, 16, 6, 64, 32, None),
    (17, 8, 2, 128, 96, SMALL_CHUNKS),  # two K steps per projection, a half-empty 64-row N tile
    (64, 16, 6, 64, 32, SMALL_CHUNKS),
    (300, 8, 2, 64, 32, SMALL_CHUNKS),
]
LIMIT = 10.0


def make_experts(e, d, i, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(e, 2 * i, d, generator=g, device=device) / d**0.5
    w2 = torch.randn(e, d, i, generator=g, device=device) / i**0.5
    routed = MXFP4Experts(*quantize_mxfp4(w13), *quantize_mxfp4(w2))
    s13 = torch.randn(2 * i, d, generator=g, device=device) / d**0.5
    s2 = torch.randn(d, i, generator=g, device=device) / i**0.5
    shared = FP8Expert(*(as_raw_bytes(t) for t in (*quantize_fp8_weight(s13), *quantize_fp8_weight(s2))))
    return routed, shared


def make_case(n, e, k, d, i, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed + 1)
    x = 3 * torch.randn(n, d, generator=g, device=device)  # |a| and |b| reach the SwiGLU clamp
    gate = torch.randn(e, d, generator=g, device=device) / d**0.5
    idx, w = moe_route(x, gate, torch.zeros(e, device=device), k, 1.5)
    return x, idx, w


def row_errors(ref, out):
    ref, out = ref.double().cpu(), out.double().cpu()
    assert bool(torch.isfinite(out).all())
    return (out - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)


def assert_close_rows(ref, out, tight=1e-6, loose=5e-2, max_loose_frac=0.01):
    err = row_errors(ref, out)
    n_loose = int((err > tight).sum())
    assert n_loose <= max_loose_frac * err.numel(), f"{n_loose} of {err.numel()} rows above {tight}: {err.max():.2e}"
    assert float(err.max()) <= loose, f"worst row {float(err.max()):.2e} > {loose}"


@pytest.fixture(scope="module")
def grid_results():
    out = {}
    for n, e, k, d, i, cfg in GRID:
        routed, shared = make_experts(e, d, i, seed=n)
        x, idx, w = make_case(n, e, k, d, i, seed=n)
        ref = moe_grouped_ffn(x, idx, w, routed, shared, LIMIT, impl="reference")
        tri = moe_grouped_ffn(x, idx, w, routed, shared, LIMIT, impl="triton", config=cfg)
        out[n] = dict(routed=routed, shared=shared, x=x, idx=idx, w=w, ref=ref, tri=tri)
    return out


@pytest.mark.parametrize("n", [g[0] for g in GRID])
def test_triton_matches_reference(grid_results, n):
    r = grid_results[n]
    assert r["tri"].dtype == torch.float32 and r["tri"].shape == r["ref"].shape
    assert_close_rows(r["ref"], r["tri"])


def test_a_corrupted_weight_byte_is_detected(grid_results):
    r = grid_results[17]
    e = int(r["idx"][0, 0])
    bad = MXFP4Experts(r["routed"].w13_codes.clone(), *r["routed"][1:])
    bad.w13_codes[e, 5, 3] ^= 0x77  # two codes of row 5 of expert e's w1
    ref = moe_grouped_ffn(r["x"], r["idx"], r["w"], bad, r["shared"], LIMIT, impl="reference")
    with pytest.raises(AssertionError, match="rows above"):
        assert_close_rows(ref, r["tri"])


def test_w2_stage_alone_is_tight():
    """The w2 launch (routed tiles, then the shared expert's) on given activations: only the summation order
    differs from act @ W2^T."""
    n, e, k, d, i = 17, 8, 2, 128, 96
    routed, shared = make_experts(e, d, i, seed=3)
    _, idx, _ = make_case(n, e, k, d, i, seed=3)
    bm = TOKEN_TILE
    al = moe_align(idx, e, bm, impl="reference")
    n_r = al.sorted_ids.numel()
    act = torch.randn(n_r + bm * (-(-n // bm)), i).to(torch.bfloat16)
    out = launch_moe_gemm(act, torch.empty(n * k + n, d), (routed.w2_codes, routed.w2_scales),
                          (shared.w2_codes, shared.w2_scales), gated=False, ids=al.sorted_ids,
                          block_expert=al.block_expert, first_block=al.first_block, n_tok=n, top_k=k, k_r=i, k_s=i,
                          n_r=d, n_s=d)
    ref = torch.empty(n * k + n, d)
    for row, f in enumerate(al.sorted_ids.tolist()):
        if f < n * k:
            ref[f] = act[row].float() @ dense_mxfp4_expert(routed, int(al.block_expert[row // bm]))[2].T
    ref[n * k :] = act[n_r : n_r + n].float() @ dense_fp8_expert(shared)[2].T
    assert float(row_errors(ref, out).max()) <= 1e-6


# Under the interpreter a tl.dot is numpy's matmul, whose rounding depends on the operands' memory layout and the
# CPU (OpenBLAS's fused multiply-adds for some layouts, numpy's own multiply-then-add loop for others): the staged
# loop's stacked w1 / w3 tile and transposed row loads can round a few elements one ulp apart from the register
# buffer's (measured on an AVX-512 CPU: 10 of 2,176 elements, worst row 1.4e-8). The bits are a property of the
# device's MMA order, checked by the GPU test below.
INTERPRETED_DOT_NOISE = 1e-7


def test_staged_loads_run_the_register_buffered_dots(grid_results):
    """``pipeline`` (loads staged through shared memory, activations as whole rows) runs the same dots in the same
    order as the register double buffer: routed and shared tiles, both projections, with and without split-K,
    two stagings (2 stages; 3 stages with a register cap). Equal up to the interpreter's matmul rounding."""
    r = grid_results[17]
    for split in (1, 2):
        base = MoEGemmConfig(sub_tiles=2, split_k=split)
        run = lambda c: moe_grouped_ffn(r["x"], r["idx"], r["w"], r["routed"], r["shared"], LIMIT,  # noqa: E731
                                        impl="triton", config=MoEFfnConfig(c, c))
        want = run(base)
        for pipeline, maxnreg in ((2, None), (3, 128)):
            got = run(dataclasses.replace(base, pipeline=pipeline, maxnreg=maxnreg))
            err = float(row_errors(want, got).max())
            assert err <= INTERPRETED_DOT_NOISE, f"split {split}, pipeline {pipeline}: {err:.1e}"
            assert_close_rows(r["ref"], got)


def test_staged_loads_check_fails_on_a_dropped_k_step(grid_results, monkeypatch):
    """The staged check above can fail: a staged loop that skips its last K step is far outside the noise."""
    r = grid_results[17]
    base = MoEGemmConfig(sub_tiles=2)
    run = lambda c: moe_grouped_ffn(r["x"], r["idx"], r["w"], r["routed"], r["shared"], LIMIT,  # noqa: E731
                                    impl="triton", config=MoEFfnConfig(c, c))
    want = run(base)
    x = r["x"].clone()
    x[:, -32:] = 0  # the last 32 K columns of the first projection (what a dropped K step leaves out)
    bad = moe_grouped_ffn(x, r["idx"], r["w"], r["routed"], r["shared"], LIMIT, impl="triton",
                          config=MoEFfnConfig(dataclasses.replace(base, pipeline=2), dataclasses.replace(base, pipeline=2)))
    assert float(row_errors(want, bad).max()) > 1e3 * INTERPRETED_DOT_NOISE


def test_combine_is_the_reference_order_bit_for_bit():
    n, k, d = 37, 6, 300
    out = torch.randn(n * k, d)
    idx = torch.rand(n, 16).argsort(dim=1)[:, :k].int()
    shared = torch.randn(n, d)
    ref = combine_reference(out.view(n, k, d), idx, shared)
    assert torch.equal(moe_combine_triton(out, idx, shared), ref)
    assert torch.equal(moe_combine_triton(out, idx, None), combine_reference(out.view(n, k, d), idx, None))


def test_token_alone_equals_token_in_batch():
    n, e, k, d, i = 64, 8, 2, 64, 32
    routed, shared = make_experts(e, d, i, seed=4)
    x, idx, w = make_case(n, e, k, d, i, seed=4)
    batch = moe_grouped_ffn(x, idx, w, routed, shared, LIMIT, impl="triton")
    for t in (0, 41):
        alone = moe_grouped_ffn(x[t : t + 1], idx[t : t + 1], w[t : t + 1], routed, shared, LIMIT, impl="triton")
        assert torch.equal(alone[0], batch[t])


def test_without_shared_expert_and_empty_batch():
    n, e, k, d, i = 3, 8, 2, 64, 32
    routed, _ = make_experts(e, d, i, seed=6)
    x, idx, w = make_case(n, e, k, d, i, seed=6)
    ref = moe_grouped_ffn(x, idx, w, routed, None, LIMIT, impl="reference")
    assert_close_rows(ref, moe_grouped_ffn(x, idx, w, routed, None, LIMIT, impl="triton"))
    empty = moe_grouped_ffn(x[:0], idx[:0], w[:0], routed, None, LIMIT, impl="triton")
    assert empty.shape == (0, d)


def test_bad_arguments_raise():
    routed, shared = make_experts(8, 64, 32)
    x, idx, w = make_case(3, 8, 2, 64, 32)
    cases = [
        (dict(x=x[:, :40]), "D a positive multiple of 32"),
        (dict(idx=idx.float()), r"idx must be an int32/int64 tensor \[3, k\]"),
        (dict(route_w=w[:, :1]), "route_w must be a float tensor"),
        (dict(experts=routed._replace(w2_codes=routed.w2_codes[:, :, :8])),
         r"experts.w2_codes must have shape \[8, 64, 16\]"),
        (dict(shared=shared._replace(w13_scales=shared.w13_scales.float())), "shared.w13_scales must be a uint8"),
        (dict(limit=0.0), "limit .swiglu_limit. must be a positive finite number"),
        (dict(x=x.double(), impl="triton"), "float64 runs with impl='reference'"),
        (dict(expert_ids=torch.arange(3)), r"expert_ids must be an int32/int64 tensor \[8\]"),
        (dict(expert_ids=torch.tensor([0, 1, 2, 3, 4, 5, 6, 6])), "expert_ids must be distinct non-negative"),
    ]
    for change, match in cases:
        args = dict(x=x, idx=idx, route_w=w, experts=routed, shared=shared, limit=LIMIT) | change
        with pytest.raises(ValueError, match=match):
            moe_grouped_ffn(**args)


SUBSETS = {  # name: global ids held by the rank, in stack order
    "one": [5], "some-ragged": [6, 0, 3], "unused-expert": [1, 7], "all": list(range(8)),
}


@pytest.fixture(scope="module")
def subset_case():
    n, e, k, d, i = 17, 8, 2, 64, 32
    routed, shared = make_experts(e, d, i, seed=7)
    x, idx, w = make_case(n, e, k, d, i, seed=7)
    idx[:, 0] = torch.where(idx[:, 0] == 7, 6, idx[:, 0])  # expert 7 appears only as a second choice or not at all
    idx[:, 1] = torch.where(idx[:, 1] == 7, torch.where(idx[:, 0] == 2, 4, 2), idx[:, 1])
    assert not bool((idx == 7).any())  # "unused-expert" holds an expert no pair uses
    full = moe_grouped_ffn(x, idx, w, routed, shared, LIMIT, impl="triton")
    return dict(routed=routed, shared=shared, x=x, idx=idx, w=w, full=full)


def stack(routed: MXFP4Experts, ids: list[int]) -> tuple[MXFP4Experts, torch.Tensor]:
    t = torch.tensor(ids)
    return MXFP4Experts(*(field[t] for field in routed)), t


@pytest.mark.parametrize("name", list(SUBSETS))
def test_expert_subset_matches_the_reference_subset(subset_case, name):
    c = subset_case
    sub, ids = stack(c["routed"], SUBSETS[name])
    args = (c["x"], c["idx"], c["w"], sub, None, LIMIT)
    ref = moe_grouped_ffn(*args, expert_ids=ids, impl="reference")
    tri = moe_grouped_ffn(*args, expert_ids=ids, impl="triton")
    held = torch.isin(c["idx"], ids).any(dim=1)  # tokens with a held pair; the others must be exactly zero
    assert torch.equal(tri[~held], torch.zeros_like(tri[~held])) and torch.equal(ref[~held], tri[~held])
    if bool(held.any()):
        assert_close_rows(ref[held], tri[held])


def test_all_experts_as_a_subset_is_the_full_op_bit_for_bit(subset_case):
    c = subset_case
    sub, ids = stack(c["routed"], list(range(8)))
    out = moe_grouped_ffn(c["x"], c["idx"], c["w"], sub, c["shared"], LIMIT, expert_ids=ids, impl="triton")
    assert torch.equal(out, c["full"])


@pytest.mark.parametrize("broken", [False, True])
def test_a_partition_of_the_experts_sums_to_the_full_op(subset_case, broken):
    """Each pair's expert output is the same bits in every launch (it does not depend on the other rows), so the
    partition's sum differs from the full op only by the order of <= k + 1 fp32 additions per element: <= 1e-6
    relative per row. Broken: one part computed without its last expert."""
    c = subset_case
    parts = [[0, 2, 4, 6], [7, 3], [1, 5]]
    if broken:
        parts[0] = parts[0][:-1]
    y = torch.zeros_like(c["full"])
    for j, part in enumerate(parts):
        sub, ids = stack(c["routed"], part)
        y = y + moe_grouped_ffn(c["x"], c["idx"], c["w"], sub, c["shared"] if j == 0 else None, LIMIT,
                                expert_ids=ids, impl="triton")
    err = row_errors(c["full"], y)
    if broken:
        assert float(err.max()) > 1e-3
    else:
        assert float(err.max()) <= 1e-6


def test_float64_subset_is_the_per_expert_sum_bit_for_bit(subset_case):
    """The reference subset (float64, the oracle mode) == an explicit loop over the held experts in ascending id;
    a partition's sum == the full op to float64 rounding (1e-12 relative per row)."""
    c = subset_case
    x, idx, w = c["x"].double(), c["idx"], c["w"].double()
    sub, ids = stack(c["routed"], SUBSETS["some-ragged"])
    out = moe_grouped_ffn(x, idx, w, sub, None, LIMIT, expert_ids=ids)
    xq = act_qdq(x)
    loop = torch.zeros_like(xq)
    for e in sorted(SUBSETS["some-ragged"]):
        rows, slot = torch.nonzero(idx == e, as_tuple=True)
        dense = tuple(t.double() for t in dense_mxfp4_expert(c["routed"], e))
        loop.index_add_(0, rows, expert_ffn_reference(xq[rows], dense, w[rows, slot], LIMIT))
    assert out.dtype == torch.float64 and torch.equal(out, loop)
    full = moe_grouped_ffn(x, idx, w, c["routed"], None, LIMIT)
    rest, rest_ids = stack(c["routed"], [e for e in range(8) if e not in SUBSETS["some-ragged"]])
    y = out + moe_grouped_ffn(x, idx, w, rest, None, LIMIT, expert_ids=rest_ids)
    assert float(row_errors(full, y).max()) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_shared", [True, False])
def test_one_activation_rounding_per_layer_is_one_per_expert_bit_for_bit(subset_case, dtype, with_shared, monkeypatch):
    """moe_ffn_reference rounds the weighted activations of all experts (and the shared one) in one FP8 call;
    that is each expert's own expert_ffn_reference, bit for bit (fp32 and float64), with or without the shared
    expert. A rounding whose blocks straddle two rows (the stack flattened) is caught."""
    c = subset_case
    x, idx, w = c["x"].to(dtype), c["idx"], c["w"].to(dtype)
    dense = {e: tuple(t.to(dtype) for t in dense_mxfp4_expert(c["routed"], e)) for e in range(8)}
    shared = tuple(t.to(dtype) for t in dense_fp8_expert(c["shared"])) if with_shared else None
    got = moe_ffn_reference(x, idx, w, dense.__getitem__, shared, LIMIT)
    xq = act_qdq(x)
    loop = torch.zeros_like(xq)
    for e in sorted(set(idx.flatten().tolist())):
        rows, slot = torch.nonzero(idx == e, as_tuple=True)
        loop.index_add_(0, rows, expert_ffn_reference(xq[rows], dense[e], w[rows, slot], LIMIT))
    if shared is not None:
        loop = loop + expert_ffn_reference(xq, shared, None, LIMIT)
    assert got.dtype == dtype and torch.equal(got, loop)
    # broken: one rounding whose 32-element blocks straddle two stacked rows (the stack flattened, shifted by 16)
    def straddling_qdq(t):
        flat = torch.roll(t.flatten(), 16)
        return torch.roll(act_qdq(flat.reshape(-1, 32)).flatten(), -16).reshape(t.shape)

    monkeypatch.setattr(grouped_gemm_reference, "act_qdq", straddling_qdq)
    assert not torch.equal(moe_ffn_reference(x, idx, w, dense.__getitem__, shared, LIMIT), loop)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton (TRITON_INTERPRET=0)")
def test_real_geometry_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's GEMMs in true fp32
    e, k, d, i = 16, 6, 5120, 2304
    routed, shared = make_experts(e, d, i, device="cuda")
    x, idx, w = make_case(300, e, k, d, i, device="cuda")
    for n in (1, 3, 17, 64, 300):
        out = moe_grouped_ffn(x[:n], idx[:n], w[:n], routed, shared, LIMIT)
        ref = moe_grouped_ffn(x[:n], idx[:n], w[:n], routed, shared, LIMIT, impl="reference")
        err = row_errors(ref, out)
        assert float(err.median()) <= 1e-5 and float(err.max()) <= 5e-3, f"N={n}: {err.median():.1e} {err.max():.1e}"
        if n in (17, 64, 300):  # batch invariance on the device, across the 16 -> 32 M tile switch (64, 300 rows)
            for t in (0, n - 1):
                alone = moe_grouped_ffn(x[t : t + 1], idx[t : t + 1], w[t : t + 1], routed, shared, LIMIT)
                assert torch.equal(alone[0], out[t])
    # the staged loop and the register buffer: the same MMAs in the same order, so the same bits on the device
    for split in (1, 2):
        base = MoEGemmConfig(sub_tiles=2, split_k=split)
        for n in (1, 64):
            want = moe_grouped_ffn(x[:n], idx[:n], w[:n], routed, shared, LIMIT, config=MoEFfnConfig(base, base))
            for pipeline, maxnreg in ((2, None), (3, 128)):
                c = dataclasses.replace(base, pipeline=pipeline, maxnreg=maxnreg)
                got = moe_grouped_ffn(x[:n], idx[:n], w[:n], routed, shared, LIMIT, config=MoEFfnConfig(c, c))
                assert torch.equal(want, got), f"N={n}, split {split}, pipeline {pipeline}"
