"""The model's quantise-dequantise rules, written again from the formats in reference/model.md §4.

Used by ``independent_forward.py`` only; nothing here comes from ``kernels/`` or ``engine/``. Each function
takes float64 or fp32 values ``[..., D]``, rounds them to fp32 (the exactness mode's convention: the formats
are defined on fp32 inputs) and returns the dequantised values in the input's dtype::

    fp8    e4m3, one power-of-two scale per 32:  amax = max(max|x|, 1e-4), s = 2^ceil(log2(amax / 448))
    fp4    e2m1, one e4m3 scale per 16:          s = e4m3(min(max(amax, 6 * 2^-9) / 6, 448))  (not a power of 2)
    mxfp4  e2m1, one power-of-two scale per 32:  s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6))

e2m1 values {0, 0.5, 1, 1.5, 2, 3, 4, 6} with a sign; rounding to nearest, a tie to the neighbour whose code
is even, saturating at 6. A zero keeps the input's sign.
"""

from __future__ import annotations

import torch

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] % size:
        raise ValueError(f"x: last dim {x.shape[-1]} is not a multiple of {size}")
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // size, size)


def _pow2_ceil(r: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 r) for positive normal fp32 r, exactly: frexp gives r = m 2^e with m in [0.5, 1)."""
    m, e = torch.frexp(r)
    return torch.ldexp(torch.ones_like(r), torch.where(m == 0.5, e - 1, e))


def _e2m1(q: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value of fp32 q (ties to the even code), as float64, sign of zero kept."""
    a = q.abs().to(torch.float64)[..., None]
    dist = (a - E2M1_GRID.to(a.device)).abs()  # exact: both sides have few significant bits
    best = dist == dist.amin(-1, keepdim=True)
    code = torch.arange(8, device=q.device)
    even = best & (code % 2 == 0)
    pick = torch.where(even.any(-1), even.int().argmax(-1), best.int().argmax(-1))
    return torch.copysign(E2M1_GRID.to(a.device)[pick], q.to(torch.float64))


def fp8_qdq(x: torch.Tensor) -> torch.Tensor:
    b = _blocks(x, 32)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = _pow2_ceil(amax / torch.full_like(amax, 448.0))
    q = (b / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)  # RNE
    return (q * s).reshape(x.shape).to(x.dtype)


def fp4_qdq(x: torch.Tensor) -> torch.Tensor:
    b = _blocks(x, 16)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-9)
    s = (amax / torch.full_like(amax, 6.0)).clamp_max(448.0).to(torch.float8_e4m3fn).to(torch.float32)
    return (_e2m1(b / s) * s.double()).reshape(x.shape).to(x.dtype)


def mxfp4_qdq(x: torch.Tensor) -> torch.Tensor:
    b = _blocks(x, 32)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-126)
    s = _pow2_ceil(amax / torch.full_like(amax, 6.0))
    return (_e2m1(b / s) * s.double()).reshape(x.shape).to(x.dtype)
