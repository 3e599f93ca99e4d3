"""Compute precision of the model's math.

The model's semantics are fp32 math (model.md §6b). A model whose parameters are float64 runs every
such op in float64 instead: the oracle-exactness tests use that mode, because in fp32 two correct
paths that sum in a different order (a batch of 20 rows vs one row) differ by ~1e-7, and a
quantise-dequantise step (FP8 window KV, FP4 entries, MXFP4 index keys) or a top-k cut turns such
noise into a whole quantisation step now and then. ``up`` is the one place that decides.
"""

from __future__ import annotations

import torch


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
