"""The sparse indexer over the packed paged pool, decode form: which global entries each sequence attends to.

    score[b, t] = sum_h w[b, h] * relu(q[b, h] . k[t])      over MXFP4 q and keys (math: ``indexer_topk/reference.py``)
    sel_idx[b]  = the min(k, #valid) best visible entries, ties to the lower entry id, ascending, -1 padded

Inputs (B decode rows; the real model: IH = 32 heads, ID = 128, k = 512, cand_block = 8, n_blocks = 2048):

    q            [B, IH, ID] fp32/bf16   indexer queries after RoPE (quantised to MXFP4 here: lossless for
                                         the engine's already-fake-quantised q), or uint8 [B, IH, ID/2 + ID/32]
                                         packed MXFP4 records (codes, even channel in the low nibble, then e8m0)
    weights      [B, IH] fp32/bf16       per-head weights (weights_proj(x) * ID^-0.5 * IH^-0.5)
    index_pool   [N, E, ID/2 + ID/32]    uint8, one stream's indexer-K view (``GlobalKVPool.streams[s][1]``,
                                         68 B per entry)
    block_table  [B, max_blocks] int32   entry t of row b is index_pool[block_table[b, t // E], t % E]
    n_visible    [B] int32               visible global entries per row (entries 0 .. n_visible - 1)
    candidates   optional (blocks [B, C] int32 ascending, counts [B] int32): a Reindex layer scores only
                 the entries of these ``cand_block``-entry blocks (layer 20's pool)

Returns an ``IndexerSelection``: ``sel_idx [B, k]`` int32 and ``counts [B]`` int32 (what ``sparse_mqa_decode``
consumes); ``indexer_topk_with_candidates`` (layer 20) also returns the candidate pool ``cand_blocks
[B, n_blocks]`` int32 (ascending, -1 padded) and ``cand_counts [B]``. ``return_scores`` adds the scores
(``[B, L]`` fp32, -inf where invalid) and, for layer 20, the block scores.

Dispatch: ``impl="auto"`` runs Triton on CUDA tensors and the reference on CPU; ``"reference"`` / ``"triton"``
force one (Triton on CPU needs TRITON_INTERPRET=1). Both give identical indices and identical score bits
(within the numeric contract in ``indexer_topk/reference.py``: q/k scale bytes in [65, 185], a row's q scales
spanning <= 2^36). No host sync: the op can be captured in a CUDA graph.

Failure: shapes, dtypes, devices, strides and the integer arguments are checked here (``ValueError``
naming the argument). Index values are not checked on the Triton path (a host sync): an out-of-range block
id reads as an absent entry there, while the reference raises ``ValueError``.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from flashtier.kernels.indexer_topk.kernel import IndexerTopKConfig, keys_to_scores, score_keys, select_from_keys
from flashtier.kernels.quant.common import check_tensor, resolve_impl
from flashtier.kernels.indexer_topk.reference import (
    candidate_blocks_reference,
    indexer_scores_reference,
    select_topk_reference,
    to_entry_ids,
)
from flashtier.kernels.quant.mxfp4 import quantize_mxfp4

__all__ = ["IndexerSelection", "IndexerTopKConfig", "indexer_topk", "indexer_topk_with_candidates"]

_OP = "indexer_topk"
DEFAULT_CONFIG = IndexerTopKConfig()


class IndexerSelection(NamedTuple):
    sel_idx: torch.Tensor  # [B, k] int32 entry ids, ascending, -1 padded
    counts: torch.Tensor  # [B] int32
    cand_blocks: torch.Tensor | None = None  # [B, n_blocks] int32 (layer 20 only)
    cand_counts: torch.Tensor | None = None  # [B] int32
    scores: torch.Tensor | None = None  # [B, L] fp32 (return_scores)
    block_scores: torch.Tensor | None = None  # [B, ceil(L / cand_block)] fp32 (layer 20, return_scores)


_tensor = partial(check_tensor, op=_OP)


def _positive_int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{_OP}: {name} must be a positive int, got {v!r}")
    return v


def _query_width(q) -> int:
    """ID of ``q``: its last axis (floats) or the record width 17 * ID / 32 (packed uint8)."""
    _tensor(q, "q", (torch.float32, torch.bfloat16, torch.uint8), (None, None, None))
    b, ih, last = q.shape
    d = last if q.dtype != torch.uint8 else (32 * last) // 17
    if b < 1 or ih < 1 or d < 32 or d % 32 or (q.dtype == torch.uint8 and d // 2 + d // 32 != last):
        raise ValueError(
            f"{_OP}: q must be [B, IH, ID] floats or [B, IH, ID/2 + ID/32] uint8 records with B, IH >= 1 and "
            f"ID a positive multiple of 32, got {tuple(q.shape)} {q.dtype}"
        )
    return d


def _validate(q, weights, index_pool, block_table, n_visible, k, candidates, cand_block, impl, config):
    d = _query_width(q)
    b, ih, _ = q.shape
    _tensor(weights, "weights", (torch.float32, torch.bfloat16), (b, ih))
    _tensor(index_pool, "index_pool", (torch.uint8,), (None, None, d // 2 + d // 32))
    if index_pool.shape[0] < 1 or index_pool.shape[1] < 1 or index_pool.stride(2) != 1:
        raise ValueError(f"{_OP}: index_pool must hold >= 1 block of >= 1 entry, dense in its byte axis, "
                         f"got shape {tuple(index_pool.shape)} strides {index_pool.stride()}")
    _tensor(block_table, "block_table", (torch.int32,), (b, None))
    if block_table.shape[1] < 1:
        raise ValueError(f"{_OP}: block_table must have at least one column, got {tuple(block_table.shape)}")
    _tensor(n_visible, "n_visible", (torch.int32,), (b,))
    _positive_int(k, "k")
    _positive_int(cand_block, "cand_block")
    named = {"weights": weights, "index_pool": index_pool, "block_table": block_table, "n_visible": n_visible}
    if candidates is not None:
        if not isinstance(candidates, (tuple, list)) or len(candidates) != 2:
            raise ValueError(f"{_OP}: candidates must be a (blocks [B, C] int32, counts [B] int32) pair")
        _tensor(candidates[0], "candidates[0] (blocks)", (torch.int32,), (b, None))
        _tensor(candidates[1], "candidates[1] (counts)", (torch.int32,), (b,))
        if candidates[0].shape[1] < 1:
            raise ValueError(f"{_OP}: candidates[0] must have at least one column")
        named.update({"candidates[0]": candidates[0], "candidates[1]": candidates[1]})
    for name, t in named.items():
        if t.device != q.device:
            raise ValueError(f"{_OP}: {name} is on {t.device}, q on {q.device}: all inputs must be on one device")
    impl = resolve_impl(impl, q, _OP)
    if impl == "triton":
        cfg = config or DEFAULT_CONFIG
        if d != 128:
            raise ValueError(f"{_OP}: the Triton path needs ID = 128 (4 scale blocks), got ID={d}; use impl='reference'")
        if ih > 64:
            raise ValueError(f"{_OP}: the Triton path takes at most 64 heads, got IH={ih}; use impl='reference'")
        if cand_block & (cand_block - 1) or cfg.block_n % cand_block:
            raise ValueError(f"{_OP}: the Triton path needs cand_block a power of two dividing block_n={cfg.block_n}, "
                             f"got {cand_block}")
    return impl


def _mxfp4_query(q: torch.Tensor, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [B, IH, ID/2], scale bytes [B, IH, ID/32]) of ``q`` (views when it is already packed)."""
    if q.dtype == torch.uint8:
        half = (16 * q.shape[-1]) // 17
        return q[..., :half], q[..., half:]
    return quantize_mxfp4(q.float(), impl=impl)


