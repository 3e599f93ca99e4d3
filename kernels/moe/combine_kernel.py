"""Triton MoE combine: per-pair expert outputs back to token order, in a fixed summation order, no atomics.

``y[t] = ((0 + out[t*k + j1]) + out[t*k + j2]) + ... + shared[t]`` with the slots j taken in ascending
expert id, which is the order of the reference's ``index_add_`` loop over experts. Given equal expert
outputs the combine is bit-identical to the reference, and a token's sum never depends on its batch.
A slot whose id is ``SKIP`` (a pair routed to an expert this rank does not hold) is left out: its row of
``out`` is never read.
Grid (token tiles, D tiles); the slot order is found in registers (k <= 16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BT, BD = 16, 256
SKIP = 2147483647  # int32 max: the id of a slot to leave out (sorts last, like the padding of k to K_PAD)


@triton.jit
def _moe_combine_kernel(
    p_out, p_idx, p_shared, p_y, n_tok, dim,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, HAS_SHARED: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    # Traffic per program: TOP_K (+1) rows of BT x BD fp32 in, one out.
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_t = o_t < n_tok
    m = m_t[:, None] & (o_d < dim)[None, :]
    o_k = tl.arange(0, K_PAD)
    o_row = o_t.to(tl.int64) * TOP_K
    b_ids = tl.load(p_idx + o_row[:, None] + o_k[None, :], mask=m_t[:, None] & (o_k < TOP_K)[None, :],
                    other=2147483647)
    b_y = tl.zeros((BT, BD), dtype=tl.float32)
    for _ in tl.static_range(TOP_K):
        b_low = tl.min(b_ids, axis=1)
        b_slot = tl.min(tl.where(b_ids == b_low[:, None], o_k[None, :], K_PAD), axis=1)  # lowest remaining expert
        b_ids = tl.where(o_k[None, :] == b_slot[:, None], 2147483647, b_ids)
        m_slot = m & (b_low < 2147483647)[:, None]  # a skipped slot (or none left) adds nothing
        b_y += tl.load(p_out + (o_row + b_slot)[:, None] * dim + o_d[None, :], mask=m_slot, other=0.0)
    if HAS_SHARED:
        b_y += tl.load(p_shared + o_t.to(tl.int64)[:, None] * dim + o_d[None, :], mask=m, other=0.0)
    tl.store(p_y + o_t.to(tl.int64)[:, None] * dim + o_d[None, :], b_y, mask=m)


def moe_combine_triton(out: torch.Tensor, idx: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """``out fp32 [N * k, D]``, ``idx int32 [N, k]`` (``SKIP``: leave the slot out), ``shared fp32 [N, D]`` or
    None -> ``y fp32 [N, D]``."""
    n, k = idx.shape
    dim = out.shape[1]
    y = torch.empty((n, dim), dtype=torch.float32, device=out.device)
    if n:
        _moe_combine_kernel[(triton.cdiv(n, BT), triton.cdiv(dim, BD))](
            out, idx, y if shared is None else shared, y, n, dim,
            TOP_K=k, K_PAD=max(2, triton.next_power_of_2(k)), HAS_SHARED=shared is not None, BT=BT, BD=BD,
        )
    return y
