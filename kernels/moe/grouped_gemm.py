"""MoE experts for a whole batch: routed experts (MXFP4) + shared expert (FP8) + weighted combine.

    y = moe_grouped_ffn(x, idx, route_w, experts, shared, limit=10.0)

Inputs: ``x [N, D]`` fp32 or bf16 (float64 runs the reference), ``idx [N, k]`` int32/int64 expert ids and
``route_w [N, k]`` their weights (``moe_route``), ``experts`` an :class:`MXFP4Experts` stack, ``shared``
an :class:`FP8Expert` or None (layouts: ``moe/weights.py``), ``limit`` the SwiGLU clamp (swiglu_limit).
Returns ``y [N, D]`` fp32 (float64 for float64 x). The math, and where the activations are quantised to
FP8 as in the official code: ``moe/grouped_gemm_reference.py``.

Expert parallelism: ``expert_ids`` (int tensor ``[E_local]``, distinct global ids) says that ``experts`` holds
only those experts, stacked in that order; ``idx`` keeps global ids. Pairs routed to experts not held
contribute nothing, and the held ones are summed in ascending global id, so the output is the full op's
sum restricted to those experts (the shared expert is added only when given: the caller decides which rank
runs it). The sum of the outputs over a partition of the experts equals the full op up to the order of
the fp32 additions (each pair's expert output itself is the same bits: it does not depend on other rows).

The Triton path (``impl="auto"`` on CUDA, or "triton") runs, with no host sync and no Python loop over
experts: ``fp8_qdq(x)`` (as bf16: exact) -> ``moe_align`` (pairs sorted by expert, padded to 16-row tiles)
-> one grouped w1+w3 launch (SwiGLU, routing weight, FP8 quantisation of the activation in its epilogue)
-> one grouped w2 launch writing each pair's row of ``[N*k, D]``; the shared expert runs as extra tiles of
both launches (FP8 weights, every token) -> a combine summing each token's rows in ascending expert id, then
the shared row. A program of a launch owns one expert's N tile over one K split and all of its token
tiles, so each weight byte is read once per launch whatever the batch; weights are read as stored (0.53
B/param for MXFP4) and decoded in registers (``moe/grouped_gemm_kernel.py``). Each launch's shape and K
splits come from a table keyed by the weight shape and the device (``moe/gemm_config.py``), never by the
batch. With ``split_k`` S > 1 each split writes fp32 partials and a small launch sums them in ascending split
order before the epilogue (``moe/splitk_reduce_kernel.py``). A token's output is then summed in a fixed
order: each pair's K splits ascending, then the pairs in ascending expert id, then the shared expert's row.

Tolerance against the reference (tests/kernels/test_moe_grouped_gemm.py): the GEMMs differ only in
summation order (exact products, fp32 sums), which can move an activation across an FP8 rounding boundary
now and then (one e4m3 step of that element). Batch invariance: a token's output bits depend neither on the
batch size nor on the other tokens (tiles of 16 rows, K steps and splits fixed per weight shape, no atomics).

Failure: shapes, dtypes, devices and ``limit`` are checked here (``ValueError`` naming the argument), and
``expert_ids`` (distinct and non-negative: checked when it is on the CPU; on CUDA that would need a host
sync, so a repeated id there gives wrong results). Expert ids out of range raise in the
reference; the Triton path (which cannot look without a host sync) drops such a pair. Nothing here mutates
its inputs.
"""

from __future__ import annotations

import math

import torch
import triton

from flashtier.kernels.moe.combine_kernel import SKIP, moe_combine_triton
from flashtier.kernels.moe.gemm_config import MoEFfnConfig, config_for
from flashtier.kernels.moe.grouped_gemm_kernel import TOKEN_TILE, MoEGemmConfig, launch_moe_gemm
from flashtier.kernels.quant.common import resolve_on_device
from flashtier.kernels.moe.align import moe_align
from flashtier.kernels.moe.grouped_gemm_reference import moe_grouped_ffn_reference
from flashtier.kernels.moe.weights import FP8Expert, MXFP4Experts, check_fp8_expert, check_mxfp4_experts
from flashtier.kernels.quant.fp8 import fp8_qdq

__all__ = ["FP8Expert", "MXFP4Experts", "MoEFfnConfig", "MoEGemmConfig", "ffn_config", "moe_grouped_ffn"]

_OP = "moe_grouped_ffn"


def _validate(x, idx, route_w, experts, shared, limit, expert_ids, impl) -> str:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float64):
        got = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{_OP}: x must be a 2-D float32/bfloat16/float64 tensor [N, D], got {got}")
    n, dim = x.shape
    if dim == 0 or dim % 32:
        raise ValueError(f"{_OP}: x must be [N, D] with D a positive multiple of 32, got {list(x.shape)}")
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 2 \
            or idx.shape[0] != n or not 1 <= idx.shape[1] <= 16:
        got = f"{idx.dtype} {list(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise ValueError(f"{_OP}: idx must be an int32/int64 tensor [{n}, k] with 1 <= k <= 16, got {got}")
    if not isinstance(route_w, torch.Tensor) or not route_w.is_floating_point() or route_w.shape != idx.shape:
        got = f"{route_w.dtype} {list(route_w.shape)}" if isinstance(route_w, torch.Tensor) else type(route_w).__name__
        raise ValueError(f"{_OP}: route_w must be a float tensor {list(idx.shape)} like idx, got {got}")
    check_mxfp4_experts(experts, dim, _OP)
    if shared is not None:
        check_fp8_expert(shared, dim, _OP)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit <= 0:
        raise ValueError(f"{_OP}: limit (swiglu_limit) must be a positive finite number, got {limit!r}")
    if expert_ids is not None:
        if not isinstance(expert_ids, torch.Tensor) or expert_ids.dtype not in (torch.int32, torch.int64) \
                or expert_ids.shape != (experts.n_experts,):
            got = f"{expert_ids.dtype} {list(expert_ids.shape)}" if isinstance(expert_ids, torch.Tensor) \
                else type(expert_ids).__name__
            raise ValueError(f"{_OP}: expert_ids must be an int32/int64 tensor [{experts.n_experts}] (one global id "
                             f"per stacked expert), got {got}")
        if expert_ids.device.type == "cpu" and (bool((expert_ids < 0).any())
                                                or torch.unique(expert_ids).numel() != expert_ids.numel()):
            raise ValueError(f"{_OP}: expert_ids must be distinct non-negative ids, got {expert_ids.tolist()}")
    tensors = {"idx": idx, "route_w": route_w, **{f"experts.{k}": v for k, v in experts._asdict().items()}}
    if expert_ids is not None:
        tensors["expert_ids"] = expert_ids
    if shared is not None:
        tensors.update({f"shared.{k}": v for k, v in shared._asdict().items()})
    return resolve_on_device(_OP, x, tensors, impl)


