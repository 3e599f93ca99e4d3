"""mHC coefficients of one sub-layer for every token in one launch (math: ``mhc/coeffs_reference.py``).

    m [T, (2 + hc) * hc] fp32 (or fp64: reference only), base [(2 + hc) * hc], scale [3]
    -> pre [T, hc], post [T, hc], comb [T, hc, hc]

Dispatch: ``impl="auto"`` runs Triton on CUDA fp32 inputs and the reference otherwise; "reference" / "triton"
force one (Triton on the CPU needs TRITON_INTERPRET=1). The two agree to a few fp32 ulps (exp and the
division are the only differences; the op order is the same). Failure: bad shapes, dtypes or hc raise
``ValueError`` naming the argument.
"""

from __future__ import annotations

import torch

from flashtier.kernels.mhc.coeffs_kernel import mhc_coeffs_triton
from flashtier.kernels.quant.common import resolve_impl
from flashtier.kernels.mhc.coeffs_reference import mhc_coeffs_reference

_OP = "mhc_coeffs"


def mhc_coeffs(
    m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc: int, hc_eps: float, iters: int,
    ms: torch.Tensor | None = None, norm_eps: float = 0.0, impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre, post, comb) from the mixes ``m`` — or, with ``ms`` [T] (the mean squares of the streams), from
    ``m * rsqrt(ms + norm_eps)``, the RMS factor applied inside the launch (the caller's three elementwise
    launches per sub-layer saved)."""
    if hc < 1 or hc & (hc - 1):
        raise ValueError(f"{_OP}: hc must be a power of two, got {hc}")
    n = (2 + hc) * hc
    if not isinstance(m, torch.Tensor) or m.dim() != 2 or m.shape[1] != n:
        raise ValueError(f"{_OP}: m must be [T, {n}], got {getattr(m, 'shape', type(m).__name__)}")
    if base.shape != (n,) or scale.shape != (3,):
        raise ValueError(f"{_OP}: base must be [{n}] and scale [3], got {tuple(base.shape)} and {tuple(scale.shape)}")
    if ms is not None and (not isinstance(ms, torch.Tensor) or tuple(ms.shape) != (m.shape[0],) or ms.dtype != m.dtype):
        raise ValueError(f"{_OP}: ms must be [{m.shape[0]}] in m's dtype, got {getattr(ms, 'shape', ms)}")
    if iters < 1:
        raise ValueError(f"{_OP}: iters must be >= 1, got {iters}")
    if impl == "auto" and m.dtype != torch.float32:
        impl = "reference"
    impl = resolve_impl(impl, m, _OP)
    if impl == "reference":
        if ms is not None:
            m = m * torch.rsqrt(ms[:, None] + norm_eps)
        return mhc_coeffs_reference(m, base, scale, hc, hc_eps, iters)
    if m.dtype != torch.float32 or m.stride(1) != 1:
        raise ValueError(f"{_OP}: the Triton path takes fp32 m dense in its last axis, got {m.dtype} {m.stride()}")
    return mhc_coeffs_triton(m, base.float().contiguous(), scale.float().contiguous(), hc, hc_eps, iters,
                             ms=None if ms is None else ms.contiguous(), norm_eps=norm_eps)
