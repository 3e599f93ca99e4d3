"""Triton MoE routing: gate logits in float64, then scores, top-k and weights, all on the device, no host sync.

Two launches (the spec is ``moe/route_reference.py``):

1. ``_gate_partial_kernel``, grid (token tiles, expert tiles, D chunks): float64 partial dot products of
   each token with each gate row over one CHUNK of D, written to ``part [chunks, N, E]``. The products of
   fp32 (or bf16) operands are exact in float64, and splitting D keeps many programs busy at batch 1.
2. ``_route_select_kernel``, grid (token tiles,): sums the partials in chunk order, softplus in float64,
   one rounding to fp32, sqrt_rn, then top_k rounds of "largest biased score, lowest index among equals",
   the normalising sum in selection order and an IEEE (div_rn) division.

Latency (a decode step routes a handful of tokens, so the chain of dependent steps is what costs): each
partial program accumulates its [BT, BE, BD] products element-wise over its chunk and reduces over BD once
at the end (a per-step reduction was a few hundred warp shuffles per step), and loads step d + 1 before it
multiplies step d. ``gate_temp`` reaches the select kernel as the bits of its float64 (a kernel argument),
not as a device tensor filled by a launch of its own.

Every tile and chunk size is a constant (never chosen from the batch size), so a token's scores are the
same bits whatever batch it runs in.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

CHUNK = 256  # D elements per partial sum: 20 programs per expert tile at D = 5120, 8 steps each
BT, BE, BD = 16, 16, 32  # logit tiles: tokens x experts x D step
PARTIAL_WARPS = 8  # 32 float64 accumulators per thread
SELECT_ELEMS = 2048  # scores per select program: 64 tokens at E = 16, 4 at E = 384 (no spills on sm_90)


@triton.jit
def _gate_partial_kernel(
    p_x, p_w, p_part, n_tok, n_exp, dim, stride_x, stride_w,
    CHUNK: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr,
):
    # Traffic per program: BT x CHUNK activations and BE x CHUNK gate weights in, BT x BE float64 out.
    i_t, i_e, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT)
    o_e = i_e * BE + tl.arange(0, BE)
    m_t, m_e = o_t < n_tok, o_e < n_exp
    p_xr = p_x + o_t.to(tl.int64)[:, None] * stride_x
    p_wr = p_w + o_e.to(tl.int64)[:, None] * stride_w
    d_lo = i_c * CHUNK
    d_hi = tl.minimum(d_lo + CHUNK, dim)
    o_d = d_lo + tl.arange(0, BD)
    b_x = tl.load(p_xr + o_d[None, :], mask=m_t[:, None] & (o_d < d_hi)[None, :], other=0.0)
    b_w = tl.load(p_wr + o_d[None, :], mask=m_e[:, None] & (o_d < d_hi)[None, :], other=0.0)
    b_acc = tl.zeros((BT, BE, BD), dtype=tl.float64)
    for d0 in range(d_lo, d_hi, BD):
        o_d = d0 + BD + tl.arange(0, BD)  # the next step's operands are in flight while this one multiplies
        b_x_nxt = tl.load(p_xr + o_d[None, :], mask=m_t[:, None] & (o_d < d_hi)[None, :], other=0.0)
        b_w_nxt = tl.load(p_wr + o_d[None, :], mask=m_e[:, None] & (o_d < d_hi)[None, :], other=0.0)
        b_acc += b_x.to(tl.float64)[:, None, :] * b_w.to(tl.float64)[None, :, :]
        b_x, b_w = b_x_nxt, b_w_nxt
    o_p = (i_c * n_tok + o_t).to(tl.int64)[:, None] * n_exp + o_e[None, :]
    tl.store(p_part + o_p, tl.sum(b_acc, axis=2), mask=m_t[:, None] & m_e[None, :])


@triton.jit
def _log1p_f64(u):
    """log(1 + u) for float64 u >= 0, accurate to a few ulps (Goldberg's correction; libdevice's log1p has
    no interpreter counterpart)."""
    v = 1.0 + u
    return tl.where(v == 1.0, u, tl.log(v) * (u / tl.where(v == 1.0, 1.0, v - 1.0)))


@triton.jit
def _route_select_kernel(
    p_part, p_bias, p_idx, p_w, n_tok, n_exp, n_chunks, temp_bits, route_scale,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BT: tl.constexpr,
):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_e = tl.arange(0, E_PAD)
    m_t, m_e = o_t < n_tok, o_e < n_exp
    m_te = m_t[:, None] & m_e[None, :]
    b_logit = tl.zeros((BT, E_PAD), dtype=tl.float64)
    for c in range(0, n_chunks):  # chunk order: the same sum for a token in any batch
        o_p = (c * n_tok + o_t).to(tl.int64)[:, None] * n_exp + o_e[None, :]
        b_logit += tl.load(p_part + o_p, mask=m_te, other=0.0)
    b_logit = b_logit / temp_bits.to(tl.int64).to(tl.float64, bitcast=True)
    # exp is only needed below the threshold; clamping keeps the unused branch finite.
    b_sp = tl.where(b_logit > 20.0, b_logit, _log1p_f64(tl.exp(tl.minimum(b_logit, 20.0))))
    b_s = tl.sqrt_rn(b_sp.to(tl.float32))
    b_bias = tl.load(p_bias + o_e, mask=m_e, other=0.0)
    b_key = tl.where(m_e[None, :], b_s + b_bias[None, :], float("-inf"))
    o_k = tl.arange(0, K_PAD)
    b_idx = tl.zeros((BT, K_PAD), dtype=tl.int32)
    b_w = tl.zeros((BT, K_PAD), dtype=tl.float32)
    b_total = tl.zeros((BT,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        b_best = tl.max(b_key, axis=1)
        b_pick = tl.min(tl.where(b_key == b_best[:, None], o_e[None, :], E_PAD), axis=1)
        b_hit = o_e[None, :] == b_pick[:, None]
        b_wj = tl.sum(tl.where(b_hit, b_s, 0.0), axis=1)  # exactly one term is non-zero
        b_key = tl.where(b_hit, float("-inf"), b_key)
        b_idx = tl.where(o_k[None, :] == j, b_pick[:, None], b_idx)
        b_w = tl.where(o_k[None, :] == j, b_wj[:, None], b_w)
        if j == 0:
            b_total = b_wj
        else:
            b_total = b_total + b_wj
    if TOP_K > 1:
        b_den = tl.broadcast_to((b_total + 1e-20)[:, None], (BT, K_PAD))
        b_w = tl.math.div_rn(b_w, b_den)
    b_w = b_w * route_scale
    o_out = o_t.to(tl.int64)[:, None] * TOP_K + o_k[None, :]
    m_out = m_t[:, None] & (o_k < TOP_K)[None, :]
    tl.store(p_idx + o_out, b_idx, mask=m_out)
    tl.store(p_w + o_out, b_w, mask=m_out)


def moe_route_triton(
    x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int, route_scale: float,
    gate_temp: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch both kernels: ``x [N, D]`` -> ``(idx int32 [N, top_k], weights fp32 [N, top_k])`` (new tensors)."""
    n, d = x.shape
    e = gate_weight.shape[0]
    dev = x.device
    idx = torch.empty((n, top_k), dtype=torch.int32, device=dev)
    w = torch.empty((n, top_k), dtype=torch.float32, device=dev)
    if n == 0:
        return idx, w
    n_chunks = triton.cdiv(d, CHUNK)
    part = torch.empty((n_chunks, n, e), dtype=torch.float64, device=dev)
    _gate_partial_kernel[(triton.cdiv(n, BT), triton.cdiv(e, BE), n_chunks)](
        x, gate_weight, part, n, e, d, x.stride(0), gate_weight.stride(0), CHUNK=CHUNK, BT=BT, BE=BE, BD=BD,
        num_warps=PARTIAL_WARPS,
    )
    # a Python float argument would reach the kernel as fp32: pass the float64's bits instead
    temp_bits = struct.unpack("<q", struct.pack("<d", float(gate_temp)))[0]
    e_pad = max(16, triton.next_power_of_2(e))
    bt = max(1, min(64, SELECT_ELEMS // e_pad))  # from the geometry, never from N
    _route_select_kernel[(triton.cdiv(n, bt),)](
        part, bias, idx, w, n, e, n_chunks, temp_bits, float(route_scale),
        TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)), E_PAD=e_pad, BT=bt,
        num_warps=4 if e_pad <= 64 else 8,
    )
    return idx, w
