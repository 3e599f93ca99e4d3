"""FP8 block-scaled GEMM in Triton: e4m3 weights with e8m0 scales per (bn x 32) block, read as stored.

Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), splits)``. A program owns BLOCK_N weight rows and BLOCK_M
activation rows and walks its K range in steps of BLOCK_K:

    acc[n, m] += (W[n, kb] . A[m, kb]) * sw[n // bn, kb] * sa[m, kb]        (kb: 32-blocks, ascending)

The MMA is "swapped" (weight rows are the MMA's M, activation rows its N) so decode batches of 1-64 rows
still fill a 64-row wgmma; the tile is transposed back before the store. Decode (M <= 64) is one M tile,
so every weight byte is read once. Prefill tiles are 128 x 128.

Activations (constexpr ``A_MODE``):

    A_CODES  e4m3 codes + e8m0 scales per 32 (``act_quant`` ran before: the two-launch path)
    A_QUANT  fp32 / bf16 values, quantised per 1 x 32 block in registers as they are loaded, by the standalone
             quantiser's rule and helpers (``quant/fp8.py``: amax floor 1e-4, s = 2^ceil(log2(amax / 448)) from
             the correctly rounded quotient, e4m3 round-to-nearest-even of clamp(x / s)): the same e4m3 values
             and scales as ``act_quant``, so the same MMAs and the same bits as A_CODES, in one launch
    A_FLOAT  fp32 / bf16 values, not quantised (the wo_a form; fp32 rows are split into bf16 high + low parts)

On the GPU the e4m3 rounding of A_QUANT is the hardware conversion (``quant="cvt"``, cvt.rn.satfinite after the
clamp, which is round-to-nearest-even like torch) or the quantiser's integer bit path (``quant="bits"``);
benchmarks/fp8_gemm_bench.py checks both against the two-launch path bit for bit.

Reduction order (``tuning.Fp8Reduction``, chosen per weight shape, never per batch): K is cut into ``split_k``
ranges of whole 32-blocks, each summed from zero, then the partials are added in ascending split order.
``mma="fp8"``: one fp8 MMA per 32-block, scaled in fp32 (the official two-level accumulation).
``mma="bf16"``: weights and activations decoded to bf16 with their power-of-two scales folded in (exact:
e4m3 x 2^k has 4 significant bits), one tensor-core chain per range (exact products, fp32 accumulation,
no per-block promotion; A_FLOAT's fp32 rows still as high + low parts).

Split-K without a second launch: with M <= 64 the splits are separate programs; each stores its fp32 partial
([S, M, N] workspace), then takes a ticket from the tile's counter (``atomic_add``, acq_rel). The program that
draws the last ticket adds the S partials in ascending split order (whatever order the programs finished in),
stores the tile and resets the counter to zero for the next launch (the counters must start zeroed:
``counters`` argument, kept by the caller). M > 64: each program runs its splits one after the other and
adds them in the same order (no workspace). Both give the bits of the ordered sum.

Precision: each fp8 32-block product is an MMA with fp32 output; on Hopper the fp8 MMA adds its 32 exact
products with an accumulator of ~14 significant bits (DeepSeek-V3 report), so an fp32 output matches the
fp32 reference to ~2^-13 of sum |a*w|, not to fp32 rounding. Under TRITON_INTERPRET=1 (bf16 / fp8 cannot
reach numpy's dot) each 32-block product is a float64 dot of the decoded values, exact for e4m3 x e4m3, rounded
once to fp32 (``_exact_dot``): the bits do not depend on the tile width, and both ``mma`` forms run this loop.

``fp8_scaled_mma`` is the reusable inner loop (row index vectors in, accumulator out).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashtier.kernels.fp8_gemm.tuning import (
    DECODE_ROWS, MAX_SPLIT_K, MMA_FORMS, reduction_for, tile_for,
)
from flashtier.kernels.quant.fp8 import _fp8_codes, _fp8_scale
from flashtier.kernels.quant.fp8_bits import _e4m3_to_f32, _e8m0_to_f32, _f32_to_bf16_rne

_REDUCE_BLOCK = 1024  # elements per program of ``_split_reduce_kernel`` (invariant_linear's split launch)
_INLINE_ABOVE = DECODE_ROWS  # rows: above, each program runs the K splits itself (no fp32 partials in HBM)
A_CODES, A_QUANT, A_FLOAT = 0, 1, 2
QUANT_FORMS = ("cvt", "bits")


@dataclass(frozen=True)
class Fp8GemmConfig:
    """A whole launch: tile (``block_m`` / ``block_n`` >= 16, ``block_k`` a multiple of 32, warps, stages), the
    reduction order (``split_k``, ``mma``: see ``tuning.Fp8Reduction``), the e4m3 rounding of in-kernel
    activation quantisation (``quant``: "cvt" hardware conversion or "bits" integer path; same bits) and
    whether ``fp8_gemm_fused`` quantises inside the loads (``fuse``; same bits)."""

    block_m: int = 16  # activation rows per program (the swapped MMA's N)
    block_n: int = 64  # weight rows per program (the swapped MMA's M)
    block_k: int = 128  # K per loop step: block_k // 32 scale blocks
    split_k: int = 1  # K ranges summed from zero, then added in ascending order; 1 = none
    num_warps: int = 4
    num_stages: int = 4
    mma: str = "fp8"
    quant: str = "cvt"
    fuse: bool = False

    def __post_init__(self) -> None:
        pow2 = lambda v: isinstance(v, int) and v > 0 and not v & (v - 1)  # noqa: E731
        if not (pow2(self.block_m) and self.block_m >= 16 and pow2(self.block_n) and self.block_n >= 16
                and pow2(self.block_k) and self.block_k >= 32):
            raise ValueError(f"Fp8GemmConfig: block_m, block_n >= 16 and block_k >= 32, powers of two; got {self}")
        if isinstance(self.split_k, bool) or not isinstance(self.split_k, int) or not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"Fp8GemmConfig: split_k must be an int in [1, {MAX_SPLIT_K}], got {self.split_k!r}")
        if self.mma not in MMA_FORMS or self.quant not in QUANT_FORMS:
            raise ValueError(f"Fp8GemmConfig: mma in {MMA_FORMS}, quant in {QUANT_FORMS}; got {self.mma!r}, "
                             f"{self.quant!r}")


def default_config(m: int, n: int, kw: int, device: torch.device) -> Fp8GemmConfig:
    """The reduction from (N, K, device) only (``tuning.reduction_for``: batch invariance), the tile from the row
    count as well (``tuning.tile_for``). No autotuning at run time."""
    red, tile = reduction_for(n, kw, device), tile_for(m, n, kw, device)
    return Fp8GemmConfig(block_m=tile.block_m, block_n=tile.block_n, block_k=tile.block_k, split_k=red.split_k,
                         num_warps=tile.num_warps, num_stages=tile.num_stages, mma=red.mma,
                         fuse=tile.fuse and m <= DECODE_ROWS)


@triton.jit
def _e4m3_values(b_code, INTERPRET: tl.constexpr):
    """fp32 values of uint8 e4m3 codes: the hardware conversion (GPU), the bit decoder (interpreter)."""
    if INTERPRET:
        return _e4m3_to_f32(b_code.to(tl.int32))
    return b_code.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _quant_rows(b_x, AXIS: tl.constexpr, HW_CVT: tl.constexpr, INTERPRET: tl.constexpr):
    """Quantise fp32 ``b_x`` per block of 32 along its last axis ``AXIS`` as ``quantize_fp8`` does: ``(q, b_exp)``
    with ``b_exp`` the int32 e8m0 bytes (``AXIS`` reduced) and ``q`` the e4m3 values of clamp(x / s), as
    float8e4nv (GPU) or fp32 (interpreter: the quantiser's integer path, decoded)."""
    b_exp, b_inv = _fp8_scale(tl.max(tl.abs(b_x), axis=AXIS))
    b_inv = tl.expand_dims(b_inv, AXIS)
    if INTERPRET:
        q = _e4m3_to_f32(_fp8_codes(b_x, b_inv))
    elif HW_CVT:
        # x * 2^-k is exact (one rounding of x / s, as the quantiser's); clamp, then cvt.rn.satfinite (RNE)
        q = tl.minimum(tl.maximum(b_x * b_inv, -448.0), 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        q = _fp8_codes(b_x, b_inv).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return q, b_exp


@triton.jit
def _exact_dot(b_w, b_a):
    """Interpreter only: ``b_w [BN, 32] . b_a [BM, 32]^T`` in float64, rounded once to fp32. A 32-block of e4m3
    x e4m3 products (8 significant bits each, exponents within 2^-18..2^17) sums exactly in float64, so the
    result is the correctly rounded block sum whatever order numpy's BLAS adds in: the same bits for every tile
    width (numpy's fp32 matmul is not: its order follows the matrix shape, which would fake a batch dependence)."""
    return tl.dot(b_w.to(tl.float64), tl.trans(b_a.to(tl.float64))).to(tl.float32)


@triton.jit
def fp8_scaled_mma(
    acc, p_w, p_sw, p_a, p_sa, o_n, m_n, o_m, m_m, k_lo, k_hi,
    stride_wn, stride_swn, stride_am, stride_sam,
    BN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr, A_MODE: tl.constexpr, A_SPLIT: tl.constexpr,
    MMA_BF16: tl.constexpr, HW_CVT: tl.constexpr, INTERPRET: tl.constexpr,
):
    """``acc [BN, BM] += sum_kb (W[o_n, kb] . A[o_m, kb]) * sw[o_n // BN_SCALE, kb] * sa[o_m, kb]`` over the
    32-blocks kb of [k_lo, k_hi) (multiples of 32; K offsets relative to ``p_w`` / ``p_a``), in the order the
    module docstring gives for ``MMA_BF16`` off / on.

    W: uint8 e4m3 codes (row stride ``stride_wn``), sw: uint8 e8m0 (row stride ``stride_swn``, column kb);
    A by ``A_MODE``: codes with sa as sw (A_CODES), floats quantised here (A_QUANT; ``p_sa`` unused) or floats
    taken as they are (A_FLOAT, sa = 1; ``A_SPLIT`` for fp32). Rows outside ``m_n`` / ``m_m`` read as zero.
    Returns the new accumulator.
    """
    if MMA_BF16 and not INTERPRET:  # interpreted, both forms run the exact per-block loop below
        NB: tl.constexpr = BLOCK_K // 32
        BN: tl.constexpr = acc.shape[0]
        BM: tl.constexpr = acc.shape[1]
        o_k = tl.arange(0, BLOCK_K)
        o_b = tl.arange(0, NB)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            m_k = (k0 + o_k) < k_hi
            m_b = (k0 + o_b * 32) < k_hi
            b_w = tl.load(p_w + o_n[:, None] * stride_wn + (k0 + o_k)[None, :], mask=m_n[:, None] & m_k[None, :],
                          other=0)
            b_sw = tl.load(p_sw + (o_n // BN_SCALE)[:, None] * stride_swn + (k0 // 32 + o_b)[None, :],
                           mask=m_n[:, None] & m_b[None, :], other=127)
            # scale folded into the weight: e4m3 x 2^k is exact in fp32 and in bf16
            b_wv = tl.reshape(tl.reshape(_e4m3_values(b_w, INTERPRET), (BN, NB, 32))
                              * _e8m0_to_f32(b_sw.to(tl.int32))[:, :, None], (BN, BLOCK_K))
            b_a = tl.load(p_a + o_m[:, None] * stride_am + (k0 + o_k)[None, :], mask=m_m[:, None] & m_k[None, :],
                          other=0)
            if A_MODE == 0:  # A_CODES
                b_sa = tl.load(p_sa + o_m[:, None] * stride_sam + (k0 // 32 + o_b)[None, :],
                               mask=m_m[:, None] & m_b[None, :], other=127)
                b_av = tl.reshape(tl.reshape(_e4m3_values(b_a, INTERPRET), (BM, NB, 32))
                                  * _e8m0_to_f32(b_sa.to(tl.int32))[:, :, None], (BM, BLOCK_K))
            elif A_MODE == 1:  # A_QUANT
                q, b_exp = _quant_rows(tl.reshape(b_a.to(tl.float32), (BM, NB, 32)), 2, HW_CVT, INTERPRET)
                b_av = tl.reshape(q.to(tl.float32) * _e8m0_to_f32(b_exp)[:, :, None], (BM, BLOCK_K))
            else:
                b_av = b_a.to(tl.float32)
            b_wh = b_wv.to(tl.bfloat16)
            b_ah = b_av.to(tl.bfloat16)
            if A_SPLIT:  # fp32 rows not quantised: the low part first, then the high part
                acc = tl.dot(b_wh, tl.trans((b_av - b_ah.to(tl.float32)).to(tl.bfloat16)), acc)
            acc = tl.dot(b_wh, tl.trans(b_ah), acc)
        return acc
    o_k = tl.arange(0, 32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        for j in tl.static_range(BLOCK_K // 32):
            k = k0 + j * 32
            ok = k < k_hi
            b_w = tl.load(p_w + o_n[:, None] * stride_wn + (k + o_k)[None, :], mask=m_n[:, None] & ok, other=0)
            b_sw = _e8m0_to_f32(
                tl.load(p_sw + (o_n // BN_SCALE) * stride_swn + k // 32, mask=m_n & ok, other=127).to(tl.int32)
            )
            b_a = tl.load(p_a + o_m[:, None] * stride_am + (k + o_k)[None, :], mask=m_m[:, None] & ok, other=0)
            if A_MODE == 2:  # A_FLOAT
                if INTERPRET:
                    p = _exact_dot(_e4m3_to_f32(b_w.to(tl.int32)), b_a.to(tl.float32))
                else:
                    # e4m3 -> fp16 -> bf16 is exact (the e4m3 -> fp16 cvt exists from sm89); the activation is
                    # rounded to bf16 (fp32: a high part + a low part, two MMAs)
                    b_wh = b_w.to(tl.float8e4nv, bitcast=True).to(tl.float16).to(tl.bfloat16)
                    b_ah = b_a.to(tl.bfloat16)
                    p = tl.dot(b_wh, tl.trans(b_ah))
                    if A_SPLIT:
                        b_al = (b_a.to(tl.float32) - b_ah.to(tl.float32)).to(tl.bfloat16)
                        p = tl.dot(b_wh, tl.trans(b_al), p)
                acc += p * b_sw[:, None]
            else:
                if A_MODE == 0:  # A_CODES
                    b_exp = tl.load(p_sa + o_m * stride_sam + k // 32, mask=m_m & ok, other=127).to(tl.int32)
                    if INTERPRET:
                        b_q = _e4m3_to_f32(b_a.to(tl.int32))
                    else:
                        b_q = b_a.to(tl.float8e4nv, bitcast=True)
                else:  # A_QUANT: the activation's 1 x 32 blocks quantised in registers
                    b_q, b_exp = _quant_rows(b_a.to(tl.float32), 1, HW_CVT, INTERPRET)
                if INTERPRET:
                    p = _exact_dot(_e4m3_to_f32(b_w.to(tl.int32)), b_q)
                else:
                    p = tl.dot(b_w.to(tl.float8e4nv, bitcast=True), tl.trans(b_q))
                acc += p * (b_sw[:, None] * _e8m0_to_f32(b_exp)[None, :])
    return acc


@triton.jit
def _store_tile(p_out, acc, i_s, stride_s, stride_m, o_m, m_m, o_n, m_n, OUT_BF16: tl.constexpr):
    """Store the fp32 tile ``acc [BLOCK_N, BLOCK_M]`` (n-major) at rows ``o_m``, columns ``o_n`` of split ``i_s``
    of a row-major output (dense in n), masked by ``m_m`` / ``m_n``; rounded to bf16 (RNE) when ``OUT_BF16``."""
    out = tl.trans(acc)
    p_o = p_out + i_s * stride_s + o_m[:, None] * stride_m + o_n[None, :]
    m_o = m_m[:, None] & m_n[None, :]
    if OUT_BF16:
        tl.store(p_o, _f32_to_bf16_rne(out), mask=m_o)
    else:
        tl.store(p_o, out, mask=m_o)


@triton.jit
def _reduce_tile_if_last(p_ws, p_out, p_cnt, i_t, stride_s, stride_m, o_m, m_m, o_n, m_n,
                         SPLITS: tl.constexpr, OUT_BF16: tl.constexpr):
    """After this program stored its partial: take a ticket from counter ``i_t``; the program with the last ticket
    sums the SPLITS partials of the tile in ascending split order, stores it and zeroes the counter."""
    tl.debug_barrier()  # every thread's partial stores precede the ticket (released by the acq_rel atomic)
    ticket = tl.atomic_add(p_cnt + i_t, 1)
    if ticket == SPLITS - 1:
        p_t = o_m[:, None] * stride_m + o_n[None, :]
        m_t = m_m[:, None] & m_n[None, :]
        # .cg: read through L2 (the other programs' partials; L1 is not coherent)
        acc = tl.load(p_ws + p_t, mask=m_t, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLITS):
            acc += tl.load(p_ws + s * stride_s + p_t, mask=m_t, other=0.0, cache_modifier=".cg")
        if OUT_BF16:
            tl.store(p_out + p_t, _f32_to_bf16_rne(acc), mask=m_t)
        else:
            tl.store(p_out + p_t, acc, mask=m_t)
        tl.atomic_xchg(p_cnt + i_t, 0)


# Integer arguments that follow the batch, left unspecialised (engine/warmup.py says why)
BATCH_COUNTS = ("M",)
REDUCE_COUNTS = ("MN",)  # _split_reduce_kernel


@triton.jit(do_not_specialize=BATCH_COUNTS)
def _fp8_gemm_kernel(
    p_a, p_sa, p_w, p_sw, p_out, p_ws, p_cnt, M, N, KW, NG, k_split,
    stride_am, stride_sam, stride_wn, stride_swn, stride_os, stride_om,
    BN_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A_MODE: tl.constexpr, A_SPLIT: tl.constexpr, MMA_BF16: tl.constexpr, HW_CVT: tl.constexpr,
    OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr, SPLITS: tl.constexpr, INLINE: tl.constexpr,
    FIXUP: tl.constexpr,
):
    # Traffic per program: BLOCK_N * (k_hi - k_lo) weight bytes + BLOCK_M rows of A (4 bytes per element for
    # A_QUANT fp32, from L2 after the first N tile); write BLOCK_M x BLOCK_N (+ a partial per split, read once).
    i_n, i_m, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_n, m_m = o_n < N, o_m < M
    o_n, o_m = o_n.to(tl.int64), o_m.to(tl.int64)
    g = (i_n * BLOCK_N) // NG  # BLOCK_N divides NG: a tile never straddles two groups
    p_ag, p_sag = p_a + g * KW, p_sa + g * (KW // 32)
    acc = fp8_scaled_mma(
        tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), p_w, p_sw, p_ag, p_sag, o_n, m_n, o_m, m_m,
        i_s * k_split, tl.minimum(i_s * k_split + k_split, KW), stride_wn, stride_swn, stride_am, stride_sam,
        BN_SCALE, BLOCK_K, A_MODE, A_SPLIT, MMA_BF16, HW_CVT, INTERPRET,
    )
    if INLINE:  # the other splits one after the other, added in ascending order: the bits of the split launch
        for s in range(1, SPLITS):
            k_lo = s * k_split
            acc += fp8_scaled_mma(
                tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), p_w, p_sw, p_ag, p_sag, o_n, m_n, o_m, m_m, k_lo,
                tl.minimum(k_lo + k_split, KW), stride_wn, stride_swn, stride_am, stride_sam, BN_SCALE, BLOCK_K,
                A_MODE, A_SPLIT, MMA_BF16, HW_CVT, INTERPRET,
            )
        _store_tile(p_out, acc, 0, 0, stride_om, o_m, m_m, o_n, m_n, OUT_BF16)
    else:
        _store_tile(p_ws, acc, i_s, stride_os, stride_om, o_m, m_m, o_n, m_n, False)
        if FIXUP:  # else ``_split_reduce_kernel`` runs after this launch (the earlier form, kept for comparison)
            _reduce_tile_if_last(p_ws, p_out, p_cnt, i_m * tl.num_programs(0) + i_n, stride_os, stride_om, o_m,
                                 m_m, o_n, m_n, SPLITS, OUT_BF16)


@triton.jit(do_not_specialize=REDUCE_COUNTS)
def _split_reduce_kernel(p_ws, p_out, MN, S: tl.constexpr, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr):
    # Sums the S fp32 partials in split order (deterministic); read S * 4 bytes, write 2 or 4 per element.
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < MN
    acc = tl.load(p_ws + o, mask=m, other=0.0)
    for s in tl.static_range(1, S):
        acc += tl.load(p_ws + s * MN + o, mask=m, other=0.0)
    if OUT_BF16:
        tl.store(p_out + o, _f32_to_bf16_rne(acc), mask=m)
    else:
        tl.store(p_out + o, acc, mask=m)


def split_counters(n_tiles: int, device: torch.device) -> torch.Tensor:
    """Zeroed tile counters for ``fp8_gemm_triton`` (int32; the kernel leaves them zero after each launch)."""
    return torch.zeros(max(n_tiles, 1), dtype=torch.int32, device=device)


def fp8_gemm_triton(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block_n: int,
    groups: int,
    out: torch.Tensor,
    config: Fp8GemmConfig | None = None,
    *,
    quantize_a: bool = False,
    counters: torch.Tensor | None = None,
    reduce_launch: bool = False,
) -> torch.Tensor:
    """Launch on validated, contiguous inputs; writes ``out [M, N]`` and returns it.

    ``a``: uint8 codes with ``a_scale`` (A_CODES), or floats: quantised in the kernel when ``quantize_a``
    (A_QUANT, ``a_scale`` None), else taken as they are (A_FLOAT). ``counters``: int32 zeros, at least one per
    output tile of a split launch (``split_counters``), left zeroed; None allocates them (one memset) when needed.
    ``reduce_launch``: sum a split launch's partials with ``_split_reduce_kernel`` (a second launch; same bits)
    instead of the in-kernel fix-up, for benchmarks/fp8_gemm_bench.py's comparison.
    """
    m, _ = a.shape
    n, kw = w.shape
    ng = n // groups
    cfg = config or default_config(m, n, kw, a.device)
    bn = cfg.block_n
    while ng % bn:  # grouped: a tile must stay inside one group (validation guarantees ng % 16 == 0)
        bn //= 2
    k_split = triton.cdiv(triton.cdiv(kw, 32), cfg.split_k) * 32
    splits = triton.cdiv(kw, k_split)
    a_mode = A_QUANT if quantize_a else A_CODES if a_scale is not None else A_FLOAT
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    inline = splits == 1 or m > _INLINE_ABOVE
    grid = (triton.cdiv(n, bn), triton.cdiv(m, cfg.block_m), 1 if inline else splits)
    if inline:
        ws, cnt = out, out
    else:
        ws = torch.empty((splits, m, n), dtype=torch.float32, device=a.device)
        tiles = grid[0] * grid[1]
        cnt = ws if reduce_launch else (
            counters if counters is not None and counters.numel() >= tiles else split_counters(tiles, a.device))
    _fp8_gemm_kernel[grid](
        a, a_scale if a_mode == A_CODES else a, w, w_scale, out, ws, cnt, m, n, kw, ng, k_split,
        a.stride(0), a_scale.stride(0) if a_mode == A_CODES else 0, w.stride(0), w_scale.stride(0), m * n, n,
        BN_SCALE=block_n, BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=cfg.block_k,
        A_MODE=a_mode, A_SPLIT=a_mode == A_FLOAT and a.dtype == torch.float32, MMA_BF16=cfg.mma == "bf16",
        HW_CVT=cfg.quant == "cvt", OUT_BF16=out.dtype == torch.bfloat16, INTERPRET=interpret, SPLITS=splits,
        INLINE=inline, FIXUP=not reduce_launch, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not inline and reduce_launch:
        _split_reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](
            ws, out, m * n, S=splits, BLOCK=_REDUCE_BLOCK, OUT_BF16=out.dtype == torch.bfloat16
        )
    return out
