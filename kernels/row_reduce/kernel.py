"""Per-row sums in Triton with one fixed order: ``out[r] = sum_d f(x[r, d])``, f = identity or square.

Grid ``(rows,)``: one program per row walks D in BLOCK chunks from 0, adding each chunk into a BLOCK-wide
fp32 accumulator lane by lane, then folds the lanes with ``tl.sum`` (a tree whose shape depends on BLOCK and
the warp count, both fixed by D). So a row's result never depends on how many rows share the launch (torch's
reduction kernels split a row across threads and blocks when there are few rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def block_for(d: int) -> int:
    """The chunk width for rows of ``d`` elements (a function of D only: part of the reduction order)."""
    return min(1024, max(16, triton.next_power_of_2(d)))


@triton.jit
def _row_reduce_kernel(p_x, p_out, D, stride_x, SQUARE: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        v = tl.load(p_x + r * stride_x + d0 + o, mask=d0 + o < D, other=0.0).to(tl.float32)
        if SQUARE:
            v = v * v
        acc += v
    s = tl.sum(acc, axis=0)
    if MEAN:
        s = s / D
    tl.store(p_out + r, s)


def row_reduce_triton(x: torch.Tensor, out: torch.Tensor, square: bool, mean: bool) -> torch.Tensor:
    """x [R, D] dense in its last axis -> writes out [R] fp32."""
    rows, d = x.shape
    block = block_for(d)
    _row_reduce_kernel[(rows,)](x, out, d, x.stride(0), SQUARE=square, MEAN=mean, BLOCK=block,
                                num_warps=4 if block >= 512 else 1)
    return out
