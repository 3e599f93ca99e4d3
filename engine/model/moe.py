"""Mixture of experts: sqrt-softplus gate with a selection-only bias, top-k routed + shared expert.

    s   = sqrt(softplus(x @ Wg^T / gate_temp))                 fp32 [E] (logit and softplus in float64)
    idx = topk(s + bias, k)                                    the bias only selects; ties to the lower expert
    w   = s[idx] / (sum s[idx] + 1e-20) * routed_scaling_factor
    xq  = fp8_qdq(x)                                           e4m3, one ue8m0 scale per 32 (official linear())
    expert(xq, w) = w2(fp8_qdq(w * (silu(min(w1 xq, L)) * clamp(w3 xq, -L, L))))   L = swiglu_limit, fp32
    y   = sum of the routed experts in ascending id + shared_expert(xq)   (V4.1 clamps the shared expert too)

The spec of each piece, with what it settles that the official code leaves open, lives beside its kernel:
routing in ``kernels/moe/route_reference.py``, the experts and the two FP8 activation quantisations (where the
official ``linear()`` runs ``act_quant`` before ``fp4_gemm`` / ``fp8_gemm``) in
``kernels/moe/grouped_gemm_reference.py``. Two paths run it:

- float experts (``nn.Linear`` per expert: what the checkpoint loader builds, the CPU engine and the
  float64 oracle run): the reference, plain torch, a Python loop over the chosen experts;
- ``ExpertWeights`` (after ``moe_convert.convert_experts_``): routing and experts through the kernels,
  Triton on CUDA (no host sync, one grouped launch per projection), their reference elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from flashtier.engine.model.config import ModelConfig
from flashtier.engine.model.expert_weights import ExpertWeights
from flashtier.kernels.moe.grouped_gemm import moe_grouped_ffn
from flashtier.kernels.moe.grouped_gemm_reference import DenseExpert, moe_ffn_reference
from flashtier.kernels.moe.route import moe_route


class Gate(nn.Module):
    def __init__(self, dim: int, n_experts: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))


class Expert(nn.Module):
    """One SwiGLU expert's float weights (checkpoint names ``w1`` gate, ``w3`` up, ``w2`` down)."""

    def __init__(self, dim: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.w1 = nn.Linear(dim, inter, bias=False, dtype=dtype)
        self.w2 = nn.Linear(inter, dim, bias=False, dtype=dtype)
        self.w3 = nn.Linear(dim, inter, bias=False, dtype=dtype)

    def weights(self) -> DenseExpert:
        return self.w1.weight, self.w3.weight, self.w2.weight


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, n_experts: int, top_k: int, dtype: torch.dtype):
        super().__init__()
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.limit = top_k, cfg.swiglu_limit
        self.route_scale, self.gate_temp = cfg.routed_scaling_factor, cfg.gate_temp
        self.gate = Gate(d, n_experts, dtype)
        # nn.ModuleList of Expert, or ExpertWeights once converted (then shared_experts is None: it lives there)
        self.experts: nn.Module = nn.ModuleList(Expert(d, inter, dtype) for _ in range(n_experts))
        self.shared_experts: Expert | None = Expert(d, inter * cfg.n_shared_experts, dtype)

    @property
    def converted(self) -> bool:
        """True once the experts are an ``ExpertWeights`` (the device path)."""
        return isinstance(self.experts, ExpertWeights)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Selected experts ``[N, k]`` int32 and their weights ``[N, k]`` (fp32; float64 in float64 mode)."""
        impl = self.experts.impl if self.converted else "reference"
        return moe_route(x, self.gate.weight, self.gate.bias, self.top_k, self.route_scale, self.gate_temp, impl=impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, D] fp32 (float64 in float64 mode). Reads the weights only."""
        idx, w = self.route(x)
        if self.converted:
            ew = self.experts
            return moe_grouped_ffn(x, idx, w, ew.routed(), ew.shared(), self.limit, impl=ew.impl)
        # The spec, on float weights. Like the official inference/model.py it quantises to FP8 (e4m3, ue8m0
        # per 32) the input of w1 / w3 and the weighted SwiGLU output before w2: its linear() runs act_quant
        # before every fp4_gemm (routed experts) and fp8_gemm (shared expert).
        experts, shared = self.experts, self.shared_experts
        return moe_ffn_reference(x, idx, w, lambda e: experts[e].weights(), shared.weights(), self.limit)
