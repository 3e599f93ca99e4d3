"""MoE experts for a whole batch: routed experts (MXFP4) + shared expert (FP8) + weighted combine.

    y = moe_grouped_ffn(x, idx, route_w, experts, shared, limit=10.0)

Inputs: ``x [N, D]`` fp32 or bf16 (float64 runs the reference), ``idx [N, k]`` int32/int64 expert ids and
``route_w [N, k]`` their weights (``moe_route``), ``experts`` an :class:`MXFP4Experts` stack, ``shared``
an :class:`FP8Expert` or None (layouts: ``moe/weights.py``), ``limit`` the SwiGLU clamp (swiglu_limit).
Returns ``y [N, D]`` fp32 (float64 for float64 x). The math, and where the activations are quantised to
FP8 as in the official code: ``moe/grouped_gemm_reference.py``.

The Triton path (``impl="auto"`` on CUDA, or "triton") runs, with no host sync and no Python loop over
experts: ``fp8_qdq(x)`` -> ``moe_align`` (pairs sorted by expert, padded to 16-row tiles) -> one grouped
w1+w3 launch (SwiGLU, routing weight, FP8 quantisation of the activation in its epilogue) -> one grouped w2
launch writing each pair's row of ``[N*k, D]``; the shared expert runs as extra tiles of both launches
(FP8 weights, every token) -> a combine summing each token's rows in ascending expert id, then the shared
row. Weights are read as stored (0.53 B/param for MXFP4) and decoded in registers
(``moe/grouped_gemm_kernel.py``). With ``config.split_k`` > 1 each projection's K is split across programs
and a second small launch sums the fp32 partials in ascending split order before the epilogue
(``moe/splitk_reduce_kernel.py``): more programs at decode sizes, the same result up to the order of the
fp32 sums. A token's output is then summed in a fixed order: each pair's K splits ascending, then the
pairs in ascending expert id, then the shared expert's row.

Tolerance against the reference (tests/kernels/test_moe_grouped_gemm.py): the GEMMs differ only in
summation order (exact products, fp32 sums), which can move an activation across an FP8 rounding boundary
now and then (one e4m3 step of that element). Same-batch-size independence: a token's output bits do not
depend on the other tokens of its batch (fixed tiles and K splits, no atomics).

Failure: shapes, dtypes, devices and ``limit`` are checked here (``ValueError`` naming the argument). Expert
ids out of range raise in the reference; the Triton path (which cannot look without a host sync) drops
such a pair. Nothing here mutates its inputs.
"""

from __future__ import annotations

import math

import torch
import triton

from flashtier.kernels.moe.combine_kernel import moe_combine_triton
from flashtier.kernels.moe.grouped_gemm_kernel import DEFAULT_CONFIG, MoEGemmConfig, default_config, launch_moe_gemm
from flashtier.kernels.quant.common import resolve_on_device
from flashtier.kernels.moe.align import moe_align
from flashtier.kernels.moe.grouped_gemm_reference import moe_grouped_ffn_reference
from flashtier.kernels.moe.weights import FP8Expert, MXFP4Experts, check_fp8_expert, check_mxfp4_experts
from flashtier.kernels.quant.fp8 import fp8_qdq

__all__ = ["DEFAULT_CONFIG", "FP8Expert", "MXFP4Experts", "MoEGemmConfig", "moe_grouped_ffn"]

_OP = "moe_grouped_ffn"


def _validate(x, idx, route_w, experts, shared, limit, impl) -> str:
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
    tensors = {"idx": idx, "route_w": route_w, **{f"experts.{k}": v for k, v in experts._asdict().items()}}
    if shared is not None:
        tensors.update({f"shared.{k}": v for k, v in shared._asdict().items()})
    return resolve_on_device(_OP, x, tensors, impl)


def moe_grouped_ffn(
    x: torch.Tensor,
    idx: torch.Tensor,
    route_w: torch.Tensor,
    experts: MXFP4Experts,
    shared: FP8Expert | None = None,
    limit: float = 10.0,
    *,
    impl: str = "auto",
    config: MoEGemmConfig | None = None,
) -> torch.Tensor:
    """Routed + shared experts for ``x [N, D]`` (see the module docstring): ``y [N, D]``.

    ``config`` overrides the Triton launch shape and K splits (tests and benchmarks); by default the M tile
    follows the batch (``default_config``), the K order never does.

    Example (one flash-16e layer on the GPU)::

        idx, w = moe_route(h, gate.weight, gate.bias, top_k=6, route_scale=1.5)
        y = moe_grouped_ffn(h, idx, w, layer_experts.routed(), layer_experts.shared(), limit=10.0)
    """
    impl = _validate(x, idx, route_w, experts, shared, limit, impl)
    if impl == "reference":
        return moe_grouped_ffn_reference(x, idx, route_w, experts, shared, float(limit))
    n, dim = x.shape
    k = idx.shape[1]
    cfg = config or default_config(n, k, experts.n_experts)
    dev = x.device
    xq = fp8_qdq(x.contiguous(), impl="triton")  # fp32, the same bits as the reference's
    al = moe_align(idx, experts.n_experts, cfg.block_m, impl="triton")
    n_tiles = al.block_expert.numel() + (triton.cdiv(n, cfg.block_m) if shared is not None else 0)
    i_r = experts.inter
    i_s = shared.inter if shared is not None else i_r
    routed = [t.contiguous() for t in experts]
    sw = [t.contiguous() for t in shared] if shared is not None else None
    common = dict(ids=al.sorted_ids, block_expert=al.block_expert, n_tok=n, top_k=k, config=cfg)
    act = torch.empty((n_tiles * cfg.block_m, max(i_r, i_s)), dtype=torch.bfloat16, device=dev)
    launch_moe_gemm(xq, act, (routed[0], routed[1]), sw and (sw[0], sw[1]), gated=True, k_r=dim, k_s=dim, n_r=i_r,
                    n_s=i_s, route_w=route_w.float().contiguous().view(-1), limit=limit, **common)
    out = torch.empty((n * k + (n if shared is not None else 0), dim), dtype=torch.float32, device=dev)
    launch_moe_gemm(act, out, (routed[2], routed[3]), sw and (sw[2], sw[3]), gated=False, k_r=i_r, k_s=i_s,
                    n_r=dim, n_s=dim, **common)
    out_shared = out[n * k :] if shared is not None else None
    return moe_combine_triton(out[: n * k], idx.to(torch.int32).contiguous(), out_shared)
