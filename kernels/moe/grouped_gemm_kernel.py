"""Triton grouped expert GEMM: one launch per projection for the whole batch, weights read as stored.

One kernel serves both projections (``GATED``: w1 + w3; else w2). Its M tiles are the routed experts'
blocks from ``moe_align`` (BM pairs of one expert, MXFP4 weights), followed by the shared expert's tiles
(BM tokens, FP8 e4m3 weights with 32 x 32 ue8m0 blocks), so the shared expert runs inside the same
launch instead of as a small one after it (at batch 1 it alone would fill a quarter of an H200). The rows
each tile reads and writes: ``moe/tile_kernel.py``.

    GATED:      a = A W1^T, b = A W3^T over K = D; act = fp8_qdq(r * (silu(min(a, L)) * clamp(b, -L, L)))
                (r = the pair's routing weight, 1 for the shared expert), stored as bf16 (exact) in tile order
    not GATED:  out = act W2^T over K = I, fp32, written to the pair's own row of [N * k (+ N), D]
                (the shared expert's rows follow the pairs'), so no atomics are needed

Grid (M tiles, N tiles, K splits); a routed tile whose block expert is -1 (unused) returns at once.

Split-K (``MoEGemmConfig.split_k`` S > 1). At decode sizes the grid has few M tiles, and each program
walking all of K is a long serial chain of small loads. With S splits, split s covers K steps
[s * c, (s + 1) * c) with c = ceil(ceil(K / BK) / S) (whole BK steps, so whole 32-element scale blocks;
trailing splits may be empty and write zeros), accumulates its range from zero and stores an fp32
partial to a workspace ``[S, 1 or 2 (GATED: a and b), tile rows, N]``; ``moe/splitk_reduce_kernel.py``
then sums the partials in ascending split order (no atomics) and applies the epilogue above. S = 1 is
the single pass: no workspace, the epilogue in this kernel. The workspace covers at most
``WORKSPACE_BYTES``: a larger batch runs in windows of M tiles, each a GEMM launch and a reduce launch
(a tile's instructions do not depend on its window, so neither do its bits).

Numerics. Each K step loads BK contiguous activations and the matching weight bytes (BK / 2 of MXFP4, BK
of FP8) and splits them into even and odd elements (the low and high nibbles: no interleave). The weights
are decoded in registers to bf16 *with their scale folded in*: e2m1 * 2^s and e4m3 * 2^s have at most 4
significant bits, so they are exact in bf16 (as are the fp8-quantised activations), and every product in
the bf16 tensor-core dot is exact, accumulated in fp32. The result differs from the fp32 reference only by
summation order. Decoding: an e2m1 nibble is rewritten as the e4m3 code of value / 64 (``_e2m1_as_e4m3``),
so both formats take the hardware e4m3 -> f16 conversion (two codes per instruction), then the scale (and
64 for e2m1) in fp32 (exact: the kernels keep fp32 subnormals). The fp8 x fp8 alternative (e2m1 -> e4m3
is lossless) would halve MMA time, but decode at batch <= 64 is bound by weight bytes, not MMA rate, and
Hopper's fp8 MMA accumulates with ~14 bits (DeepSeek-V3 report §3.3.2), which would flip the FP8 rounding
of the activation before w2 far more often. Under TRITON_INTERPRET=1 operands stay fp32 (the interpreter
has no bf16 dot) and the codes go through the bit decoder (its fp8 cast misreads NaN codes).

Latency. The raw bytes of step k + 1 are requested before step k is decoded (a register double buffer of
a few dozen bytes per thread), so their latency overlaps step k's decode and dots instead of adding to it;
the loads are 16-byte vectors (K is a multiple of 32, told to the compiler).

The tile shape and S are constants of the kernel, never chosen from the batch: a pair's row is computed by
the same instructions in a batch of 1 or 64, so the result is batch invariant bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashtier.kernels.quant.fp8_bits import _e4m3_to_f32, _e8m0_to_f32
from flashtier.kernels.moe.splitk_reduce_kernel import launch_splitk_reduce
from flashtier.kernels.moe.tile_kernel import _swiglu_qdq, _tile_rows

WORKSPACE_BYTES = 128 << 20  # split-K partials per window: 64 decode tokens at S = 8 fit in one window
MAX_SPLIT_K = 64


@dataclass(frozen=True)
class MoEGemmConfig:
    """Launch shape of the grouped GEMM. The M tile (also ``moe_align``'s block size) only sets how many pairs
    share a tile: each pair's row is summed over K in the same steps whatever the tile width, so
    ``default_config`` may pick it from the batch. The K step and the K splits are the reduction order: fixed."""

    block_m: int = 16  # pairs per tile: decode batches put a few pairs on each expert
    block_n: int = 32  # output columns per program (a multiple of 32: whole FP8 blocks of the activation)
    block_k: int = 64  # K elements per step: one 32-byte sector of each MXFP4 weight row
    # Chosen by benchmarks/moe_bench.py --sweep on the H200 (flash-16e layer, CUDA-graph us at 1 / 8 / 64 tokens,
    # docs/perf/moe.json "sweep"): n32 w4 s4 880 / 1389 / 3301 against 1272 / 1716 / 3410 for the earlier
    # n64 w8 s4, the fastest at 1 and 8 tokens and within 4% of the best at 64. More programs of fewer warps
    # hide more of the per-step load latency at decode sizes; the kernel stays ~25x its byte floor at 1 token.
    num_warps: int = 4
    num_stages: int = 4
    # K splits of the w1/w3 launch (K = D) and of the w2 launch (K = I; None: the same). 1 until the sweep
    # (benchmarks/moe_bench.py --sweep: 1 / 2 / 4 / 8 / 16) says otherwise: at one token the w1/w3 launch has
    # ~4 programs per SM and ~100 registers per thread allow 4-5, so splits add waves more than programs in
    # flight, and at 8+ tokens every SM already runs several waves.
    split_k: int = 1
    split_k_w2: int | None = None

    def __post_init__(self) -> None:
        pow2 = lambda v: isinstance(v, int) and v > 0 and not v & (v - 1)  # noqa: E731
        if not (pow2(self.block_m) and self.block_m >= 16 and pow2(self.block_n) and self.block_n >= 32
                and pow2(self.block_k) and self.block_k >= 64):
            raise ValueError(f"MoEGemmConfig: block_m >= 16, block_n >= 32, block_k >= 64, powers of two; got {self}")
        for name in ("split_k", "split_k_w2"):
            v = getattr(self, name)
            if not (v is None and name == "split_k_w2") and (isinstance(v, bool) or not isinstance(v, int)
                                                             or not 1 <= v <= MAX_SPLIT_K):
                raise ValueError(f"MoEGemmConfig: {name} must be an int in [1, {MAX_SPLIT_K}], got {v!r}")

    def splits(self, gated: bool) -> int:
        """K splits of the gated (w1/w3) or the w2 launch."""
        return self.split_k if gated or self.split_k_w2 is None else self.split_k_w2


DEFAULT_CONFIG = MoEGemmConfig()
WIDE_TILE = dataclasses.replace(DEFAULT_CONFIG, block_m=32)


def default_config(n_tokens: int, top_k: int, n_experts: int) -> MoEGemmConfig:
    """block_m 32 once the experts get >= 16 pairs each on average, else 16: fewer tiles decode each expert's
    weights fewer times (flash-16e, 64 decode rows, 24 pairs per expert: 70.6 vs 75.6 ms per step on the H200;
    8 rows: within 0.4%). Batch invariance holds across the switch (tests/kernels/test_moe_grouped_gemm.py
    ``test_real_geometry_gpu``, tests/engine/test_batch_invariance_gpu.py)."""
    return WIDE_TILE if n_tokens * top_k >= 16 * n_experts else DEFAULT_CONFIG


@triton.jit
def _load_weights(p_wq, p_ws, base_q, base_s, o_n, m_n, k0, K, live, FP8_W: tl.constexpr, BK: tl.constexpr):
    """Raw bytes of weight rows ``o_n`` at K columns [k0, k0 + BK) (none when ``live`` is false): codes
    ([BN, BK / 2] MXFP4, element 2j in the low nibble of byte j; [BN, BK] FP8) and scale bytes [BN, BK / 32]."""
    NS: tl.constexpr = BK // 32
    o_s = k0 // 32 + tl.arange(0, NS)
    m_s = m_n[:, None] & (o_s < K // 32)[None, :] & live
    o_r = o_n.to(tl.int64)[:, None]
    if FP8_W:  # codes [rows, K], one scale per 32 x 32 block [rows / 32, K / 32]
        o_k = k0 + tl.arange(0, BK)
        b_w = tl.load(p_wq + o_r * K + o_k[None, :], mask=m_n[:, None] & (o_k < K)[None, :] & live, other=0)
        b_s = tl.load(p_ws + (o_n // 32).to(tl.int64)[:, None] * (K // 32) + o_s[None, :], mask=m_s, other=127)
    else:  # MXFP4: codes [rows, K / 2]; scales [rows, K / 32]
        o_kb = k0 // 2 + tl.arange(0, BK // 2)
        b_w = tl.load(p_wq + base_q + o_r * (K // 2) + o_kb[None, :],
                      mask=m_n[:, None] & (o_kb < K // 2)[None, :] & live, other=0)
        b_s = tl.load(p_ws + base_s + o_r * (K // 32) + o_s[None, :], mask=m_s, other=127)
    return b_w, b_s


@triton.jit
def _e2m1_as_e4m3(b):
    """uint8 e4m3 codes of (e2m1 value / 64) for the e2m1 codes in the low nibble of uint8 ``b``.

    e2m1 (s e1 e0 m) -> e4m3 (s 0 0 e1 e0 m 0 0): exponent field e = e1 e0 and mantissa m / 2 give
    2^(e - 7) * (1 + m / 2) for e >= 1, which is the e2m1 value 2^(e - 1) * (1 + m / 2) over 64; for e = 0 the
    e4m3 subnormal m * 4 * 2^-9 = m * 2^-7 is 0.5 * m / 64. The sign bit moves from bit 3 to bit 7
    (code 8 -> 0x80, -0.0).
    """
    return ((b & 7) << 2) | ((b & 8) << 4)


@triton.jit
def _decode_weights(b_w, b_s, FP8_W: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
    """Raw bytes from ``_load_weights`` -> (even, odd) elements, each [BN, BK / 2] in DT with the scale folded in
    (exact)."""
    BN: tl.constexpr = b_w.shape[0]
    HALF: tl.constexpr = BK // 2
    NS: tl.constexpr = BK // 32
    # one scale per 16 even (odd) elements: repeat each 16 times in registers
    b_s = _e8m0_to_f32(b_s.to(tl.int32))
    b_s = tl.reshape(tl.broadcast_to(b_s[:, :, None], (BN, NS, 16)), (BN, HALF))
    if FP8_W:
        b_ce, b_co = tl.split(tl.reshape(b_w, (BN, HALF, 2)))
    else:  # e2m1 -> the e4m3 code of value / 64 (exact: 2 exponent bits, 1 mantissa bit)
        b_ce = _e2m1_as_e4m3(b_w)
        b_co = _e2m1_as_e4m3(b_w >> 4)
    if DT == tl.float32:  # interpreted: the bit decoder (the interpreter's fp8 cast misreads NaN codes)
        b_even = _e4m3_to_f32(b_ce.to(tl.int32))
        b_odd = _e4m3_to_f32(b_co.to(tl.int32))
    else:  # the hardware conversion, two codes per instruction
        b_even = b_ce.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        b_odd = b_co.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    b_even = b_even * b_s
    b_odd = b_odd * b_s
    if not FP8_W:  # value / 64 * 2^s is exact (>= 2^-134, fp32 subnormals reach 2^-149); then * 64
        b_even = b_even * 64.0
        b_odd = b_odd * 64.0
    return b_even.to(DT), b_odd.to(DT)


@triton.jit
def _load_act(p_arow, m_r, k0, K, live, BK: tl.constexpr):
    """Activations [BM, BK] at K columns [k0, k0 + BK) in their stored dtype (zeros when ``live`` is false)."""
    o_k = k0 + tl.arange(0, BK)
    return tl.load(p_arow + o_k[None, :], mask=m_r[:, None] & (o_k < K)[None, :] & live, other=0.0)


@triton.jit
def _gemm_tile(
    p_arow, m_r, p_wq, p_ws, base_q, base_s, o_n, m_n, w3_rows, K, i_k,
    GATED: tl.constexpr, FP8_W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DT: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """``A W^T`` over K split ``i_k`` for BM activation rows (``p_arow`` [BM, 1] row pointers) and weight rows
    ``o_n``; when GATED also for the w3 rows ``w3_rows`` below them: ``(acc, acc3)`` fp32 [BM, BN]."""
    K = tl.multiple_of(K, 32)  # checked by the caller (whole scale blocks): lets the loads be 16-byte vectors
    HALF: tl.constexpr = BK // 2
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = K
    else:
        k_len = tl.cdiv(tl.cdiv(K, BK), SPLIT_K) * BK
        k_lo = i_k * k_len
        k_hi = tl.minimum(k_lo + k_len, K)
    b_acc = tl.zeros((BM, BN), dtype=tl.float32)
    b_acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    live = k_lo < k_hi
    b_a = _load_act(p_arow, m_r, k_lo, K, live, BK)
    b_w, b_s = _load_weights(p_wq, p_ws, base_q, base_s, o_n, m_n, k_lo, K, live, FP8_W, BK)
    b_w3, b_s3 = b_w, b_s
    if GATED:
        b_w3, b_s3 = _load_weights(p_wq, p_ws, base_q, base_s, o_n + w3_rows, m_n, k_lo, K, live, FP8_W, BK)
    for k0 in range(k_lo, k_hi, BK):
        # step k0 + BK's bytes are requested before step k0 is decoded: their latency hides behind the work
        live = k0 + BK < k_hi
        b_a_nxt = _load_act(p_arow, m_r, k0 + BK, K, live, BK)
        b_w_nxt, b_s_nxt = _load_weights(p_wq, p_ws, base_q, base_s, o_n, m_n, k0 + BK, K, live, FP8_W, BK)
        b_w3_nxt, b_s3_nxt = b_w_nxt, b_s_nxt
        if GATED:
            b_w3_nxt, b_s3_nxt = _load_weights(p_wq, p_ws, base_q, base_s, o_n + w3_rows, m_n, k0 + BK, K, live,
                                               FP8_W, BK)
        b_ae, b_ao = tl.split(tl.reshape(b_a, (BM, HALF, 2)))
        b_ae, b_ao = b_ae.to(DT), b_ao.to(DT)
        b_we, b_wo = _decode_weights(b_w, b_s, FP8_W, BK, DT)
        b_acc = tl.dot(b_ae, tl.trans(b_we), b_acc)
        b_acc = tl.dot(b_ao, tl.trans(b_wo), b_acc)
        if GATED:
            b_we, b_wo = _decode_weights(b_w3, b_s3, FP8_W, BK, DT)
            b_acc3 = tl.dot(b_ae, tl.trans(b_we), b_acc3)
            b_acc3 = tl.dot(b_ao, tl.trans(b_wo), b_acc3)
        b_a, b_w, b_s, b_w3, b_s3 = b_a_nxt, b_w_nxt, b_s_nxt, b_w3_nxt, b_s3_nxt
    return b_acc, b_acc3


@triton.jit
def _moe_gemm_kernel(
    p_a, p_ids, p_block_expert, p_rw, p_wq, p_ws, p_sq, p_ss, p_out, p_part,
    n_pairs, n_tok, top_k, n_rblocks, m_base, K_R, K_S, N_R, N_S, stride_a, stride_out,
    stride_ps, stride_ph, stride_pr, limit,
    GATED: tl.constexpr, UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    # Traffic per program: BN (x2 when GATED) weight rows of K / SPLIT_K elements, BM activation rows of as many.
    # M tiles [0, n_rblocks): BM pairs of one routed expert (moe_align's blocks), MXFP4 weights.
    # M tiles [n_rblocks, ...): BM tokens of the shared expert, FP8 weights.
    i_m, i_n, i_k = m_base + tl.program_id(0), tl.program_id(1), tl.program_id(2)
    DT: tl.constexpr = tl.float32 if UPCAST else tl.bfloat16
    e, o_a, o_out, m_r, b_rw = _tile_rows(i_m, p_ids, p_block_expert, p_rw, n_pairs, n_tok, top_k, n_rblocks,
                                          GATED, BM)
    if e < 0:  # a block no expert uses
        return
    o_n = i_n * BN + tl.arange(0, BN)
    p_arow = p_a + o_a.to(tl.int64)[:, None] * stride_a
    if i_m < n_rblocks:
        m_n = o_n < N_R
        n_w = 2 * N_R if GATED else N_R  # w1 and w3 are 2 * N_R rows per expert
        e64 = e.to(tl.int64)
        b_acc, b_acc3 = _gemm_tile(
            p_arow, m_r, p_wq, p_ws, e64 * n_w * (K_R // 2), e64 * n_w * (K_R // 32), o_n, m_n, N_R, K_R, i_k,
            GATED, False, BM, BN, BK, DT, SPLIT_K,
        )
    else:
        m_n = o_n < N_S
        b_acc, b_acc3 = _gemm_tile(p_arow, m_r, p_sq, p_ss, 0, 0, o_n, m_n, N_S, K_S, i_k, GATED, True, BM, BN, BK,
                                   DT, SPLIT_K)
    m_out = m_r[:, None] & m_n[None, :]
    if SPLIT_K == 1:
        p_orow = p_out + o_out.to(tl.int64)[:, None] * stride_out + o_n[None, :]
        if GATED:
            tl.store(p_orow, _swiglu_qdq(b_acc, b_acc3, b_rw, limit, BM, BN), mask=m_out)
        else:
            tl.store(p_orow, b_acc, mask=m_out)
    else:  # this split's partial sums, at the tile's rows of this window's workspace
        o_w = (i_m - m_base) * BM + tl.arange(0, BM)
        p_prow = p_part + i_k * stride_ps + o_w.to(tl.int64)[:, None] * stride_pr + o_n[None, :]
        tl.store(p_prow, b_acc, mask=m_out)
        if GATED:
            tl.store(p_prow + stride_ph, b_acc3, mask=m_out)


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
    output width of the routed (r) and shared (s) weights, multiples of 32. ``out``: gated, bf16
    ``[M tiles * block_m, >= max(n_r, n_s)]``; else fp32 ``[n_pairs (+ n_tok with shared), n_r]``. With
    ``config.splits(gated) > 1`` a workspace of at most ``WORKSPACE_BYTES`` is allocated here and freed after.
    """
    bm, splits = config.block_m, config.splits(gated)
    n_rblocks = block_expert.numel()
    n_m = n_rblocks + (triton.cdiv(n_tok, bm) if shared is not None else 0)
    if n_m == 0:
        return out
    sq, ss = shared if shared is not None else routed  # never read without shared tiles
    width = max(n_r, n_s)
    grid_n = triton.cdiv(width, config.block_n)
    rows = (a, ids, block_expert, out if route_w is None else route_w)
    sizes = (top_k * n_tok, n_tok, top_k, n_rblocks)
    consts = dict(GATED=gated, UPCAST=_upcast(), BM=bm, BN=config.block_n, BK=config.block_k,
                  num_warps=config.num_warps, num_stages=config.num_stages)
    if splits == 1:
        _moe_gemm_kernel[(n_m, grid_n, 1)](
            *rows, routed[0], routed[1], sq, ss, out, out, *sizes, 0, k_r, k_s, n_r, n_s, a.stride(0), out.stride(0),
            0, 0, 0, float(limit), SPLIT_K=1, **consts,
        )
        return out
    halves = 2 if gated else 1
    window = max(1, min(n_m, WORKSPACE_BYTES // (splits * halves * bm * width * 4)))
    part = torch.empty((splits, halves, window * bm, width), dtype=torch.float32, device=a.device)
    for m0 in range(0, n_m, window):
        n_win = min(window, n_m - m0)
        _moe_gemm_kernel[(n_win, grid_n, splits)](
            *rows, routed[0], routed[1], sq, ss, out, part, *sizes, m0, k_r, k_s, n_r, n_s, a.stride(0),
            out.stride(0), part.stride(0), part.stride(1), part.stride(2), float(limit), SPLIT_K=splits, **consts,
        )
        launch_splitk_reduce(part, out, *rows[1:], *sizes, m0, n_win, n_r, n_s, float(limit), gated=gated,
                             block_m=bm, splits=splits)
    return out
