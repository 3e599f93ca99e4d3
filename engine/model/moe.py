"""Mixture of experts: sqrt-softplus gate with a selection-only bias, top-k routed + shared expert.

    s   = sqrt(softplus(x @ Wg^T / gate_temp))                 fp32 [E]
    idx = topk(s + bias, k)                                    the bias only selects
    w   = s[idx] / (sum s[idx] + 1e-20) * routed_scaling_factor
    expert(x, w) = w2(w * silu(min(w1 x, L)) * clamp(w3 x, -L, L))   L = swiglu_limit (10), fp32
    y   = sum_routed + shared_expert(x)                        (V4.1 clamps the shared expert too)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashtier.engine.model.config import ModelConfig
from flashtier.engine.model.numerics import up


class Gate(nn.Module):
    def __init__(self, dim: int, n_experts: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.w1 = nn.Linear(dim, inter, bias=False, dtype=dtype)
        self.w2 = nn.Linear(inter, dim, bias=False, dtype=dtype)
        self.w3 = nn.Linear(dim, inter, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, limit: float) -> torch.Tensor:
        """x [N, D], weight [N] -> [N, D] fp32; the routing weight is applied before w2."""
        a = up(F.linear(x.to(self.w1.weight.dtype), self.w1.weight))
        b = up(F.linear(x.to(self.w3.weight.dtype), self.w3.weight))
        act = weight[:, None] * F.silu(a.clamp(max=limit)) * b.clamp(-limit, limit)
        return up(F.linear(act.to(self.w2.weight.dtype), self.w2.weight))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, n_experts: int, top_k: int, dtype: torch.dtype):
        super().__init__()
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.limit = top_k, cfg.swiglu_limit
        self.route_scale, self.gate_temp = cfg.routed_scaling_factor, cfg.gate_temp
        self.gate = Gate(d, n_experts, dtype)
        self.experts = nn.ModuleList(Expert(d, inter, dtype) for _ in range(n_experts))
        self.shared_experts = Expert(d, inter * cfg.n_shared_experts, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Selected experts [N, k] and their weights [N, k] (fp32)."""
        logits = F.linear(up(x), up(self.gate.weight)) / self.gate_temp
        s = torch.sqrt(F.softplus(logits))
        idx = torch.topk(s + up(self.gate.bias), self.top_k, dim=-1).indices
        w = torch.gather(s, 1, idx)
        return idx, w / (w.sum(-1, keepdim=True) + 1e-20) * self.route_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, D] fp32."""
        idx, w = self.route(x)
        y = torch.zeros_like(up(x))
        for e in torch.unique(idx).tolist():
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            y.index_add_(0, rows, self.experts[e](x[rows], w[rows, slot], self.limit))
        ones = torch.ones(x.shape[0], dtype=y.dtype, device=x.device)
        return y + self.shared_experts(x, ones, self.limit)
