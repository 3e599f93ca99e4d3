"""The MoE expert computation in plain torch: the spec of ``moe_grouped_ffn`` and the engine's CPU path.

    xq  = fp8_qdq(x)                                                  once, for every expert (see below)
    expert(xq, r) = fp8_qdq(r * (silu(min(xq W1^T, L)) * clamp(xq W3^T, -L, L))) W2^T      fp32 math
    y   = ((0 + expert_e1) + expert_e2) + ...  over the token's experts in ascending id, then + shared(xq, 1)

Activation quantisation, where the official V4.1 code does it (inference/model.py): every quantised
weight goes through the module-level ``linear()``, which quantises its input with ``act_quant`` (blocks
of ``fp8_block_size`` = 32, ue8m0 scales) before ``fp4_gemm`` (routed experts, MXFP4) or ``fp8_gemm``
(shared expert, FP8). So the expert input x is quantised for w1 and w3 (the same values for every expert
and the shared expert), and in ``Expert.forward`` the SwiGLU output is multiplied by the routing weights
and only then handed to w2, whose ``linear()`` quantises it. The rule is e4m3 with one ue8m0 scale per
32 along K (``quant_fp8.fp8_qdq``). The official code also rounds each GEMM output and the activation to bf16;
the engine keeps fp32 between ops (engine/model/numerics.py), and so does this spec.

Float64 inputs (the engine's oracle mode) run the same math in float64; the FP8 rounding then rounds
the value to fp32 first, as ``engine.model.numerics.qdq`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from flashtier.kernels.quant.fp8_weight import dequantize_fp8_weight
from flashtier.kernels.moe.weights import FP8Expert, MXFP4Experts
from flashtier.kernels.quant.fp8 import fp8_qdq
from flashtier.kernels.quant.mxfp4 import dequantize_mxfp4

DenseExpert = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (w1 [I, D], w3 [I, D], w2 [D, I])


def _up(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def act_qdq(x: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 / ue8m0-per-32 quantise-dequantise along the last axis, in x's precision (fp32 or float64)."""
    if x.dtype == torch.float64:
        return fp8_qdq(x.float(), impl="reference").double()
    return fp8_qdq(x, impl="reference")


def gated_act(xq: torch.Tensor, w: DenseExpert, route_w: torch.Tensor | None, limit: float) -> torch.Tensor:
    """``r * (silu(min(xq W1^T, L)) * clamp(xq W3^T, -L, L))`` on rows ``xq [n, D]``: ``[n, I]`` in fp32 (float64
    for float64 xq), before its FP8 rounding. ``route_w [n]`` is r (None: the shared expert, r = 1)."""
    w1, w3, _ = w
    a = _up(F.linear(xq.to(w1.dtype), w1))
    b = _up(F.linear(xq.to(w3.dtype), w3))
    act = F.silu(a.clamp(max=limit)) * b.clamp(-limit, limit)
    if route_w is not None:
        act = route_w[:, None].to(act.dtype) * act
    return act


def down_proj(act_q: torch.Tensor, w: DenseExpert) -> torch.Tensor:
    """``act_q W2^T`` for an already FP8-rounded activation: ``[n, D]`` in fp32 (float64 for float64 act_q)."""
    w2 = w[2]
    return _up(F.linear(act_q.to(w2.dtype), w2))


def expert_ffn_reference(
    xq: torch.Tensor, w: DenseExpert, route_w: torch.Tensor | None, limit: float
) -> torch.Tensor:
    """One expert on rows ``xq [n, D]`` (already quantised): ``[n, D]`` in fp32 (float64 for float64 xq).

    ``route_w [n]`` multiplies the activation before its quantisation (None: the shared expert).
    """
    return down_proj(act_qdq(gated_act(xq, w, route_w, limit)), w)


