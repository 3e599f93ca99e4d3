"""RMSNorm in one Triton launch: ``y = x * rsqrt(mean(x^2) + eps) * w`` per row, fp32 math.

Grid ``(rows,)``. The sum of squares walks the row in the fixed chunks of ``_row_reduce_triton`` (the same order
as ``mean_square``: a row's bits never depend on the number of rows), then a second walk scales the row (re-read
from L1/L2). Torch took five launches (pow, mean, add, rsqrt, two products).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtier.kernels.row_reduce.kernel import block_for


@triton.jit
def _rms_norm_kernel(p_x, p_w, p_y, D, stride_x, eps, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        v = tl.load(p_x + r * stride_x + d0 + o, mask=d0 + o < D, other=0.0).to(tl.float32)
        acc += v * v
    inv = 1.0 / tl.sqrt_rn(tl.sum(acc, axis=0) / D + eps)
    for d0 in range(0, D, BLOCK):
        m = d0 + o < D
        v = tl.load(p_x + r * stride_x + d0 + o, mask=m, other=0.0).to(tl.float32)
        w = tl.load(p_w + d0 + o, mask=m, other=0.0)
        tl.store(p_y + r * D + d0 + o, v * inv * w, mask=m)


def rms_norm_triton(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
    """x [R, D] dense in its last axis, w [D] fp32 -> writes out [R, D] fp32."""
    rows, d = x.shape
    block = block_for(d)
    _rms_norm_kernel[(rows,)](x, w, out, d, x.stride(0), eps, BLOCK=block, num_warps=4 if block >= 512 else 1)
    return out