def ffn_config(experts: MXFP4Experts, device: torch.device) -> MoEFfnConfig:
    """The tuned launch configs for this stack's weight shapes on ``device`` (``moe/gemm_config.py``)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    w13, w2 = experts.w13_codes.shape, experts.w2_codes.shape
    return MoEFfnConfig(config_for(w13[1], w13[2] * 2, "mxfp4", name), config_for(w2[1], w2[2] * 2, "mxfp4", name))


def _local_ids(idx: torch.Tensor, expert_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids into the stack, -1 where not held; global ids for the combine's order, ``SKIP`` where not held)."""
    if expert_ids is None:
        return idx, idx.to(torch.int32)
    hit = idx.unsqueeze(-1) == expert_ids.to(idx.dtype).view(1, 1, -1)  # [N, k, E_local]
    held = hit.any(-1)
    local = (hit.to(torch.int32) * torch.arange(expert_ids.numel(), dtype=torch.int32, device=idx.device)).sum(-1)
    return torch.where(held, local, -1).to(torch.int32), torch.where(held, idx, SKIP).to(torch.int32)


def moe_grouped_ffn(
    x: torch.Tensor,
    idx: torch.Tensor,
    route_w: torch.Tensor,
    experts: MXFP4Experts,
    shared: FP8Expert | None = None,
    limit: float = 10.0,
    *,
    expert_ids: torch.Tensor | None = None,
    impl: str = "auto",
    config: MoEFfnConfig | None = None,
) -> torch.Tensor:
    """Routed + shared experts for ``x [N, D]`` (see the module docstring): ``y [N, D]``.

    ``expert_ids`` (None: the stack is experts 0 .. E-1): the global id of each stacked expert; only pairs
    routed to those contribute. ``config`` overrides the two launches' configs (tests and benchmarks); by
    default they come from the per-shape table (``ffn_config``), never from the batch.

    Example (one flash-16e layer on the GPU; an expert-parallel rank holding experts 4..7)::

        idx, w = moe_route(h, gate.weight, gate.bias, top_k=6, route_scale=1.5)
        y = moe_grouped_ffn(h, idx, w, layer_experts.routed(), layer_experts.shared(), limit=10.0)
        part = moe_grouped_ffn(h, idx, w, my_stack, None, 10.0, expert_ids=torch.arange(4, 8, device="cuda"))
    """
    impl = _validate(x, idx, route_w, experts, shared, limit, expert_ids, impl)
    if impl == "reference":
        return moe_grouped_ffn_reference(x, idx, route_w, experts, shared, float(limit), expert_ids)
    n, dim = x.shape
    k = idx.shape[1]
    cfg = config or ffn_config(experts, x.device)
    dev = x.device
    local, order = _local_ids(idx, expert_ids)
    xq = fp8_qdq(x.contiguous(), impl="triton").to(torch.bfloat16)  # the reference's bits (e4m3 * 2^s fits bf16)
    al = moe_align(local, experts.n_experts, TOKEN_TILE, impl="triton")
    n_tiles = al.block_expert.numel() + (triton.cdiv(n, TOKEN_TILE) if shared is not None else 0)
    i_r = experts.inter
    i_s = shared.inter if shared is not None else i_r
    routed = [t.contiguous() for t in experts]
    sw = [t.contiguous() for t in shared] if shared is not None else None
    common = dict(ids=al.sorted_ids, block_expert=al.block_expert, first_block=al.first_block, n_tok=n, top_k=k)
    act = torch.empty((n_tiles * TOKEN_TILE, max(i_r, i_s)), dtype=torch.bfloat16, device=dev)
    launch_moe_gemm(xq, act, (routed[0], routed[1]), sw and (sw[0], sw[1]), gated=True, k_r=dim, k_s=dim, n_r=i_r,
                    n_s=i_s, route_w=route_w.float().contiguous().view(-1), limit=limit, config=cfg.w13, **common)
    out = torch.empty((n * k + (n if shared is not None else 0), dim), dtype=torch.float32, device=dev)
    launch_moe_gemm(act, out, (routed[2], routed[3]), sw and (sw[2], sw[3]), gated=False, k_r=i_r, k_s=i_s,
                    n_r=dim, n_s=dim, config=cfg.w2, **common)
    out_shared = out[n * k :] if shared is not None else None
    return moe_combine_triton(out[: n * k], order.contiguous(), out_shared)
