"""FP8 block-scaled GEMM in Triton: e4m3 weights with e8m0 scales per (bn x 32) block, read as stored.

Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), split_k)``. A program owns BLOCK_N weight rows and BLOCK_M
activation rows and walks its K range in steps of BLOCK_K; each step issues BLOCK_K / 32 MMAs of K = 32
(one per scale block) and folds each into the fp32 accumulator with its scales:

    acc[n, m] += (W[n, kb] . A[m, kb]) * sw[n // bn, kb] * sa[m, kb]

The MMA is "swapped" (weight rows are the MMA's M, activation rows its N) so decode batches of 1-64 rows
still fill a 64-row wgmma; the tile is transposed back before the store. Decode (M <= 64) is one M tile,
so every weight byte is read once; split-K (fp32 partials [S, M, N] + an ordered reduce) gives a small-N
weight enough programs to keep HBM busy. Prefill tiles are 128 x 128 on the fp8 tensor cores.

Activations: e4m3 codes + e8m0 scales per 32 (``act_quant``), or floats (``A_FP8`` off: the wo_a form,
not quantised; fp32 rows are split into bf16 high + low parts, two MMAs, ~16 significant bits).

Precision: each K = 32 block product is an MMA with fp32 output; on Hopper the fp8 MMA adds its 32 exact
products with an accumulator of ~14 significant bits (DeepSeek-V3 report), so an fp32 output matches the
fp32 reference to ~2^-13 of sum |a*w|, not to fp32 rounding. Under TRITON_INTERPRET=1 the MMAs run in fp32
on decoded values (bf16 / fp8 cannot reach numpy's dot), which matches the reference to fp32 rounding.

``fp8_scaled_mma`` is the reusable inner loop (row index vectors in, accumulator out): a grouped MoE
kernel can pass gathered token rows as ``o_m`` and expert weight rows as ``o_n``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashtier.kernels.quant.fp8_bits import _e4m3_to_f32, _e8m0_to_f32, _f32_to_bf16_rne

_REDUCE_BLOCK = 1024
_INLINE_ABOVE = 64  # rows: above, each program runs the K splits itself (no fp32 partials in HBM)


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch shape. ``block_n`` / ``block_m`` >= 16 (MMA minimum), ``block_k`` a multiple of 32."""

    block_m: int = 16  # activation rows per program (the swapped MMA's N)
    block_n: int = 64  # weight rows per program (the swapped MMA's M)
    block_k: int = 128  # K per loop step: block_k // 32 scaled MMAs
    split_k: int = 1  # K ranges run by separate programs, summed in order by a second kernel; 1 = none
    num_warps: int = 4
    num_stages: int = 4


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def default_config(m: int, n: int, kw: int, device: torch.device) -> Fp8GemmConfig:
    """Split-K from (N, K) only, never from M (part of a row's reduction order: batch invariance): split
    until ~2 programs per SM of 64 weight rows. Decode (m <= 64): one M tile, 64 weight rows per program, the
    splits as separate programs. Prefill: 128 x 128 tiles, each program runs the same splits one after the
    other (same sums, same order, no workspace). Chosen from the shape only (no autotuning at run time)."""
    tiles = triton.cdiv(n, 64)
    split = 1
    # each split keeps >= 512 of K (4 loop steps) so the pipeline fills; partials cost 4 * M * N bytes each
    while tiles * split < 2 * _sm_count(device) and kw // (2 * split) >= 512:
        split *= 2
    if m > 64:
        return Fp8GemmConfig(block_m=128, block_n=128, block_k=128, split_k=split, num_warps=8, num_stages=3)
    block_m = max(16, triton.next_power_of_2(m))
    return Fp8GemmConfig(block_m=block_m, block_n=64, block_k=128, split_k=split, num_warps=4, num_stages=4)


