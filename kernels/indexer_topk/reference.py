"""Indexer scoring and top-k over the packed paged pool, decode form: the plain-torch reference (the spec).

The math is the model's indexer (model.md §3.5), as in ``engine/model/indexer.py`` (``index_scores``,
``select_topk``, ``candidate_pool``) for one query token per sequence. kernels/ may not import engine/
(tests/test_layering.py), so it is restated here and ``tests/kernels/test_indexer_topk.py`` checks that the
two agree. Per sequence b (IH heads of width ID; the real model: IH = 32, ID = 128, k = 512)::

    q[h], k[t]   MXFP4 vectors: e2m1 values v times one e8m0 scale s per block of 32 channels
    d[h, t]      = sum over blocks n of  S[h, t, n] * s_k[t, n] * s_q[h, n]     (blocks in order 0, 1, ...)
                   S[h, t, n] = sum of v_q * v_k over the block's 32 channels  (exact: multiples of 1/4, <= 1152)
    score[t]     = pairwise tree over heads of  w[h] * relu(d[h, t])           (heads zero-padded to 2^m)
    entries      t < n_visible[b]; entry t lives in index_pool[block_table[b, t // E], t % E]
    top-k        the min(k, #valid) best valid entries by (score desc, entry asc), listed ascending, -1 padded

Every per-block term is exact in fp32 (an e2m1 product has at most 4 significant bits), so d's only rounding
is the fixed block order, and the head sum is a fixed tree (x[2j] + x[2j+1], level by level): the score is
one exact function of the inputs that the kernel reproduces bit for bit. That holds while no term leaves
fp32's normal range: scale bytes in [65, 185] (|values| ~1e-19 .. 1e18), which real indexer q/k never leave;
the kernel also needs one row's non-zero q blocks to span at most 2^36 in scale (it shifts q into fp16).

Layer 20 (``candidate_blocks_reference``): block score = max of the entry scores of each run of
``cand_block`` entries (invalid ones -inf), the block holding the newest visible entry pinned to +inf,
then the ``n_blocks`` best blocks with a finite score, ascending. Reindex layers score only the entries
of those blocks (``candidates``) and pick their top-k inside them.

Failure: an entry id whose block-table column or block id is out of range, or a visible count outside
[0, block_table columns * E], raises ``ValueError`` here (the kernel cannot check without a host sync;
there such entries read as absent).
"""

from __future__ import annotations

import torch

from flashtier.kernels.quant.e2m1 import packed_e2m1_to_float
from flashtier.kernels.quant.fp8_bits import e8m0_to_float

BLOCK = 32  # MXFP4 channels per scale
_CHUNK = 2048  # entries scored at a time: bounds the [B, chunk, IH, ID/32] temporaries


