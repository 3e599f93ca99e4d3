"""RMSNorm with fp32 math (model.md §6b: norm weights kept fp32, math in fp32)."""

from __future__ import annotations

import torch
from torch import nn
from flashtier.engine.model.numerics import up
from flashtier.kernels.rms_norm.op import rms_norm


class RMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * weight, computed in fp32, returned in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one batch-invariant Triton launch on CUDA (kernels/rms_norm/op.py), the torch expression elsewhere
        return rms_norm(up(x), self.weight, self.eps)
