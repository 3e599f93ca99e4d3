"""A batch-invariant linear: every output row computed the same way whatever rows share the call.

    y = linear(x, w)      x [M, K] fp32 or bf16, w [N, K] (x's dtype, or bf16 under fp32 x) -> y [M, N] in x's dtype

The same result as ``F.linear(x, w.to(x.dtype))`` up to summation order, with the promise cuBLAS does not
make: row i's bits do not depend on M or on the other rows (cuBLAS and torch pick tile, split-K and
reduction layout by the shape, so one request's logits moved when a batch's row count changed). The Triton
kernel walks K in fixed steps from 0 in one program per output tile (``invariant_linear/kernel.py``).

Precision: bf16 x and w: bf16 MMAs, fp32 accumulation, bf16 output (as ``F.linear`` in bf16). fp32 x with a
bf16 w (the fp32 head over its bf16 weight, no fp32 copy of the weight): x split exactly into three bf16
parts, exact products summed in fp32. fp32 x and w: both split into three bf16 parts, the six significant
part products on the tensor cores (about fp32 accuracy). Against the fp32 reference: fp32 rounding of another
summation order (tests/kernels/test_invariant_linear.py states the tolerances).

Dispatch: ``impl="auto"`` runs Triton on CUDA tensors and the reference elsewhere (the CPU and float64 oracle
paths keep their exact ``F.linear``); "reference" / "triton" force one (Triton on the CPU needs
TRITON_INTERPRET=1). Failure: shapes, dtypes and devices are checked here (ValueError naming the argument).
Nothing mutates its inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashtier.kernels.invariant_linear.kernel import (
    MODE_BF16, MODE_F32, MODE_F32_X_BF16_W, LinearConfig, linear_triton,
)
from flashtier.kernels.quant.common import resolve_impl

__all__ = ["LinearConfig", "linear", "linear_reference"]

_OP = "invariant_linear"


def linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The spec: ``F.linear`` in x's dtype over the weight upcast exactly (bf16 -> fp32 / fp64)."""
    return F.linear(x, w.to(x.dtype))


def _validate(x, w) -> None:
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{_OP}: {name} must be a 2-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if x.shape[1] != w.shape[1] or x.shape[1] == 0:
        raise ValueError(f"{_OP}: x [M, K] and w [N, K] must share a positive K, got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float64):
        raise ValueError(f"{_OP}: x must be float32, bfloat16 or float64, got {x.dtype}")
    if w.dtype != x.dtype and w.dtype != torch.bfloat16:
        raise ValueError(f"{_OP}: w must be x's dtype ({x.dtype}) or bfloat16, got {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"{_OP}: x and w must be on one device, got {x.device} and {w.device}")


def linear(x: torch.Tensor, w: torch.Tensor, *, impl: str = "auto", config: LinearConfig | None = None) -> torch.Tensor:
    """``y [M, N]`` in x's dtype (see the module docstring). Returns a new tensor; reads its inputs only."""
    _validate(x, w)
    impl = resolve_impl(impl, x, _OP)
    if impl == "reference":
        return linear_reference(x, w)
    if x.dtype == torch.float64:
        raise ValueError(f"{_OP}: the Triton path takes float32 or bfloat16 x, got float64 (use the reference)")
    if x.dtype == torch.bfloat16:
        mode = MODE_BF16
    else:
        mode = MODE_F32_X_BF16_W if w.dtype == torch.bfloat16 else MODE_F32
    x, w = x.contiguous(), w.contiguous()
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    return linear_triton(x, w, mode, out, config)
