"""RMSNorm with fp32 math, batch invariant on CUDA (model.md §6b).

    rms_norm(x, weight, eps)     x [..., D] fp32 / bf16 (float64: reference), weight [D] -> [..., D] fp32
                                 y = x * rsqrt(mean(x^2) + eps) * weight

The reference is the torch expression (``x.pow(2).mean(-1, keepdim=True)``, ``rsqrt``, two products); on CUDA one
Triton launch (``rms_norm/kernel.py``) whose sum of squares has the fixed order of ``row_reduce.mean_square``, so a
row's bits do not depend on the rows beside it (torch's mean splits a row by the row count). The two agree to a few
fp32 ulps (tests/kernels/test_rms_norm.py).

Dispatch: ``impl="auto"`` Triton on CUDA tensors, else the reference; "reference" / "triton" force one.
Failure: ValueError naming the argument. Reads its inputs only.
"""

from __future__ import annotations

import torch

from flashtier.kernels.quant.common import resolve_impl
from flashtier.kernels.rms_norm.kernel import rms_norm_triton

__all__ = ["rms_norm", "rms_norm_reference"]

_OP = "rms_norm"


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x if x.dtype in (torch.float32, torch.float64) else x.float()
    w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, impl: str = "auto") -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last axis (see the module docstring)."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{_OP}: x must be a tensor [..., D] with D >= 1, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float64):
        raise ValueError(f"{_OP}: x must be float32, bfloat16 or float64, got {x.dtype}")
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"{_OP}: weight must have shape [{x.shape[-1]}], got {getattr(weight, 'shape', weight)}")
    impl = resolve_impl(impl, x, _OP)
    if impl == "reference" or x.dtype == torch.float64 or weight.dtype == torch.float64:
        return rms_norm_reference(x, weight, eps)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if out.numel():
        rms_norm_triton(rows, weight.to(torch.float32).contiguous(), float(eps), out)
    return out.view(x.shape)
