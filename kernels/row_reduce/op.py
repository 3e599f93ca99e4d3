"""Batch-invariant row reductions over the last axis: ``row_sum(x)`` and ``mean_square(x)``.

    row_sum(x)      x [..., D] -> [...]   sum over D            (reference: ``x.sum(-1)``)
    mean_square(x)  x [..., D] -> [...]   mean of x^2 over D    (reference: ``x.pow(2).mean(-1)``)

Both return fp32 for fp32 / bf16 x (fp64 x: the reference, the oracle's float64 mode). The Triton kernel sums a
row in one fixed order (``row_reduce/kernel.py``) whatever the number of rows; torch's reduction kernels do
not promise that (a row's sum is split over more threads and blocks when there are few rows), which moved a
request's RMSNorm statistics, and so its logits, with the size of its batch.

Dispatch: ``impl="auto"`` runs Triton on CUDA tensors and the reference elsewhere; "reference" / "triton"
force one (Triton on the CPU needs TRITON_INTERPRET=1). Against the reference: fp32 rounding of another
summation order (tests/kernels/test_row_reduce.py). Failure: ValueError naming the argument. Reads x only.
"""

from __future__ import annotations

import torch

from flashtier.kernels.quant.common import resolve_impl
from flashtier.kernels.row_reduce.kernel import row_reduce_triton

__all__ = ["mean_square", "row_sum"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float64)


def _run(x: torch.Tensor, op: str, square: bool, impl: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must be a tensor [..., D] with D >= 1, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"{op}: x must be float32, bfloat16 or float64, got {x.dtype}")
    impl = resolve_impl(impl, x, op)
    if impl == "reference" or x.dtype == torch.float64:
        x = x.float() if x.dtype == torch.bfloat16 else x
        return x.pow(2).mean(-1) if square else x.sum(-1)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if out.numel():
        row_reduce_triton(rows, out, square=square, mean=square)
    return out.view(lead)


def row_sum(x: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """sum over the last axis (see the module docstring)."""
    return _run(x, "row_sum", False, impl)


def mean_square(x: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """mean of x^2 over the last axis (see the module docstring)."""
    return _run(x, "mean_square", True, impl)
