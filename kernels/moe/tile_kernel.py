"""What one M tile of the grouped MoE GEMM holds, and the gated epilogue: Triton functions shared by the GEMM
(``moe/grouped_gemm_kernel.py``) and the split-K reduction (``moe/splitk_reduce_kernel.py``).

M tiles ``[0, n_rblocks)`` are ``moe_align``'s blocks (BM pairs of one routed expert, -1: unused); the tiles
after them hold BM tokens each for the shared expert. Per row of a tile, ``_tile_rows`` gives the row it
reads (``o_a``), the row it writes (``o_out``), whether the row is real (``m_r``) and its routing weight:

    routed, GATED   reads x[pair // top_k]    writes act[tile row]       weight route_w[pair]
    routed, w2      reads act[tile row]       writes out[pair]
    shared, GATED   reads x[token]            writes act[tile row]       weight 1
    shared, w2      reads act[tile row]       writes out[n_pairs + token]

Both kernels call these, so a row's mapping and its epilogue are one definition: the split-K path applies
exactly the ops of the single-pass epilogue, in the same order, to the reduced sums.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtier.kernels.quant.fp8 import _fp8_codes, _fp8_scale, _fp8_values


@triton.jit
def _tile_rows(
    i_m, p_ids, p_block_expert, p_rw, n_pairs, n_tok, top_k, n_rblocks, GATED: tl.constexpr, BM: tl.constexpr,
):
    """Rows of M tile ``i_m``: ``(e, o_a, o_out, m_r, b_rw)``, each per row except the tile's expert ``e``
    (-1 for a block no expert uses: its rows must not be touched; 0 for a shared tile)."""
    o_pos = i_m * BM + tl.arange(0, BM)  # this tile's rows of the activation buffer (both kinds)
    e = tl.load(p_block_expert + tl.minimum(i_m, n_rblocks - 1))  # n_rblocks >= 1 whenever anything runs
    if i_m < n_rblocks:
        o_ids = tl.load(p_ids + o_pos)
        m_r = o_ids < n_pairs  # the sentinel n_pairs pads an expert's last block
        if GATED:  # x rows by token; act stored in tile order
            o_a = o_ids // top_k
            o_out = o_pos
            b_rw = tl.load(p_rw + o_ids, mask=m_r, other=0.0)
        else:  # act in tile order; the output goes to the pair's own row
            o_a = o_pos
            o_out = o_ids
            b_rw = tl.zeros((BM,), dtype=tl.float32)
    else:
        e = e * 0
        o_t = (i_m - n_rblocks) * BM + tl.arange(0, BM)
        m_r = o_t < n_tok
        if GATED:
            o_a = o_t
            o_out = o_pos
        else:  # shared rows follow the pairs' rows in the output
            o_a = o_pos
            o_out = n_pairs + o_t
        b_rw = tl.full((BM,), 1.0, tl.float32)
    return e, o_a, o_out, m_r, b_rw


@triton.jit
def _fp8_qdq_cols(v, BM: tl.constexpr, BN: tl.constexpr):
    """``fp8_qdq`` of fp32 ``v [BM, BN]`` per 32 consecutive columns: quant_fp8's own Triton helpers."""
    b = tl.reshape(v, (BM, BN // 32, 32))
    b_exp, b_inv = _fp8_scale(tl.max(tl.abs(b), axis=2))
    return tl.reshape(_fp8_values(_fp8_codes(b, b_inv[:, :, None]), b_exp[:, :, None], False), (BM, BN))


@triton.jit
def _swiglu_qdq(b_a, b_b, b_rw, limit, BM: tl.constexpr, BN: tl.constexpr):
    """The gated epilogue on fp32 ``a = A W1^T``, ``b = A W3^T`` ``[BM, BN]`` (BN columns starting at a multiple
    of 32): ``fp8_qdq(r * (silu(min(a, L)) * clamp(b, -L, L)))`` as bf16 (exact: e4m3 * 2^s fits bf16).
    Element-wise but for the 32-column amax, so the result does not depend on the tile shape."""
    b_g = tl.minimum(b_a, limit)
    b_u = tl.minimum(tl.maximum(b_b, -limit), limit)
    b_h = b_rw[:, None] * (b_g * tl.sigmoid(b_g) * b_u)  # official order: silu(gate) * up, then the weight
    return _fp8_qdq_cols(b_h, BM, BN).to(tl.bfloat16)
