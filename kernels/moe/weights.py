"""The tensors one MoE layer's expert ops read: routed experts stacked in MXFP4, the shared expert in FP8.

Both are plain tuples of uint8 tensors (raw bytes), so ``kernels/`` stays free of any module state; the
engine's container (``engine/model/expert_weights.py``) owns and fills them. I = the expert's intermediate
width, D = hidden width; w1 (gate) and w3 (up) are fused along the output axis, w1 first.

    MXFP4Experts  (e2m1 codes, even element in the low nibble; one e8m0 scale per 32 along K)
      w13_codes   [E, 2I, D/2]    rows [0, I) = w1, [I, 2I) = w3
      w13_scales  [E, 2I, D/32]
      w2_codes    [E, D, I/2]
      w2_scales   [E, D, I/32]

    FP8Expert     (e4m3fn codes; one ue8m0 scale per 32 x 32 block, as the checkpoint stores them)
      w13_codes   [2I, D]         rows [0, I) = w1, [I, 2I) = w3
      w13_scales  [2I/32, D/32]
      w2_codes    [D, I]
      w2_scales   [D/32, I/32]

Bytes per parameter: MXFP4 0.5 + 1/32 = 0.53, FP8 1 + 1/1024.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class MXFP4Experts(NamedTuple):
    """Routed experts of one layer (see the module docstring for shapes)."""

    w13_codes: torch.Tensor
    w13_scales: torch.Tensor
    w2_codes: torch.Tensor
    w2_scales: torch.Tensor

    @property
    def n_experts(self) -> int:
        return self.w13_codes.shape[0]

    @property
    def inter(self) -> int:
        return self.w13_codes.shape[1] // 2

    @property
    def dim(self) -> int:
        return self.w2_codes.shape[1]


class FP8Expert(NamedTuple):
    """The shared expert of one layer (see the module docstring for shapes)."""

    w13_codes: torch.Tensor
    w13_scales: torch.Tensor
    w2_codes: torch.Tensor
    w2_scales: torch.Tensor

    @property
    def inter(self) -> int:
        return self.w13_codes.shape[0] // 2

    @property
    def dim(self) -> int:
        return self.w2_codes.shape[0]


def _check(t, name: str, shape: tuple[int, ...], op: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{op}: {name} must be a uint8 tensor of raw bytes, got {got}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{op}: {name} must have shape {list(shape)}, got {list(t.shape)}")


def check_mxfp4_experts(w: MXFP4Experts, dim: int, op: str) -> None:
    """Raise ValueError naming the field when ``w`` is not a consistent stack for hidden width ``dim``."""
    if not isinstance(w, MXFP4Experts):
        raise ValueError(f"{op}: experts must be an MXFP4Experts, got {type(w).__name__}")
    if w.w13_codes.dim() != 3 or w.w13_codes.shape[1] % 64 or w.w13_codes.shape[0] < 1:
        raise ValueError(f"{op}: experts.w13_codes must be [E, 2I, D/2] with I a multiple of 32, got "
                         f"{list(w.w13_codes.shape)}")
    e, i = w.n_experts, w.inter
    _check(w.w13_codes, "experts.w13_codes", (e, 2 * i, dim // 2), op)
    _check(w.w13_scales, "experts.w13_scales", (e, 2 * i, dim // 32), op)
    _check(w.w2_codes, "experts.w2_codes", (e, dim, i // 2), op)
    _check(w.w2_scales, "experts.w2_scales", (e, dim, i // 32), op)


def check_fp8_expert(w: FP8Expert, dim: int, op: str) -> None:
    """Raise ValueError naming the field when ``w`` is not a consistent FP8 expert for hidden width ``dim``."""
    if not isinstance(w, FP8Expert):
        raise ValueError(f"{op}: shared must be an FP8Expert or None, got {type(w).__name__}")
    if w.w13_codes.dim() != 2 or w.w13_codes.shape[0] % 64 or w.w13_codes.shape[0] < 64:
        raise ValueError(f"{op}: shared.w13_codes must be [2I, D] with I a multiple of 32, got "
                         f"{list(w.w13_codes.shape)}")
    i = w.inter
    _check(w.w13_codes, "shared.w13_codes", (2 * i, dim), op)
    _check(w.w13_scales, "shared.w13_scales", (2 * i // 32, dim // 32), op)
    _check(w.w2_codes, "shared.w2_codes", (dim, i), op)
    _check(w.w2_scales, "shared.w2_scales", (dim // 32, i // 32), op)
