"""Triton kernel for the mHC coefficients: sigmoids, row softmax and the whole Sinkhorn loop in one launch.

One program handles BLOCK_T tokens; each token's [hc, hc] matrix stays in registers for every iteration
(the plain-torch form launches ~4 kernels per Sinkhorn iteration). Same op order as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mhc_coeffs_kernel(
    m_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, stride_m, hc_eps, ms_ptr, norm_eps,
    ITERS: tl.constexpr, HC: tl.constexpr, BLOCK_T: tl.constexpr, HAS_MS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    j = tl.arange(0, HC)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    mrow = m_ptr + rows[:, None] * stride_m
    vmask = rmask[:, None]
    if HAS_MS:  # the projection's RMS factor, applied to m as it is read: m * rsqrt(ms + eps)
        r = 1.0 / tl.sqrt_rn(tl.load(ms_ptr + rows, mask=rmask, other=1.0) + norm_eps)
    else:
        r = tl.full((BLOCK_T,), 1.0, tl.float32)
    a = (tl.load(mrow + j[None, :], mask=vmask, other=0.0) * r[:, None]) * s0 + tl.load(base_ptr + j)[None, :]
    pre = 1.0 / (1.0 + tl.exp(-a)) + hc_eps
    p = (tl.load(mrow + HC + j[None, :], mask=vmask, other=0.0) * r[:, None]) * s1 + tl.load(base_ptr + HC + j)[None, :]
    post = 2.0 / (1.0 + tl.exp(-p))
    out = rows[:, None] * HC + j[None, :]
    tl.store(pre_ptr + out, pre, mask=vmask)
    tl.store(post_ptr + out, post, mask=vmask)
    # comb [BLOCK_T, HC(row j), HC(col k)]
    jk = j[:, None] * HC + j[None, :]
    cmask = rmask[:, None, None]
    z = (tl.load(mrow[:, :, None] + 2 * HC + jk[None, :, :], mask=cmask, other=0.0) * r[:, None, None]) * s2
    z = z + tl.load(base_ptr + 2 * HC + jk)[None, :, :]
    z = z - tl.max(z, axis=2)[:, :, None]
    e = tl.exp(z)
    c = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    tl.store(comb_ptr + rows[:, None, None] * (HC * HC) + jk[None, :, :], c, mask=cmask)


def mhc_coeffs_triton(m, base, scale, hc: int, hc_eps: float, iters: int, block_t: int = 32, ms=None,
                      norm_eps: float = 0.0):
    t = m.shape[0]
    pre = torch.empty((t, hc), dtype=torch.float32, device=m.device)
    post = torch.empty_like(pre)
    comb = torch.empty((t, hc, hc), dtype=torch.float32, device=m.device)
    if t:
        _mhc_coeffs_kernel[(triton.cdiv(t, block_t),)](
            m, base, scale, pre, post, comb, t, m.stride(0), float(hc_eps), m if ms is None else ms, float(norm_eps),
            ITERS=iters, HC=hc, BLOCK_T=block_t, HAS_MS=ms is not None,
        )
    return pre, post, comb
