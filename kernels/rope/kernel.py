"""Rotary embedding of interleaved pairs in one Triton launch (math: ``rope.py``'s reference).

Grid ``(rows,)``, a row = one token's (head's) D channels. The program copies the ``D - R`` leading channels and
rotates the R trailing ones as pairs (2i, 2i + 1) by ``pos[token] * freqs[i]``; cos and sin are computed in
registers. Torch needed ~12 launches per call (angles, cos, sin, four products, two sums, stack, cat).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(p_x, p_pos, p_freq, p_y, H, D, NOPE, HALF: tl.constexpr, BLOCK: tl.constexpr,
                 INVERSE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    base = r * D
    for d0 in range(0, NOPE, BLOCK):
        o = d0 + tl.arange(0, BLOCK)
        m = o < NOPE
        tl.store(p_y + base + o, tl.load(p_x + base + o, mask=m), mask=m)
    i = tl.arange(0, HALF)
    ang = tl.load(p_pos + r // H).to(tl.float32) * tl.load(p_freq + i)
    c, s = tl.cos(ang), tl.sin(ang)
    if INVERSE:
        s = -s
    pa = base + NOPE + 2 * i
    a, b = tl.load(p_x + pa), tl.load(p_x + pa + 1)
    tl.store(p_y + pa, a * c - b * s)
    tl.store(p_y + pa + 1, a * s + b * c)


def rope_triton(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, rope_dim: int, inverse: bool,
                out: torch.Tensor) -> torch.Tensor:
    """x [T, ..., D] fp32 contiguous, pos [T], freqs [R/2] fp32 -> writes out (x's shape)."""
    t, d = x.shape[0], x.shape[-1]
    rows = x.numel() // d
    nope = d - rope_dim
    block = min(1024, max(16, triton.next_power_of_2(max(nope, 1))))
    _rope_kernel[(rows,)](x, pos, freqs, out, rows // t, d, nope, HALF=rope_dim // 2, BLOCK=block,
                          INVERSE=inverse, num_warps=4 if block >= 256 else 1)
    return out
