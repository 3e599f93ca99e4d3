"""Rotary position embedding on the last ``rope_dim`` channels, interleaved pairs, with YaRN.

Pairs are adjacent channels ``(x[2i], x[2i+1])`` of the rotated slice (model.md §3.9). Layers with a
compression ratio > 0 use ``compress_rope_theta`` and YaRN frequency interpolation for everything in
the layer (q, window KV, compressed KV, indexer q/k); ratio-0 layers (0, 1, DSpark) use ``rope_theta``
without YaRN. No attention-scale (mscale) correction is applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from flashtier.engine.model.config import ModelConfig
from flashtier.engine.model.numerics import up
from flashtier.kernels.rope.op import rope_rotate


def _yarn_correction_dim(n_rot: float, dim: int, base: float, orig_len: int) -> float:
    # the rotary dimension index whose wavelength completes n_rot turns within orig_len positions
    return dim * math.log(orig_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))


def rope_frequencies(cfg: ModelConfig, yarn: bool) -> torch.Tensor:
    """Per-pair inverse frequencies [rope_dim/2] (fp32)."""
    dim = cfg.qk_rope_head_dim
    base = cfg.compress_rope_theta if yarn else cfg.rope_theta
    # explicit CPU: a model built under torch.device("meta") still needs real tables
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    if yarn and cfg.max_position_embeddings > cfg.original_seq_len:
        low = max(math.floor(_yarn_correction_dim(cfg.beta_fast, dim, base, cfg.original_seq_len)), 0)
        high = min(math.ceil(_yarn_correction_dim(cfg.beta_slow, dim, base, cfg.original_seq_len)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp  # 1 = keep the original (high) frequency, 0 = interpolate by the factor
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    return freqs.to(torch.float32)


@dataclass(frozen=True)
class Rope:
    """Rotation tables of one layer kind (with or without YaRN)."""

    freqs: torch.Tensor  # [rope_dim/2] fp32
    rope_dim: int
    # the table per (device, dtype), copied once: a pageable host->GPU copy per call would sync the stream
    _cached: dict = field(default_factory=dict, compare=False, repr=False)

    def _freqs(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._cached:
            self._cached[key] = self.freqs.to(device=device, dtype=dtype)
        return self._cached[key]

    def apply(self, x: torch.Tensor, pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the last ``rope_dim`` channels of ``x`` [T, (H,) D] by ``pos`` [T].

        Tokens are the first axis; any middle axes (heads) broadcast. Returns a new fp32 tensor (float64 for
        float64 x); ``inverse`` rotates by ``-pos`` (undoes the rotation). One Triton launch on CUDA
        (``kernels/rope/op.py``), the torch expression elsewhere.
        """
        x = up(x)
        return rope_rotate(x, pos, self._freqs(pos.device, x.dtype), self.rope_dim, inverse=inverse)


def make_rope(cfg: ModelConfig, yarn: bool) -> Rope:
    return Rope(rope_frequencies(cfg, yarn), cfg.qk_rope_head_dim)
