"""Triton grouped expert GEMM: one launch per projection for the whole batch, weights read as stored.

One kernel serves both projections (``GATED``: w1 + w3; else w2). Its M tiles are the routed experts'
blocks from ``moe_align`` (BM pairs of one expert, MXFP4 weights), followed by the shared expert's tiles
(BM tokens, FP8 e4m3 weights with 32 x 32 ue8m0 blocks), so the shared expert runs inside the same
launch instead of as a small one after it (at batch 1 it alone would fill a quarter of an H200):

    GATED:      a = A W1^T, b = A W3^T over K = D; act = fp8_qdq(r * (silu(min(a, L)) * clamp(b, -L, L)))
                (r = the pair's routing weight, 1 for the shared expert), stored as bf16 (exact) in tile order
    not GATED:  out = act W2^T over K = I, fp32, written to the pair's own row of [N * k (+ N), D]
                (the shared expert's rows follow the pairs'), so no atomics are needed

Grid (M tiles, N tiles); a routed tile whose block expert is -1 (unused) returns at once.

Numerics. Each K step loads BK weight elements per row (BK / 2 bytes of MXFP4, BK of FP8) and splits
them into the even and odd elements (the low and high nibbles: no interleave), and the matching even and odd
activation columns. Both are decoded in registers to bf16 *with their scale folded in*: e2m1 * 2^s and
e4m3 * 2^s have at most 4 significant bits, so they are exact in bf16 (as are the fp8-quantised
activations), and every product in the bf16 tensor-core dot is exact, accumulated in fp32. The result
differs from the fp32 reference only by summation order. The fp8 x fp8 alternative (e2m1 -> e4m3 is
lossless) would halve MMA time, but decode at batch <= 64 is bound by weight bytes, not MMA rate, and
Hopper's fp8 MMA accumulates with ~14 bits (DeepSeek-V3 report §3.3.2), which would flip the FP8
rounding of the activation before w2 far more often. Under TRITON_INTERPRET=1 operands stay fp32
(the interpreter has no bf16 dot).

The tile shape is a constant of the kernel, never chosen from the batch: a pair's row is computed by the
same instructions in a batch of 1 or 64, so the result is batch invariant bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashtier.kernels._e2m1 import _e2m1_to_f32
from flashtier.kernels._fp8_bits import (
    _e4m3_code,
    _e4m3_to_f32,
    _e8m0_reciprocal,
    _e8m0_scale_exponent,
    _e8m0_to_f32,
)


@dataclass(frozen=True)
class MoEGemmConfig:
    """Launch shape of the grouped GEMM. Fixed per deployment, never chosen from the batch: the M tile is
    also ``moe_align``'s block size, and a pair's bits depend only on this shape, not on its neighbours."""

    block_m: int = 16  # pairs per tile: decode batches put a few pairs on each expert
    block_n: int = 32  # output columns per program (a multiple of 32: whole FP8 blocks of the activation)
    block_k: int = 64  # K elements per step: one 32-byte sector of each MXFP4 weight row
    # Chosen by benchmarks/moe_bench.py --sweep on the H200 (flash-16e layer, CUDA-graph us at 1 / 8 / 64 tokens,
    # docs/perf/moe.json "sweep"): n32 w4 s4 880 / 1389 / 3301 against 1272 / 1716 / 3410 for the earlier
    # n64 w8 s4, the fastest at 1 and 8 tokens and within 4% of the best at 64. More programs of fewer warps
    # hide more of the per-step load latency at decode sizes; the kernel stays ~25x its byte floor at 1 token.
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        pow2 = lambda v: isinstance(v, int) and v > 0 and not v & (v - 1)  # noqa: E731
        if not (pow2(self.block_m) and self.block_m >= 16 and pow2(self.block_n) and self.block_n >= 32
                and pow2(self.block_k) and self.block_k >= 64):
            raise ValueError(f"MoEGemmConfig: block_m >= 16, block_n >= 32, block_k >= 64, powers of two; got {self}")


DEFAULT_CONFIG = MoEGemmConfig()


@triton.jit
def _weight_tile(p_wq, p_ws, base_q, base_s, o_n, m_n, k0, K, FP8_W: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
    """Weight rows ``o_n`` at K columns [k0, k0 + BK): (even, odd) elements, each [BN, BK / 2] in DT, exact."""
    HALF: tl.constexpr = BK // 2
    o_j = tl.arange(0, HALF)
    o_ke = k0 + 2 * o_j
    m = m_n[:, None] & (o_ke < K)[None, :]
    if FP8_W:  # codes [rows, K], one scale per 32 x 32 block [rows / 32, K / 32]
        p = p_wq + o_n.to(tl.int64)[:, None] * K + o_ke[None, :]
        b_ce = tl.load(p, mask=m, other=0).to(tl.int32)
        b_co = tl.load(p + 1, mask=m, other=0).to(tl.int32)
        o_s = (o_n // 32).to(tl.int64)[:, None] * (K // 32) + (o_ke // 32)[None, :]
        b_s = _e8m0_to_f32(tl.load(p_ws + o_s, mask=m, other=127).to(tl.int32))
        b_even = _e4m3_to_f32(b_ce) * b_s
        b_odd = _e4m3_to_f32(b_co) * b_s
    else:  # MXFP4: codes [rows, K / 2], element 2j in the low nibble of byte j; scales [rows, K / 32]
        o_r = o_n.to(tl.int64)[:, None]
        b_byte = tl.load(p_wq + base_q + o_r * (K // 2) + (k0 // 2 + o_j)[None, :], mask=m, other=0).to(tl.int32)
        # one scale byte per 16 code bytes: load [BN, BK / 32] and repeat each 16 times in registers
        NS: tl.constexpr = BK // 32
        o_sb = k0 // 32 + tl.arange(0, NS)
        b_sb = tl.load(p_ws + base_s + o_r * (K // 32) + o_sb[None, :], mask=m_n[:, None] & (o_sb < K // 32)[None, :],
                       other=127).to(tl.int32)
        b_s = _e8m0_to_f32(b_sb)
        b_s = tl.reshape(tl.broadcast_to(b_s[:, :, None], (b_s.shape[0], NS, 16)), (b_s.shape[0], HALF))
        b_even = _e2m1_to_f32(b_byte & 15) * b_s
        b_odd = _e2m1_to_f32(b_byte >> 4) * b_s
    return b_even.to(DT), b_odd.to(DT)


@triton.jit
def _fp8_qdq_cols(v, BM: tl.constexpr, BN: tl.constexpr):
    """``fp8_qdq`` of fp32 ``v [BM, BN]`` per 32 consecutive columns: the same bit operations as quant_fp8."""
    b = tl.reshape(v, (BM, BN // 32, 32))
    b_amax = tl.maximum(tl.max(tl.abs(b), axis=2), 1e-4)
    b_exp = _e8m0_scale_exponent(b_amax, 448.0)
    b_q = tl.minimum(tl.maximum(b * _e8m0_reciprocal(b_exp)[:, :, None], -448.0), 448.0)
    return tl.reshape(_e4m3_to_f32(_e4m3_code(b_q)) * _e8m0_to_f32(b_exp)[:, :, None], (BM, BN))


@triton.jit
def _gemm_tile(
    p_arow, m_r, p_wq, p_ws, base_q, base_s, o_n, m_n, w3_rows, K,
    GATED: tl.constexpr, FP8_W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DT: tl.constexpr,
):
    """``A W^T`` for BM activation rows (``p_arow`` [BM, 1] row pointers) and weight rows ``o_n``; when GATED
    also for the w3 rows ``w3_rows`` below them: ``(acc, acc3)`` fp32 [BM, BN]."""
    o_j = tl.arange(0, BK // 2)
    b_acc = tl.zeros((BM, BN), dtype=tl.float32)
    b_acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_ke = k0 + 2 * o_j
        m_a = m_r[:, None] & (o_ke < K)[None, :]
        b_ae = tl.load(p_arow + o_ke[None, :], mask=m_a, other=0.0).to(DT)
        b_ao = tl.load(p_arow + o_ke[None, :] + 1, mask=m_a, other=0.0).to(DT)
        b_we, b_wo = _weight_tile(p_wq, p_ws, base_q, base_s, o_n, m_n, k0, K, FP8_W, BK, DT)
        b_acc = tl.dot(b_ae, tl.trans(b_we), b_acc)
        b_acc = tl.dot(b_ao, tl.trans(b_wo), b_acc)
        if GATED:
            b_we, b_wo = _weight_tile(p_wq, p_ws, base_q, base_s, o_n + w3_rows, m_n, k0, K, FP8_W, BK, DT)
            b_acc3 = tl.dot(b_ae, tl.trans(b_we), b_acc3)
            b_acc3 = tl.dot(b_ao, tl.trans(b_wo), b_acc3)
    return b_acc, b_acc3


@triton.jit
def _moe_gemm_kernel(
    p_a, p_ids, p_block_expert, p_rw, p_wq, p_ws, p_sq, p_ss, p_out,
    n_pairs, n_tok, top_k, n_rblocks, K_R, K_S, N_R, N_S, stride_a, stride_out, limit,
    GATED: tl.constexpr, UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    # Traffic per program: BN (x2 when GATED) weight rows of K elements, BM activation rows of K.
    # M tiles [0, n_rblocks): BM pairs of one routed expert (moe_align's blocks), MXFP4 weights.
    # M tiles [n_rblocks, ...): BM tokens of the shared expert, FP8 weights.
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    DT: tl.constexpr = tl.float32 if UPCAST else tl.bfloat16
    o_pos = i_m * BM + tl.arange(0, BM)  # this tile's rows of the activation buffer (both kinds)
    o_n = i_n * BN + tl.arange(0, BN)
    e = tl.load(p_block_expert + tl.minimum(i_m, n_rblocks - 1))  # n_rblocks >= 1 whenever anything runs
    if (i_m < n_rblocks) & (e < 0):  # a block no expert uses
        return
    if i_m < n_rblocks:
        o_ids = tl.load(p_ids + o_pos)
        m_r = o_ids < n_pairs  # the sentinel n_pairs pads an expert's last block
        m_n = o_n < N_R
        if GATED:  # x rows by token; act stored in sorted order; w1 and w3 are 2 * N_R rows per expert
            o_a = o_ids // top_k
            o_out = o_pos
            n_w = 2 * N_R
            b_rw = tl.load(p_rw + o_ids, mask=m_r, other=0.0)
        else:  # act in sorted order; the output goes to the pair's own row
            o_a = o_pos
            o_out = o_ids
            n_w = N_R
            b_rw = tl.zeros((BM,), dtype=tl.float32)
        e64 = e.to(tl.int64)
        b_acc, b_acc3 = _gemm_tile(
            p_a + o_a.to(tl.int64)[:, None] * stride_a, m_r, p_wq, p_ws, e64 * n_w * (K_R // 2),
            e64 * n_w * (K_R // 32), o_n, m_n, N_R, K_R, GATED, False, BM, BN, BK, DT,
        )
    else:
        o_t = (i_m - n_rblocks) * BM + tl.arange(0, BM)
        m_r = o_t < n_tok
        m_n = o_n < N_S
        if GATED:
            o_a = o_t
            o_out = o_pos
        else:  # shared rows follow the pairs' rows in the output
            o_a = o_pos
            o_out = n_pairs + o_t
        b_rw = tl.full((BM,), 1.0, tl.float32)
        b_acc, b_acc3 = _gemm_tile(
            p_a + o_a.to(tl.int64)[:, None] * stride_a, m_r, p_sq, p_ss, 0, 0, o_n, m_n, N_S, K_S,
            GATED, True, BM, BN, BK, DT,
        )
    m_out = m_r[:, None] & m_n[None, :]
    p_orow = p_out + o_out.to(tl.int64)[:, None] * stride_out + o_n[None, :]
    if GATED:
        b_g = tl.minimum(b_acc, limit)
        b_u = tl.minimum(tl.maximum(b_acc3, -limit), limit)
        b_h = b_rw[:, None] * (b_g * tl.sigmoid(b_g) * b_u)  # official order: silu(gate) * up, then the weight
        tl.store(p_orow, _fp8_qdq_cols(b_h, BM, BN).to(tl.bfloat16), mask=m_out)
    else:
        tl.store(p_orow, b_acc, mask=m_out)


def _upcast() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_moe_gemm(
    a: torch.Tensor, out: torch.Tensor, routed: tuple[torch.Tensor, torch.Tensor],
    shared: tuple[torch.Tensor, torch.Tensor] | None, *, gated: bool, ids: torch.Tensor,
    block_expert: torch.Tensor, n_tok: int, top_k: int, k_r: int, k_s: int, n_r: int, n_s: int,
    route_w: torch.Tensor | None = None, limit: float = 0.0, config: MoEGemmConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Run one projection, routed experts and shared expert together, into ``out`` (mutated); return it.

    ``a``: gated, the quantised tokens ``[n_tok, D]`` fp32; else the activation buffer the gated launch wrote.
    ``routed`` / ``shared``: (codes, scales) of the projection (MXFP4 stack / FP8 matrix, or None).
    ``ids`` / ``block_expert``: ``moe_align`` with ``config.block_m``. ``k_*`` / ``n_*``: reduction length and
    output width of the routed (r) and shared (s) weights. ``out``: gated, bf16 ``[M tiles * block_m, >= max(n_r,
    n_s)]``; else fp32 ``[n_pairs (+ n_tok with shared), n_r]``.
    """
    bm = config.block_m
    n_rblocks = block_expert.numel()
    n_m = n_rblocks + (triton.cdiv(n_tok, bm) if shared is not None else 0)
    if n_m == 0:
        return out
    sq, ss = shared if shared is not None else routed  # never read without shared tiles
    _moe_gemm_kernel[(n_m, triton.cdiv(max(n_r, n_s), config.block_n))](
        a, ids, block_expert, out if route_w is None else route_w, routed[0], routed[1], sq, ss, out,
        top_k * n_tok, n_tok, top_k, n_rblocks, k_r, k_s, n_r, n_s, a.stride(0), out.stride(0),
        float(limit), GATED=gated, UPCAST=_upcast(), BM=bm, BN=config.block_n, BK=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
