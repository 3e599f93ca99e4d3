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


class _ExpertTensors(NamedTuple):
    """The four byte tensors of an expert (or a stack of experts): fused w13 and w2, codes and scales."""

    w13_codes: torch.Tensor
    w13_scales: torch.Tensor
    w2_codes: torch.Tensor
    w2_scales: torch.Tensor

    @property
    def inter(self) -> int:
        """I: w13 has 2I rows (its second-to-last axis, after the expert axis of a stack)."""
        return self.w13_codes.shape[-2] // 2

    @property
    def dim(self) -> int:
        """D: w2 has D rows."""
        return self.w2_codes.shape[-2]


class MXFP4Experts(_ExpertTensors):
    """Routed experts of one layer (see the module docstring for shapes)."""

    __slots__ = ()

    @property
    def n_experts(self) -> int:
        return self.w13_codes.shape[0]


class FP8Expert(_ExpertTensors):
    """The shared expert of one layer (see the module docstring for shapes)."""

    __slots__ = ()


def _check(t, name: str, shape: tuple[int, ...], op: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{op}: {name} must be a uint8 tensor of raw bytes, got {got}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{op}: {name} must have shape {list(shape)}, got {list(t.shape)}")


def _check_fields(w: _ExpertTensors, arg: str, shapes: tuple[tuple[int, ...], ...], op: str) -> None:
    """``_check`` each field of ``w`` in order (w13_codes, w13_scales, w2_codes, w2_scales) against ``shapes``."""
    for field, t, shape in zip(w._fields, w, shapes, strict=True):
        _check(t, f"{arg}.{field}", shape, op)


def _check_kind(w, cls: type, arg: str, op: str, also: str = "") -> None:
    if not isinstance(w, cls):
        raise ValueError(f"{op}: {arg} must be an {cls.__name__}{also}, got {type(w).__name__}")


def _w13_error(w: _ExpertTensors, arg: str, layout: str, op: str) -> ValueError:
    return ValueError(f"{op}: {arg}.w13_codes must be {layout} with I a multiple of 32, got {list(w.w13_codes.shape)}")


def check_mxfp4_experts(w: MXFP4Experts, dim: int, op: str) -> None:
    """Raise ValueError naming the field when ``w`` is not a consistent stack for hidden width ``dim``."""
    _check_kind(w, MXFP4Experts, "experts", op)
    if w.w13_codes.dim() != 3 or w.w13_codes.shape[1] % 64 or w.w13_codes.shape[0] < 1:
        raise _w13_error(w, "experts", "[E, 2I, D/2]", op)
    e, i = w.n_experts, w.inter
    _check_fields(w, "experts", ((e, 2 * i, dim // 2), (e, 2 * i, dim // 32), (e, dim, i // 2), (e, dim, i // 32)), op)


def check_fp8_expert(w: FP8Expert, dim: int, op: str) -> None:
    """Raise ValueError naming the field when ``w`` is not a consistent FP8 expert for hidden width ``dim``."""
    _check_kind(w, FP8Expert, "shared", op, " or None")
    if w.w13_codes.dim() != 2 or w.w13_codes.shape[0] % 64 or w.w13_codes.shape[0] < 64:
        raise _w13_error(w, "shared", "[2I, D]", op)
    i = w.inter
    _check_fields(w, "shared", ((2 * i, dim), (2 * i // 32, dim // 32), (dim, i), (dim // 32, i // 32)), op)
