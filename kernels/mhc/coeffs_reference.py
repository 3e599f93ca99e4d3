"""Reference for the mHC coefficients of one sub-layer (model.md §3.2), from the projected mixes ``m``.

    m     [T, (2 + hc) * hc]  = (flat(x) @ fn^T) * rsqrt(mean(flat(x)^2) + eps)    (computed by the caller)
    pre   = sigmoid(m[:, 0:hc] * s0 + b[0:hc]) + hc_eps
    post  = 2 * sigmoid(m[:, hc:2hc] * s1 + b[hc:2hc])
    C     = softmax_row(m[:, 2hc:] * s2 + b[2hc:]) + hc_eps, then column-normalised, then
            (iters - 1) x (row-normalise, column-normalise), each with + hc_eps in the denominator

All fp32 (float64 in the exactness mode: the op keeps the dtype of ``m``).
"""

from __future__ import annotations

import torch


def mhc_coeffs_reference(
    m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, hc_eps: float, iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, hc], post [T, hc], comb [T, hc, hc]) in m's dtype."""
    t = m.shape[0]
    b, s = base.to(m.dtype), scale.to(m.dtype)
    pre = torch.sigmoid(m[:, :hc] * s[0] + b[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[:, hc : 2 * hc] * s[1] + b[hc : 2 * hc])
    c = torch.softmax((m[:, 2 * hc :] * s[2] + b[2 * hc :]).view(t, hc, hc), dim=-1) + hc_eps
    c = c / (c.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + hc_eps)
        c = c / (c.sum(-2, keepdim=True) + hc_eps)
    return pre, post, c