def mxfp4_parts(rec: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unscaled e2m1 values ``[..., D]`` fp32 and scales ``[..., D/32]`` fp32 of MXFP4 records ``[..., D/2 + D/32]``."""
    return packed_e2m1_to_float(rec[..., : d // 2]), e8m0_to_float(rec[..., d // 2 :])


def head_tree_sum(p: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis as a pairwise tree (x[2j] + x[2j+1] per level), zero-padded to a power of two."""
    h = p.shape[-1]
    width = 1 << max(0, (h - 1).bit_length())
    if width != h:
        p = torch.nn.functional.pad(p, (0, width - h))
    while p.shape[-1] > 1:
        p = p[..., 0::2] + p[..., 1::2]
    return p[..., 0]


def score_keys(q_vals, q_scales, w, k_vals, k_scales, d: int) -> torch.Tensor:
    """Scores ``[B, L]`` fp32 of keys ``k_vals [B, L, D]`` / ``k_scales [B, L, D/32]`` (``mxfp4_parts`` of their
    records; ``[L, D]`` / ``[L, D/32]``: the same keys for every query) for queries ``[B, IH, D]`` / ``[B, IH, D/32]``.

    Each 32-channel block's dot of unscaled e2m1 values is exact in fp32 whatever the summation order (products
    are multiples of 1/4 up to 36, a block's sum below 2^11), so sharing the keys changes no bit."""
    b, ih, _ = q_vals.shape
    nb = d // BLOCK
    q = q_vals.view(b, ih, nb, BLOCK)
    if k_vals.dim() == 2:
        s = torch.einsum("bhnc,lnc->blhn", q, k_vals.view(-1, nb, BLOCK))
        k_scales = k_scales[None]
    else:
        s = torch.einsum("bhnc,blnc->blhn", q, k_vals.view(b, -1, nb, BLOCK))
    terms = s * k_scales[:, :, None, :] * q_scales[:, None, :, :]  # exact: power-of-two scalings
    dot = terms[..., 0]
    for n in range(1, nb):  # the fixed block order
        dot = dot + terms[..., n]
    return head_tree_sum(torch.relu(dot) * w[:, None, :])


def entry_ids(b: int, length: int, n_visible, candidates, cand_block: int, device) -> torch.Tensor:
    """Entry id of each scored position ``[B, L]`` (int64, -1 where the position holds no valid entry).

    Plain: position t is entry t, valid below ``n_visible``. With ``candidates = (blocks [B, C], counts [B])``:
    position u is entry ``blocks[b, u // cand_block] * cand_block + u % cand_block``, valid when its block is
    among the first ``counts[b]`` and the entry is visible.
    """
    vis = n_visible.long()[:, None]
    if candidates is None:
        ids = torch.arange(length, device=device).expand(b, length)
        return torch.where(ids < vis, ids, torch.full_like(ids, -1))
    blocks, counts = candidates
    u = torch.arange(blocks.shape[1] * cand_block, device=device)
    col = u // cand_block
    cb = blocks.long()[:, col]
    ids = cb * cand_block + u % cand_block
    ok = (col[None, :] < counts.long()[:, None]) & (cb >= 0) & (ids < vis)
    return torch.where(ok, ids, torch.full_like(ids, -1))


def _check_addresses(ids, n_visible, block_table, n_phys: int, e: int) -> None:
    cols = block_table.shape[1]
    if bool(((n_visible < 0) | (n_visible.long() > cols * e)).any()):
        raise ValueError(f"indexer_topk: n_visible must lie in [0, {cols * e}] (block_table columns x {e} entries)")
    blocks = torch.gather(block_table.long(), 1, ids.clamp(min=0) // e)
    if bool((((blocks < 0) | (blocks >= n_phys)) & (ids >= 0)).any()):
        raise ValueError(f"indexer_topk: block_table holds a block id outside [0, {n_phys}) for a visible entry")


def indexer_scores_reference(q_codes, q_scale_bytes, w, index_pool, block_table, n_visible, candidates=None,
                             cand_block: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``[B, L]`` fp32 (-inf where invalid) and entry ids ``[B, L]`` int64 (-1 where invalid).

    ``q_codes [B, IH, D/2]`` / ``q_scale_bytes [B, IH, D/32]`` are the MXFP4 query; L is
    ``block_table.shape[1] * E`` (plain) or ``candidates[0].shape[1] * cand_block`` (reindex).
    """
    b, ih, half = q_codes.shape
    d = 2 * half
    n_phys, e, _ = index_pool.shape
    length = block_table.shape[1] * e if candidates is None else candidates[0].shape[1] * cand_block
    ids = entry_ids(b, length, n_visible, candidates, cand_block, q_codes.device)
    _check_addresses(ids, n_visible, block_table, n_phys, e)
    q_vals = packed_e2m1_to_float(q_codes)
    q_scales = e8m0_to_float(q_scale_bytes)
    w = w.float()
    scores = torch.full((b, length), float("-inf"), device=q_codes.device)
    table = block_table.long().clamp(0, n_phys - 1)
    if candidates is None:
        # plain: position t is entry t for every row, so rows with the same block table (a prefill chunk's rows
        # are one sequence's) score one key matrix, decoded once, instead of a copy per row
        tables, group = torch.unique(table, dim=0, return_inverse=True)
        for g in range(tables.shape[0]):
            rows = (group == g).nonzero().squeeze(1)
            k_vals, k_scales = mxfp4_parts(index_pool[tables[g]].flatten(0, 1), d)  # [length, D], [length, D/32]
            for lo in range(0, length, _CHUNK):
                scores[rows, lo : lo + _CHUNK] = score_keys(q_vals[rows], q_scales[rows], w[rows],
                                                            k_vals[lo : lo + _CHUNK], k_scales[lo : lo + _CHUNK], d)
    else:
        # candidates: each block the table names is decoded once (decoding the gathered [B, chunk] records
        # decoded every key once per query row); decoding is elementwise: the same values
        used, local = torch.unique(table, return_inverse=True)
        pool_vals, pool_scales = mxfp4_parts(index_pool[used], d)  # [U, E, D], [U, E, D/32]
        for lo in range(0, length, _CHUNK):
            part = ids[:, lo : lo + _CHUNK].clamp(min=0)
            blocks, slots = torch.gather(local, 1, part // e), part % e
            scores[:, lo : lo + _CHUNK] = score_keys(q_vals, q_scales, w, pool_vals[blocks, slots],
                                                     pool_scales[blocks, slots], d)
    return scores.masked_fill(ids < 0, float("-inf")), ids


# Tie order, from the official code: V4.1 inference/model.py, Indexer.forward (HF revision dba1be0a, about
# line 579; V4-Flash model.py line 427 has the sorted form) selects with
#     idxs = index_score.topk(topk, dim=-1, sorted=False).indices.sort(dim=-1).values
# and select_candidate_blocks keeps blocks with scores.topk(min(topk_blocks, num_blocks), dim=-1), on CUDA
# (generate.py: torch.set_default_device("cuda")). PyTorch's CUDA top-k (aten/src/ATen/native/cuda/
# TensorTopK.cu, gatherTopK, single- and multi-block) writes every value above the k-th, then the values
# equal to it in index order; slices >= 100,000 in <= 10 rows take a stable radix sort (TensorTopK.cpp,
# should_use_sort). Both mean ties go to the lower index, as here. Difference: the radix order ranks +0.0
# above -0.0, which compare equal here; a query's zero scores all share one sign, so it never decides.
# Pinned by tests/kernels/test_official_conventions.py (the CUDA side under -m gpu).
SORT_BELOW = 4096  # scores; measured on the CPU: the sort wins below ~64 x 100, the k-th value path above (3x at 1K x 1K)


def select_topk_reference(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[B, k]`` int64 of the min(k, #finite) best scores (ties: lower position), ascending, -1 padded; counts ``[B]``.

    The selection of the engine's ``select_topk`` (a stable descending sort, the first k, invalid dropped) without
    sorting the row: the k-th best value v comes from ``topk``'s values (which do not depend on how it orders
    ties), every score above v is taken, and the scores equal to v fill the rest in position order (a running
    count); the taken positions, all distinct, come out ascending from a second ``topk``. Integer and compare
    ops only, so the same positions as the sort (tests/kernels/test_indexer_topk.py holds the two equal on
    rows full of ties and -inf); ~4x faster on the CPU, where this runs in every indexer layer of the engine.
    Small score matrices (under ``SORT_BELOW`` scores: a decode step's) and any with a NaN (it orders above every
    number in the sort and compares equal to nothing) take the sort itself, which costs fewer ops there.
    """
    b, length = scores.shape
    kk = min(k, length)
    out = torch.full((b, k), -1, dtype=torch.long, device=scores.device)
    if kk == 0:
        return out, torch.zeros(b, dtype=torch.long, device=scores.device)
    if scores.numel() < SORT_BELOW or bool(scores.isnan().any()):
        pos, chosen = _sorted_topk(scores, kk)
    else:
        kth = torch.topk(scores, kk, dim=1).values[:, -1:]
        above, tied = scores > kth, scores == kth
        chosen = (above | (tied & (tied.cumsum(1) <= kk - above.sum(1, keepdim=True)))) & (scores > float("-inf"))
        ar = torch.arange(length, device=scores.device).expand(b, length)
        pos = torch.topk(torch.where(chosen, ar, length), kk, dim=1, largest=False).values
    out[:, :kk] = torch.where(pos >= length, -1, pos)
    return out, chosen.sum(1)


def _sorted_topk(scores: torch.Tensor, kk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_topk_reference`` by its definition: (ascending positions, padded with ``length``; taken mask)."""
    length = scores.shape[1]
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :kk]
    chosen = torch.gather(scores > float("-inf"), 1, order)
    return torch.sort(torch.where(chosen, order, torch.full_like(order, length)), dim=1).values, chosen


def block_scores_reference(scores: torch.Tensor, n_visible: torch.Tensor, cand_block: int) -> torch.Tensor:
    """Layer 20's block scores ``[B, ceil(L / cand_block)]``: block max, newest visible block pinned to +inf."""
    b, length = scores.shape
    nb = -(-length // cand_block)
    padded = torch.full((b, nb * cand_block), float("-inf"), device=scores.device)
    padded[:, :length] = scores
    bs = padded.view(b, nb, cand_block).amax(-1)
    has = n_visible > 0
    newest = ((n_visible.long() - 1).clamp(min=0) // cand_block).clamp(max=nb - 1)
    rows = torch.arange(b, device=scores.device)
    bs[rows[has], newest[has]] = float("inf")
    return bs


def candidate_blocks_reference(scores, n_visible, cand_block: int, n_blocks: int):
    """Kept candidate blocks ``[B, n_blocks]`` int64 (ascending, -1 padded), their counts ``[B]``, block scores."""
    bs = block_scores_reference(scores, n_visible, cand_block)
    blocks, counts = select_topk_reference(bs, n_blocks)
    return blocks, counts, bs


def to_entry_ids(pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Map selected positions ``[B, k]`` (-1 padded) to entry ids through ``ids [B, L]`` (keeps -1)."""
    got = torch.gather(ids, 1, pos.clamp(min=0))
    return torch.where(pos >= 0, got, torch.full_like(got, -1))
