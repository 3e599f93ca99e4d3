"""Sparse MQA decode attention over the packed paged pool: the plain-torch reference (the spec).

The math is the model's attention core (model.md §3.3), the same as ``engine/model/attention.py``'s
``sparse_attention`` for one query token per sequence. kernels/ may not import engine/ (tests/test_layering.py),
so it is restated here and ``tests/kernels/test_sparse_mqa.py`` checks the two agree. Per (sequence b, head h)::

    keys   = window slots (start_b + i) % W for i < win_count_b            FP8 records, 528 B for D = 512
           + global entries sel_idx[b, t] for t < sel_count_b, id >= 0     FP4 records, 288 B for D = 512
    s_t    = scale * q[b, h] . K_t                 (K = V: the shared 512-dim latent, MQA)
    m      = max(max_t s_t, sink_h)
    o[b,h] = sum_t e^(s_t - m) K_t / (sum_t e^(s_t - m) + e^(sink_h - m))

No RoPE here: q arrives rotated (its last 64 channels at the query position), the stored keys were
rotated at their own positions before quantisation, and the caller undoes the query rotation on ``o``
(``Attention.output``). A sequence with no visible key returns 0 (all mass on the sink).

Addressing: global entry id j lives in pool block ``block_table[b, j // E]`` at offset ``j % E``, where
``pool`` is one stream's main-KV view ``[num_blocks, E, D/2 + D/16]`` (``GlobalKVPool.streams[s][0]``).
The window is one layer's ring per sequence, ``[B, W, D + D/32]``; its visible slots are the ``win_count``
consecutive slots from ``win_start`` (mod W), i.e. after the decode step wrote the current token's slot.

Failure: an out-of-range entry id or block id raises ``ValueError`` here (the kernel cannot check
without a host sync; there such inputs are outside the contract and read as absent keys).
"""

from __future__ import annotations

import torch

from flashtier.kernels.quant.fp4 import dequantize_fp4
from flashtier.kernels.quant.fp8 import dequantize_fp8


def gather_global_keys(
    sel_idx: torch.Tensor, sel_count: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantised selected entries ``[B, K, D]`` fp32 and their mask ``[B, K]`` (t < count and id >= 0)."""
    b, k = sel_idx.shape
    e = pool.shape[1]
    t = torch.arange(k, device=sel_idx.device)
    mask = (t[None, :] < sel_count.long()[:, None]) & (sel_idx >= 0)
    ids = torch.where(mask, sel_idx.long(), torch.zeros_like(sel_idx, dtype=torch.long))
    logical = torch.div(ids, e, rounding_mode="floor")
    if bool((logical >= block_table.shape[1]).any()):
        raise ValueError(
            f"sparse_mqa_decode: a selected entry id reaches logical block {int(logical.max())}, "
            f"but block_table has {block_table.shape[1]} columns ({e} entries per block)"
        )
    blocks = torch.gather(block_table.long(), 1, logical)
    blocks = torch.where(mask, blocks, torch.zeros_like(blocks))
    if bool(((blocks < 0) | (blocks >= pool.shape[0])).any()):
        raise ValueError(f"sparse_mqa_decode: block_table holds a block id outside [0, {pool.shape[0]})")
    rec = pool[blocks, ids % e]  # [B, K, D/2 + D/16]
    kv = dequantize_fp4(rec[..., : d // 2], rec[..., d // 2 :], impl="reference")
    return kv, mask


def gather_window_keys(
    window: torch.Tensor, win_start: torch.Tensor, win_count: torch.Tensor, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantised window slots ``[B, W, D]`` fp32 in ring order from ``win_start`` and their mask ``[B, W]``."""
    b, w, _ = window.shape
    i = torch.arange(w, device=window.device)
    slots = (win_start.long()[:, None] + i[None, :]) % w
    rec = torch.gather(window, 1, slots[:, :, None].expand(b, w, window.shape[2]))
    kv = dequantize_fp8(rec[..., :d], rec[..., d:], impl="reference")
    return kv, i[None, :] < win_count.long()[:, None]


def attend_keys(
    q: torch.Tensor,
    local_kv: torch.Tensor,
    local_mask: torch.Tensor,
    global_kv: torch.Tensor,
    global_mask: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One softmax over (window keys + selected entries) plus a per-head sink; K = V.

    q [B, H, D]; local_kv [B, W, D] / local_mask [B, W]; global_kv [B, K, D] / global_mask [B, K];
    computed in ``q``'s precision (fp32, or fp64 for the oracle's float64 mode). Returns o [B, H, D].
    The same steps as the engine's ``sparse_attention`` (window part first, then the global part).
    """
    s_loc = torch.einsum("bhd,bkd->bhk", q, local_kv) * scale
    s_loc = s_loc.masked_fill(~local_mask[:, None, :], float("-inf"))
    s_glob = torch.einsum("bhd,bsd->bhs", q, global_kv) * scale
    s_glob = s_glob.masked_fill(~global_mask[:, None, :], float("-inf"))
    s = torch.cat((s_loc, s_glob), dim=-1)
    sink_b = sink.to(q.dtype)[None, :, None].expand(s.shape[0], -1, 1)
    m = torch.maximum(s.amax(-1, keepdim=True), sink_b)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink_b - m)
    k_loc = local_kv.shape[1]
    o = torch.einsum("bhk,bkd->bhd", p[..., :k_loc], local_kv)
    o = o + torch.einsum("bhs,bsd->bhd", p[..., k_loc:], global_kv)
    return o / denom


def sparse_mqa_decode_reference(
    q: torch.Tensor,
    sel_idx: torch.Tensor,
    sel_count: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    window: torch.Tensor,
    win_start: torch.Tensor,
    win_count: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The spec of :func:`flashtier.kernels.sparse_mqa.op.sparse_mqa_decode` (arguments already validated).

    Computes in fp32 (fp64 when ``q`` is fp64) on dequantised copies of only the addressed records;
    returns ``[B, H, D]`` in ``q``'s dtype.
    """
    d = q.shape[-1]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    gkv, gmask = gather_global_keys(sel_idx, sel_count, pool, block_table, d)
    wkv, wmask = gather_window_keys(window, win_start, win_count, d)
    o = attend_keys(q.to(cdt), wkv.to(cdt), wmask, gkv.to(cdt), gmask, sink.to(cdt), scale)
    return o.to(q.dtype)
