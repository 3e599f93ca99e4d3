"""Compute precision of the model's math.

The model's semantics are fp32 math (model.md §6b). A model whose parameters are float64 runs every
such op in float64 instead: the oracle-exactness tests use that mode, because in fp32 two correct
paths that sum in a different order (a batch of 20 rows vs one row) differ by ~1e-7, and a
quantise-dequantise step (FP8 window KV, FP4 entries, MXFP4 index keys) or a top-k cut turns such
noise into a whole quantisation step now and then. ``up`` is the one place that decides.
"""

from __future__ import annotations

import torch

from flashtier.kernels.invariant_linear.op import linear as invariant_linear


def up(x: torch.Tensor) -> torch.Tensor:
    """fp32 view of ``x`` for the model's fp32 math, or ``x`` itself when it is already float64."""
    return x if x.dtype == torch.float64 else x.float()


def qdq(op, x: torch.Tensor) -> torch.Tensor:
    """Apply a quantise-dequantise kernel op (fp32 in, fp32 out) in the compute precision of ``x``.

    In float64 mode the value is rounded to fp32 first (the formats' grid is far coarser than fp32,
    so this rounding never moves a value across a quantisation step except on an exact fp32 tie).
    """
    if x.dtype == torch.float64:
        return op(x.float()).double()
    return op(x)


def linear_up(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, up(w))`` in x's precision, batch invariant on CUDA (``kernels/invariant_linear/op.py``):
    a row's bits do not depend on the other rows of the call. A bf16 weight under fp32 x is read as stored
    (upcast exactly inside the kernel: no fp32 copy of the weight)."""
    if w.dtype != x.dtype and not (w.dtype == torch.bfloat16 and x.dtype == torch.float32):
        w = w.to(x.dtype)
    return invariant_linear(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
