"""Rotary position embedding of the last ``rope_dim`` channels, interleaved pairs (model.md §3.9).

    rope_rotate(x, pos, freqs, rope_dim, inverse)     x [T, ..., D], pos [T] int, freqs [rope_dim / 2]
        pair i of the rotated slice (x[2i], x[2i+1]) of token t turns by angle pos[t] * freqs[i]
        (by -angle with ``inverse``); the first D - rope_dim channels pass unchanged.

Returns a new tensor in x's dtype (fp32 or float64; the model calls it on fp32 / fp64 values). The reference is
the torch expression the model ran before; on CUDA one Triton launch (``rope/kernel.py``) replaces its ~12
(which were ~1,600 of a decode step's ~4,900 kernels). cos and sin come from Triton's libdevice there: the two
agree to a few fp32 ulps (tests/kernels/test_rope.py). Elementwise per token: batch invariant.

Dispatch: ``impl="auto"`` runs Triton on CUDA fp32 tensors with rope_dim / 2 a power of two, else the reference;
"reference" / "triton" force one (Triton on the CPU needs TRITON_INTERPRET=1). Failure: ValueError naming the
argument. Reads its inputs only.
"""

from __future__ import annotations

import torch

from flashtier.kernels.quant.common import resolve_impl
from flashtier.kernels.rope.kernel import rope_triton

__all__ = ["rope_reference", "rope_rotate"]

_OP = "rope_rotate"


def rope_reference(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, rope_dim: int, inverse: bool) -> torch.Tensor:
    ang = pos.to(x.dtype)[..., None] * freqs.to(x.dtype)
    cos, sin = torch.cos(ang), torch.sin(ang)  # [T, R/2]
    shape = (pos.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    if inverse:
        sin = -sin
    nope, rot = x[..., :-rope_dim], x[..., -rope_dim:]
    a, b = rot[..., 0::2], rot[..., 1::2]
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    out = torch.stack((ra, rb), dim=-1).flatten(-2)
    return torch.cat((nope, out), dim=-1)


def _validate(x, pos, freqs, rope_dim) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{_OP}: x must be a float32 / float64 tensor [T, ..., D], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim < 2 or rope_dim % 2 or rope_dim > x.shape[-1]:
        raise ValueError(f"{_OP}: rope_dim must be an even int in [2, D={x.shape[-1]}], got {rope_dim!r}")
    if not isinstance(pos, torch.Tensor) or pos.dim() != 1 or pos.shape[0] != x.shape[0] or pos.is_floating_point():
        raise ValueError(f"{_OP}: pos must be an integer tensor [T={x.shape[0]}], got {getattr(pos, 'shape', pos)}")
    if not isinstance(freqs, torch.Tensor) or tuple(freqs.shape) != (rope_dim // 2,):
        raise ValueError(f"{_OP}: freqs must have shape [{rope_dim // 2}], got {getattr(freqs, 'shape', freqs)}")
    if pos.device != x.device or freqs.device != x.device:
        raise ValueError(f"{_OP}: x, pos and freqs must be on one device")


def rope_rotate(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, rope_dim: int, *, inverse: bool = False,
                impl: str = "auto") -> torch.Tensor:
    """Rotate the last ``rope_dim`` channels of ``x`` by ``pos`` (see the module docstring)."""
    _validate(x, pos, freqs, rope_dim)
    impl = resolve_impl(impl, x, _OP)
    half = rope_dim // 2
    if impl == "reference" or x.dtype != torch.float32 or half & (half - 1):
        return rope_reference(x, pos, freqs, rope_dim, inverse)
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    return rope_triton(x, pos.contiguous(), freqs.to(torch.float32).contiguous(), rope_dim, inverse, out)
