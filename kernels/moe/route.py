"""MoE routing for a whole batch: sqrt-softplus gate, selection-only bias, top-k, normalised weights.

    idx, weights = moe_route(x, gate_weight, bias, top_k=6, route_scale=1.5)

Inputs: ``x [N, D]`` (fp32 or bf16; float64 runs the reference), ``gate_weight [E, D]`` (fp32/bf16/fp64),
``bias [E]`` fp32 (float64 in the oracle's mode). Returns ``idx int32 [N, top_k]`` (descending biased
score, ties to the lower expert) and ``weights [N, top_k]`` (fp32; float64 for float64 x). The math, and
what it settles that the official code leaves open (float64 logits and softplus, the tie rule, the
normalising sum's order): ``moe/route_reference.py``.

``impl="auto"`` runs the Triton kernels (``moe/route_kernel.py``) on CUDA tensors and the reference
otherwise; "reference" / "triton" force one (Triton on CPU needs TRITON_INTERPRET=1). Both give the same
bits: ``tests/kernels/test_moe_route.py``. The Triton path never synchronises with the host.

Failure: shapes, dtypes, devices and the scalars are checked here (``ValueError`` naming the argument);
nothing here mutates its inputs.
"""

from __future__ import annotations

import math

import torch

from flashtier.kernels.moe.route_kernel import moe_route_triton
from flashtier.kernels.quant.common import resolve_on_device
from flashtier.kernels.moe.route_reference import moe_route_reference

__all__ = ["moe_route", "moe_route_reference"]

_OP = "moe_route"
MAX_EXPERTS = 1024  # one select program holds a token's E scores in registers
MAX_TOP_K = 16
_FLOATS = (torch.float32, torch.bfloat16, torch.float64)


def _positive(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{_OP}: {name} must be a positive finite number, got {value!r}")
    return float(value)


def _validate(x, gate_weight, bias, top_k, route_scale, gate_temp, impl) -> str:
    for name, t in (("x", x), ("gate_weight", gate_weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in _FLOATS:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{_OP}: {name} must be a 2-D float32/bfloat16/float64 tensor, got {got}")
    n_exp, dim = gate_weight.shape
    if x.shape[1] != dim or dim == 0:
        raise ValueError(
            f"{_OP}: x must be [N, {dim}] to match gate_weight {list(gate_weight.shape)}, got {list(x.shape)}"
        )
    if not 1 <= n_exp <= MAX_EXPERTS:
        raise ValueError(f"{_OP}: gate_weight must have 1..{MAX_EXPERTS} rows (experts), got {n_exp}")
    if not isinstance(bias, torch.Tensor) or bias.dtype not in (torch.float32, torch.float64) \
            or tuple(bias.shape) != (n_exp,):
        got = f"{bias.dtype} {list(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"{_OP}: bias must be a float32 (or float64) tensor [{n_exp}], got {got}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(n_exp, MAX_TOP_K):
        raise ValueError(f"{_OP}: top_k must be an int in [1, {min(n_exp, MAX_TOP_K)}], got {top_k!r}")
    _positive(route_scale, "route_scale")
    _positive(gate_temp, "gate_temp")
    return resolve_on_device(_OP, x, {"gate_weight": gate_weight, "bias": bias}, impl)


def moe_route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    route_scale: float,
    gate_temp: float = 1.0,
    *,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route ``x [N, D]``: ``(idx int32 [N, top_k], weights [N, top_k])``. See the module docstring.

    Example (one V4.1 layer: 384 experts, top-6, scaled by 1.5)::

        idx, w = moe_route(h, moe.gate.weight, moe.gate.bias, top_k=6, route_scale=1.5)
    """
    impl = _validate(x, gate_weight, bias, top_k, route_scale, gate_temp, impl)
    if impl == "reference":
        return moe_route_reference(x, gate_weight, bias, top_k, float(route_scale), float(gate_temp))
    x = x if x.stride(1) == 1 else x.contiguous()
    gate_weight = gate_weight if gate_weight.stride(1) == 1 else gate_weight.contiguous()
    return moe_route_triton(x, gate_weight, bias.float().contiguous(), top_k, route_scale, gate_temp)