def _run(q, weights, index_pool, block_table, n_visible, k, candidates, cand_block, n_blocks, impl, config,
         return_scores) -> IndexerSelection:
    impl = _validate(q, weights, index_pool, block_table, n_visible, k, candidates, cand_block, impl, config)
    qc, qs = _mxfp4_query(q, impl)
    w = weights.float()
    if impl == "reference":
        scores, ids = indexer_scores_reference(qc, qs, w, index_pool, block_table, n_visible, candidates, cand_block)
        pos, counts = select_topk_reference(scores, k)
        sel = to_entry_ids(pos, ids).int()
        blocks = cand_counts = bscores = None
        if n_blocks:
            blocks, cand_counts, bscores = candidate_blocks_reference(scores, n_visible, cand_block, n_blocks)
            blocks, cand_counts = blocks.int(), cand_counts.int()
        return IndexerSelection(sel, counts.int(), blocks, cand_counts, scores if return_scores else None,
                                bscores if return_scores else None)
    cfg = config or DEFAULT_CONFIG
    cand, cand_cnt = candidates if candidates is not None else (None, None)
    keys, bkeys = score_keys(qc, qs, w, index_pool, block_table, n_visible, cand, cand_cnt, cand_block,
                             n_blocks, cfg)
    if cand is None:
        sel, counts = select_from_keys(keys, k, n_visible, 0, None, cand_block, cfg)
    else:
        sel, counts = select_from_keys(keys, k, cand_cnt, 2, cand, cand_block, cfg)
    blocks = cand_counts = None
    if n_blocks:
        blocks, cand_counts = select_from_keys(bkeys, n_blocks, n_visible, 1, None, cand_block, cfg)
    return IndexerSelection(sel, counts, blocks, cand_counts, keys_to_scores(keys) if return_scores else None,
                            keys_to_scores(bkeys) if return_scores and n_blocks else None)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_pool: torch.Tensor,
    block_table: torch.Tensor,
    n_visible: torch.Tensor,
    k: int = 512,
    *,
    candidates: tuple[torch.Tensor, torch.Tensor] | None = None,
    cand_block: int = 8,
    impl: str = "auto",
    config: IndexerTopKConfig | None = None,
    return_scores: bool = False,
) -> IndexerSelection:
    """Top-k global entries of every decode row in one launch (Full layers; Reindex layers with ``candidates``).

    See the module docstring for every argument. Example (real geometry, decoder stream S20)::

        sel = indexer_topk(q_idx, w, kv_pool.streams[3][1], tables, n_vis)      # q_idx [B, 32, 128]
        o = sparse_mqa_decode(q, sel.sel_idx, sel.counts, kv_pool.streams[3][0], tables, ...)
    """
    return _run(q, weights, index_pool, block_table, n_visible, k, candidates, cand_block, 0, impl, config,
                return_scores)


def indexer_topk_with_candidates(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_pool: torch.Tensor,
    block_table: torch.Tensor,
    n_visible: torch.Tensor,
    k: int = 512,
    *,
    n_blocks: int = 2048,
    cand_block: int = 8,
    impl: str = "auto",
    config: IndexerTopKConfig | None = None,
    return_scores: bool = False,
) -> IndexerSelection:
    """Layer 20: its own top-k plus the candidate pool (the ``n_blocks`` best ``cand_block``-entry blocks by
    max score, the newest visible block always kept), returned as ascending block ids for the Reindex layers'
    ``candidates=(sel.cand_blocks, sel.cand_counts)``."""
    _positive_int(n_blocks, "n_blocks")
    return _run(q, weights, index_pool, block_table, n_visible, k, None, cand_block, n_blocks, impl, config,
                return_scores)