def moe_ffn_reference(
    x: torch.Tensor,
    idx: torch.Tensor,
    route_w: torch.Tensor,
    expert_weights: Callable[[int], DenseExpert],
    shared: DenseExpert | None,
    limit: float,
) -> torch.Tensor:
    """Routed experts plus the shared expert for ``x [N, D]``: ``y [N, D]`` (fp32, float64 for float64 x).

    ``expert_weights(e)`` gives expert e's dense weights; only the experts in ``idx`` are asked for. A negative
    id is a pair routed to an expert held elsewhere (expert parallelism): it contributes nothing. The loop
    reads the chosen experts back to the host: this is the spec, not a device path.

    Each pair is :func:`expert_ffn_reference` of its expert, summed into its token's row in ascending expert
    id. Only the GEMMs run per expert: the pairs are gathered in (expert, token) order once, and the SwiGLU,
    the routing weight and the FP8 rounding run once over all of them (elementwise, or on each row's own
    32-element blocks, so every pair gets the bits its own call would), as does the scatter-add (in pair
    order: each token's experts still add in ascending id). The CPU engine pays its ~20 small ops per layer,
    not per expert.
    """
    xq = act_qdq(_up(x))
    y = torch.zeros_like(xq)
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)  # (expert, token) order; a token holds an expert at most once
    order = order[flat[order] >= 0]
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    rows, slots = order // idx.shape[1], order % idx.shape[1]
    weights = [expert_weights(e) for e in experts.tolist()]
    inputs = list(xq[rows].split(counts.tolist()))
    if shared is not None:
        weights.append(shared)
        inputs.append(xq)
    if not weights:
        return y
    a = torch.cat([_up(F.linear(xe.to(w[0].dtype), w[0])) for xe, w in zip(inputs, weights)])
    b = torch.cat([_up(F.linear(xe.to(w[1].dtype), w[1])) for xe, w in zip(inputs, weights)])
    act = F.silu(a.clamp(max=limit)) * b.clamp(-limit, limit)
    n_pairs = rows.numel()
    act = torch.cat((route_w[rows, slots][:, None].to(act.dtype) * act[:n_pairs], act[n_pairs:]))
    outs = [down_proj(a_q, w) for a_q, w in zip(act_qdq(act).split([t.shape[0] for t in inputs]), weights)]
    if n_pairs:
        y.index_add_(0, rows, torch.cat(outs[: len(experts)]))
    if shared is not None:
        y = y + outs[-1]
    return y


def dense_mxfp4_expert(w: MXFP4Experts, e: int) -> DenseExpert:
    """Expert ``e`` of a stack, decoded to fp32 ``(w1, w3, w2)`` (exact: MXFP4 values are fp32 numbers)."""
    i = w.inter
    w13 = dequantize_mxfp4(w.w13_codes[e], w.w13_scales[e], impl="reference")
    return w13[:i], w13[i:], dequantize_mxfp4(w.w2_codes[e], w.w2_scales[e], impl="reference")


def dense_fp8_expert(w: FP8Expert) -> DenseExpert:
    """The shared expert decoded to fp32 ``(w1, w3, w2)`` (exact)."""
    i = w.inter
    w13 = dequantize_fp8_weight(w.w13_codes, w.w13_scales, impl="reference")
    return w13[:i], w13[i:], dequantize_fp8_weight(w.w2_codes, w.w2_scales, impl="reference")


def moe_grouped_ffn_reference(
    x: torch.Tensor,
    idx: torch.Tensor,
    route_w: torch.Tensor,
    experts: MXFP4Experts,
    shared: FP8Expert | None,
    limit: float,
    expert_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`moe_ffn_reference` over the stored formats (each chosen expert decoded when it is needed).

    ``expert_ids``: the global ids of the stack's experts (None: 0 .. E-1); pairs routed to other experts
    contribute nothing, and the held ones are still summed in ascending global id.
    """
    def as_x(w: DenseExpert) -> DenseExpert:  # float64 x (the oracle mode): the exact weights in float64
        return tuple(t.to(torch.float64) for t in w) if x.dtype == torch.float64 else w

    dense_shared = None if shared is None else as_x(dense_fp8_expert(shared))
    if expert_ids is None:
        return moe_ffn_reference(x, idx, route_w, lambda e: as_x(dense_mxfp4_expert(experts, e)), dense_shared, limit)
    local = {g: j for j, g in enumerate(expert_ids.tolist())}
    held = torch.tensor(sorted(local), dtype=idx.dtype, device=idx.device)
    idx = torch.where(torch.isin(idx, held), idx, torch.full_like(idx, -1))
    return moe_ffn_reference(x, idx, route_w, lambda e: as_x(dense_mxfp4_expert(experts, local[e])), dense_shared,
                             limit)


def combine_reference(out: torch.Tensor, idx: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """``y[t] = ((0 + out[t, j1]) + out[t, j2]) + ... (+ shared[t])`` with slots j in ascending expert id.

    ``out [N, k, D]`` per-pair expert outputs: the device path's combine, in the reference's summation order.
    """
    order = torch.sort(idx.long(), dim=1, stable=True).indices
    y = torch.zeros_like(out[:, 0])
    for j in range(idx.shape[1]):
        y = y + torch.gather(out, 1, order[:, j, None, None].expand(-1, 1, out.shape[2]))[:, 0]
    return y if shared is None else y + shared


__all__: Sequence[str] = (
    "act_qdq", "combine_reference", "dense_fp8_expert", "dense_mxfp4_expert", "down_proj", "expert_ffn_reference",
    "gated_act", "moe_ffn_reference", "moe_grouped_ffn_reference",
)
