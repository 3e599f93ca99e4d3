"""Triton split-K reduction of the grouped MoE GEMM: partial sums in ascending split order, then the epilogue.

The GEMM (``moe/grouped_gemm_kernel.py``, ``split_k`` S > 1) leaves, for one window of M tiles, fp32
partials ``part [S, 1 or 2, window rows, N]`` (GATED: a = A W1^T and b = A W3^T; else A W2^T). Per row and
column this kernel computes

    v = ((part[0] + part[1]) + part[2]) + ... + part[S - 1]          splits ascending, one rounding per add

then, GATED, the single-pass epilogue on (a, b): ``fp8_qdq(r * (silu(min(a, L)) * clamp(b, -L, L)))`` as bf16
into the activation buffer (``_moe_tile_triton._swiglu_qdq``: the same ops in the same order), else the
plain fp32 store into the pair's (or the shared token's) output row. No atomics: every output element is
written by one program, so the sum's order and bits are fixed and do not depend on the batch.

Grid (window M tiles, N / BN); BN is a multiple of 32 (the activation's FP8 blocks). Rows a tile does not
own (the padding of an expert's last block, an unused block) are neither read nor written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtier.kernels.moe.tile_kernel import _swiglu_qdq, _tile_rows

TILE_ELEMS = 2048  # BM x BN of one program (x2 GATED): 16 to 64 fp32 per thread at 4 warps


@triton.jit
def _splitk_sum(p_prow, m, stride_ps, SPLIT_K: tl.constexpr):
    """``part[0] + part[1] + ... + part[SPLIT_K - 1]`` at ``p_prow`` [BM, BN], in ascending split order."""
    b_v = tl.load(p_prow, mask=m, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        b_v += tl.load(p_prow + s * stride_ps, mask=m, other=0.0)
    return b_v


# Integer arguments that follow the batch, left unspecialised (engine/warmup.py says why)
BATCH_COUNTS = ("n_pairs", "n_tok", "n_rblocks", "m_base")


@triton.jit(do_not_specialize=BATCH_COUNTS)
def _moe_splitk_reduce_kernel(
    p_part, p_out, p_ids, p_block_expert, p_rw, n_pairs, n_tok, top_k, n_rblocks, m_base, N_R, N_S,
    stride_ps, stride_ph, stride_pr, stride_out, limit,
    GATED: tl.constexpr, SPLIT_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    # Traffic per program: SPLIT_K (x2 when GATED) fp32 BM x BN partials in; one BM x BN tile out.
    i_m, i_n = m_base + tl.program_id(0), tl.program_id(1)
    e, o_a, o_out, m_r, b_rw = _tile_rows(i_m, p_ids, p_block_expert, p_rw, n_pairs, n_tok, top_k, n_rblocks,
                                          GATED, BM)
    if e < 0:  # a block no expert uses: the GEMM wrote nothing there
        return
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < tl.where(i_m < n_rblocks, N_R, N_S)
    m = m_r[:, None] & m_n[None, :]
    o_w = (i_m - m_base) * BM + tl.arange(0, BM)
    p_prow = p_part + o_w.to(tl.int64)[:, None] * stride_pr + o_n[None, :]
    b_a = _splitk_sum(p_prow, m, stride_ps, SPLIT_K)
    p_orow = p_out + o_out.to(tl.int64)[:, None] * stride_out + o_n[None, :]
    if GATED:
        b_b = _splitk_sum(p_prow + stride_ph, m, stride_ps, SPLIT_K)
        tl.store(p_orow, _swiglu_qdq(b_a, b_b, b_rw, limit, BM, BN), mask=m)
    else:
        tl.store(p_orow, b_a, mask=m)


def launch_splitk_reduce(
    part: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, block_expert: torch.Tensor, route_w: torch.Tensor,
    n_pairs: int, n_tok: int, top_k: int, n_rblocks: int, m_base: int, n_win: int, n_r: int, n_s: int,
    limit: float, *, gated: bool, block_m: int, splits: int,
) -> None:
    """Reduce the partials of M tiles [m_base, m_base + n_win) into ``out`` (mutated; layout as the GEMM's).

    ``part [splits, 1 or 2, >= n_win * block_m, >= max(n_r, n_s)]`` fp32 as the GEMM wrote it; ``ids``,
    ``block_expert``, ``route_w`` and the sizes as given to the GEMM launch (``route_w`` is read only when gated).
    """
    bn = max(32, TILE_ELEMS // block_m)
    _moe_splitk_reduce_kernel[(n_win, triton.cdiv(max(n_r, n_s), bn))](
        part, out, ids, block_expert, route_w, n_pairs, n_tok, top_k, n_rblocks, m_base, n_r, n_s,
        part.stride(0), part.stride(1), part.stride(2), out.stride(0), limit,
        GATED=gated, SPLIT_K=splits, BM=block_m, BN=bn, num_warps=4,
    )
