"""Manifold-constrained hyper-connections (mHC): 4 residual streams, Sinkhorn-projected mixing.

Per sub-layer parameters ``fn [(2+hc)*hc, hc*D]``, ``base [(2+hc)*hc]``, ``scale [3]`` (model.md §3.2)::

    m     = (flat(x) @ fn^T) * rsqrt(mean(flat(x)^2) + eps)     one RMS statistic over all streams
    pre   = sigmoid(m[0:hc]   * s0 + b[0:hc]) + hc_eps          input collapse (used by the NEXT sub-layer)
    post  = 2 * sigmoid(m[hc:2hc] * s1 + b[hc:2hc])             how much of f each stream receives
    C     = Sinkhorn(softmax_row(m[2hc:] * s2 + b[2hc:]))       [hc, hc] stream mixing, row j = source

All math is fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flashtier.engine.model.numerics import linear_up, up
from flashtier.kernels.mhc.coeffs import mhc_coeffs
from flashtier.kernels.mhc.streams import hc_collapse, hc_expand
from flashtier.kernels.row_reduce.op import mean_square


@dataclass(frozen=True)
class HcMix:
    """The mixing coefficients one sub-layer produced for each token."""

    pre: torch.Tensor  # [T, hc]
    post: torch.Tensor  # [T, hc]
    comb: torch.Tensor  # [T, hc, hc]


def hc_mixes(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> HcMix:
    """Coefficients from the residual streams ``x`` [T, hc, D]."""
    t, hc, d = x.shape
    flat = up(x).reshape(t, hc * d)
    # m = (flat @ fn^T) * rsqrt(mean(flat^2) + eps): the factor is applied inside mhc_coeffs' launch
    pre, post, c = mhc_coeffs(linear_up(flat, fn), base, scale, hc=hc, hc_eps=hc_eps, iters=sinkhorn_iters,
                              ms=mean_square(flat), norm_eps=norm_eps)
    return HcMix(pre, post, c)


def hc_pre(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse the streams: sum_j pre[j] * x[j] -> [T, D] fp32."""
    return hc_collapse(x, pre)


def hc_post(f: torch.Tensor, x: torch.Tensor, mix: HcMix) -> torch.Tensor:
    """Residual update: y[k] = post[k] * f + sum_j C[j, k] * x[j] -> [T, hc, D] fp32."""
    return hc_expand(f, x, mix.post, mix.comb)


def identity_pre(
    t: int, hc: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The initial collapse: stream 0 only ([T, hc] one-hot)."""
    pre = torch.zeros(t, hc, dtype=dtype, device=device)
    pre[:, 0] = 1.0
    return pre