@triton.jit
def fp8_scaled_mma(
    acc, p_w, p_sw, p_a, p_sa, o_n, m_n, o_m, m_m, k_lo, k_hi,
    stride_wn, stride_swn, stride_am, stride_sam,
    BN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr, A_FP8: tl.constexpr, A_SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """``acc [BN, BM] += sum_kb (W[o_n, kb] . A[o_m, kb]) * sw[o_n // BN_SCALE, kb] * sa[o_m, kb]`` over the
    32-blocks kb of [k_lo, k_hi) (multiples of 32; K offsets relative to ``p_w`` / ``p_a``).

    W: uint8 e4m3 codes (row stride ``stride_wn``), sw: uint8 e8m0 (row stride ``stride_swn``, column kb);
    A: uint8 e4m3 codes with sa as sw (``A_FP8``), or fp32/bf16 values and no sa (``A_SPLIT`` for fp32).
    Rows outside ``m_n`` / ``m_m`` read as zero. Returns the new accumulator.
    """
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
            if A_FP8:
                b_sa = _e8m0_to_f32(tl.load(p_sa + o_m * stride_sam + k // 32, mask=m_m & ok, other=127).to(tl.int32))
                if INTERPRET:
                    p = tl.dot(_e4m3_to_f32(b_w.to(tl.int32)), tl.trans(_e4m3_to_f32(b_a.to(tl.int32))))
                else:
                    p = tl.dot(b_w.to(tl.float8e4nv, bitcast=True), tl.trans(b_a.to(tl.float8e4nv, bitcast=True)))
                acc += p * (b_sw[:, None] * b_sa[None, :])
            else:
                if INTERPRET:
                    p = tl.dot(_e4m3_to_f32(b_w.to(tl.int32)), tl.trans(b_a.to(tl.float32)))
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
def _fp8_gemm_kernel(
    p_a, p_sa, p_w, p_sw, p_out, M, N, KW, NG, k_split,
    stride_am, stride_sam, stride_wn, stride_swn, stride_os, stride_om,
    BN_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A_FP8: tl.constexpr, A_SPLIT: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
    SPLITS: tl.constexpr, INLINE: tl.constexpr,
):
    # Traffic per program: BLOCK_N * (k_hi - k_lo) weight bytes + BLOCK_M rows of A; write BLOCK_M x BLOCK_N.
    i_n, i_m, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_n, m_m = o_n < N, o_m < M
    o_n, o_m = o_n.to(tl.int64), o_m.to(tl.int64)
    g = (i_n * BLOCK_N) // NG  # BLOCK_N divides NG: a tile never straddles two groups
    p_ag, p_sag = p_a + g * KW, p_sa + g * (KW // 32)
    if INLINE:  # the splits one after the other, added in ascending order: the bits of the split launch
        acc = fp8_scaled_mma(
            tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), p_w, p_sw, p_ag, p_sag, o_n, m_n, o_m, m_m, 0,
            tl.minimum(k_split, KW), stride_wn, stride_swn, stride_am, stride_sam, BN_SCALE, BLOCK_K, A_FP8,
            A_SPLIT, INTERPRET,
        )
        for s in range(1, SPLITS):
            k_lo = s * k_split
            acc += fp8_scaled_mma(
                tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), p_w, p_sw, p_ag, p_sag, o_n, m_n, o_m, m_m, k_lo,
                tl.minimum(k_lo + k_split, KW), stride_wn, stride_swn, stride_am, stride_sam, BN_SCALE, BLOCK_K,
                A_FP8, A_SPLIT, INTERPRET,
            )
        i_s = 0
    else:
        k_lo = i_s * k_split
        acc = fp8_scaled_mma(
            tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), p_w, p_sw, p_ag, p_sag, o_n, m_n, o_m, m_m, k_lo,
            tl.minimum(k_lo + k_split, KW), stride_wn, stride_swn, stride_am, stride_sam, BN_SCALE, BLOCK_K, A_FP8,
            A_SPLIT, INTERPRET,
        )
    _store_tile(p_out, acc, i_s, stride_os, stride_om, o_m, m_m, o_n, m_n, OUT_BF16)


@triton.jit
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


def fp8_gemm_triton(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block_n: int,
    groups: int,
    out: torch.Tensor,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """Launch on validated, contiguous inputs (uint8 codes / scales, or float ``a``); writes ``out [M, N]``."""
    m, _ = a.shape
    n, kw = w.shape
    ng = n // groups
    cfg = config or default_config(m, n, kw, a.device)
    bn = cfg.block_n
    while ng % bn:  # grouped: a tile must stay inside one group (validation guarantees ng % 16 == 0)
        bn //= 2
    k_split = triton.cdiv(triton.cdiv(kw, 32), cfg.split_k) * 32
    splits = triton.cdiv(kw, k_split)
    a_fp8 = a_scale is not None
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    out_bf16 = out.dtype == torch.bfloat16
    inline = splits == 1 or m > _INLINE_ABOVE
    target = out if inline else torch.empty((splits, m, n), dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, cfg.block_m), 1 if inline else splits)
    _fp8_gemm_kernel[grid](
        a, a_scale if a_fp8 else a, w, w_scale, target, m, n, kw, ng, k_split,
        a.stride(0), a_scale.stride(0) if a_fp8 else 0, w.stride(0), w_scale.stride(0), m * n, n,
        BN_SCALE=block_n, BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=cfg.block_k,
        A_FP8=a_fp8, A_SPLIT=(not a_fp8) and a.dtype == torch.float32, OUT_BF16=out_bf16 and inline,
        INTERPRET=interpret, SPLITS=splits, INLINE=inline, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not inline:
        mn = m * n
        _split_reduce_kernel[(triton.cdiv(mn, _REDUCE_BLOCK),)](
            target, out, mn, S=splits, BLOCK=_REDUCE_BLOCK, OUT_BF16=out_bf16
        )
    return out
