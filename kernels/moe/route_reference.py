"""MoE routing in plain torch: the spec of ``moe_route`` (model.md §3.6; official V4.1 ``Gate.forward``).

    logit = x . Wg[e] / gate_temp                                   evaluated in float64
    s     = sqrt(fp32(softplus(logit)))                             the score, fp32 (float64 in float64 mode)
    idx   = the top_k experts by s + bias, ties to the LOWER index   the bias only selects
    w     = s[idx] / (s[idx_0] + s[idx_1] + ... + 1e-20) * route_scale     (no normalisation when top_k == 1)

What the official code leaves open, and the choice made here:
- The official gate computes ``F.softplus(x.float() @ Wg.float().T).sqrt()`` in fp32, whose last bit depends
  on the device's GEMM order and its softplus. Here the logit and the softplus are evaluated in float64 and
  rounded to fp32 once before a correctly rounded fp32 sqrt. Any two implementations of that agree
  unless the float64 softplus falls within a few float64 ulps of an fp32 rounding boundary (about 2^-27 per
  score), which is what lets the Triton kernel equal this function bit for bit.
- Ties in ``torch.topk`` are unspecified; here equal biased scores go to the lower expert index, in
  descending score order (DeepSeek's TileKernels ``topk_gate`` rule).
- The normalising sum adds the selected scores in selection order, then 1e-20 (the official code's
  constant, the training value, not norm_eps); the official code skips the normalisation when top_k == 1.
- V4.1 has no hash-routed layers (the official V4.1 ``Gate`` has no ``tid2eid``; V4 used it for layers < 3)
  and the engine is text-only, so ``bias_vl`` (image tokens) is not used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SOFTPLUS_THRESHOLD = 20.0  # torch's F.softplus: above it softplus(l) = l (log1p(exp(l)) would overflow)
NORM_EPS = 1e-20


def softplus_f64(logits: torch.Tensor) -> torch.Tensor:
    """softplus of float64 ``logits``: l above the threshold, else log1p(exp(l))."""
    return torch.where(logits > SOFTPLUS_THRESHOLD, logits, torch.log1p(torch.exp(logits)))


def gate_scores_reference(x: torch.Tensor, gate_weight: torch.Tensor, gate_temp: float = 1.0) -> torch.Tensor:
    """Scores ``s [N, E]``: fp32, or float64 when ``x`` is float64 (the oracle's mode)."""
    logits = F.linear(x.double(), gate_weight.double()) / gate_temp
    if x.dtype == torch.float64:
        return torch.sqrt(softplus_f64(logits))
    # torch's vectorised CPU sqrt is not correctly rounded (fp32 or float64); the float64 sqrt of an fp32
    # value is close enough that rounding it to fp32 gives the correctly rounded fp32 sqrt every time.
    return torch.sqrt(softplus_f64(logits).float().double()).float()


def select_experts_reference(
    scores: torch.Tensor, bias: torch.Tensor, top_k: int, route_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx int32 [N, top_k], weights [N, top_k])`` from scores ``[N, E]`` (see the module docstring)."""
    biased = scores + bias.to(scores.dtype)
    # A stable descending sort keeps equal keys in index order: ties go to the lower expert.
    idx = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = torch.gather(scores, 1, idx)
    if top_k > 1:
        total = w[:, 0]
        for j in range(1, top_k):  # selection order, one rounding per add
            total = total + w[:, j]
        w = w / (total + NORM_EPS)[:, None]
    return idx.to(torch.int32), w * route_scale


def moe_route_reference(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    route_scale: float,
    gate_temp: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens ``x [N, D]`` with gate ``Wg [E, D]`` and ``bias [E]``: ``(idx int32, weights)`` ``[N, top_k]``."""
    return select_experts_reference(gate_scores_reference(x, gate_weight, gate_temp), bias, top_k, route_scale)
