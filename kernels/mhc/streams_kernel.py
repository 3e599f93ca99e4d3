"""mHC stream collapse and update in Triton: one launch each, a fixed sum order over the ``hc`` streams.

Grid ``(T, cdiv(D, BLOCK))``. A program loads the hc streams of one token's BLOCK channels as an [HC, BLOCK]
tile and reduces over the streams with ``tl.sum`` (a fixed tree of HC lanes): no row count, tile or split
enters the order, so a token's result never depends on the other tokens of its batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _collapse_kernel(p_x, p_pre, p_y, D, HC: tl.constexpr, BLOCK: tl.constexpr):
    # y[t, d] = sum_j pre[t, j] * x[t, j, d]
    t = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    o_j = tl.arange(0, HC)
    m_d = o_d < D
    xb = tl.load(p_x + t * HC * D + o_j[:, None] * D + o_d[None, :], mask=m_d[None, :], other=0.0).to(tl.float32)
    pre = tl.load(p_pre + t * HC + o_j)
    tl.store(p_y + t * D + o_d, tl.sum(pre[:, None] * xb, axis=0), mask=m_d)


@triton.jit
def _expand_kernel(p_f, p_x, p_post, p_comb, p_y, D, HC: tl.constexpr, BLOCK: tl.constexpr):
    # y[t, k, d] = post[t, k] * f[t, d] + sum_j comb[t, j, k] * x[t, j, d]
    t = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    o_j = tl.arange(0, HC)
    m_d = o_d < D
    xb = tl.load(p_x + t * HC * D + o_j[:, None] * D + o_d[None, :], mask=m_d[None, :], other=0.0).to(tl.float32)
    f = tl.load(p_f + t * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    for k in tl.static_range(HC):
        c = tl.load(p_comb + t * HC * HC + o_j * HC + k)
        post = tl.load(p_post + t * HC + k)
        tl.store(p_y + t * HC * D + k * D + o_d, post * f + tl.sum(c[:, None] * xb, axis=0), mask=m_d)


def collapse_triton(x: torch.Tensor, pre: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    t, hc, d = x.shape
    _collapse_kernel[(t, triton.cdiv(d, BLOCK))](x, pre, out, d, HC=hc, BLOCK=BLOCK, num_warps=4)
    return out


def expand_triton(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    t, hc, d = x.shape
    _expand_kernel[(t, triton.cdiv(d, BLOCK))](f, x, post, comb, out, d, HC=hc, BLOCK=BLOCK, num_warps=4)
    return out
