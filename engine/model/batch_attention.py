"""The attention core of one layer for every query row of a step at once (no loop over sequences).

The batched form of ``layer_forward.attend``: window keys gathered from the ring arena and this step's
rows, global entries chosen by the indexer op over the packed pool, one sparse-MQA launch for all rows,
then this step's window records stored into the rings. Ops dispatch by device (Triton on CUDA, their
plain-torch references on the CPU), so the CPU tests check this path against the per-sequence one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashtier.engine.model.batch_entries import write_entries
from flashtier.engine.model.block import Block
from flashtier.engine.model.compressor import PartialGroup
from flashtier.engine.model.dense_entries import DenseWrites, write_dense
from flashtier.engine.model.step_rows import StepRows
from flashtier.kernels.indexer_topk.op import indexer_topk, indexer_topk_with_candidates
from flashtier.kernels.quant.fp8 import pack_fp8_record, quantize_fp8
from flashtier.kernels.sparse_mqa.op import sparse_mqa_decode


@dataclass(frozen=True)
class PagedViews:
    """The byte stores a step reads and writes: the ring arena and each KV source's pool views."""

    ring_data: torch.Tensor  # [L, slots * W, rec] uint8
    ring_pos: torch.Tensor  # [L, slots * W] int64
    main: dict[int, torch.Tensor]  # KV source layer -> [N, E, 288] uint8
    index: dict[int, torch.Tensor]  # KV source layer -> [N, E, 68] uint8


@dataclass
class RowSlots:
    """Selections shared across layers of one part, written by source layers before consumers read them."""

    topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layer -> (idx, counts)
    candidates: tuple[torch.Tensor, torch.Tensor] | None = None  # layer 20's (blocks, counts)
    opened: dict[int, list[PartialGroup]] = field(default_factory=dict)  # source -> groups opened this step
    # DenseWrites parts: source -> (kv, z) [T, hd] of every row (the caller opens the groups of even positions)
    opened_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    no_selection: tuple[torch.Tensor, torch.Tensor] | None = None  # ratio-0 layers: ids -1 [T, 1], counts 0 [T]


def indexer_impl(index_width: int) -> str:
    """The Triton indexer is built for the real index width (128); other widths (tiny) take the reference."""
    return "auto" if index_width == 128 else "reference"


def _select(block: Block, rows: StepRows, views: PagedViews, slots: RowSlots, h, qr) -> None:
    role, attn, cfg = block.role, block.attn, block.cfg
    qi, w = attn.indexer.project_q(qr, h, rows.positions)
    # the op scores in fp32 (its numeric contract); qi is already on the MXFP4 grid, so only w rounds
    qi, w = qi.float(), w.float()
    n_vis = torch.div(rows.positions + 1, role.ratio, rounding_mode="floor").to(torch.int32)
    index = views.index[role.kv_source]
    impl = indexer_impl(qi.shape[-1])
    common = dict(k=cfg.index_topk, cand_block=cfg.candidate_block_size, impl=impl)
    if role.role == "full" and role.index == cfg.candidate_source_layer_id:
        sel = indexer_topk_with_candidates(qi, w, index, rows.block_table, n_vis,
                                           n_blocks=cfg.candidate_topk_blocks, **common)
        slots.candidates = (sel.cand_blocks, sel.cand_counts)
    else:
        cand = None
        if role.role == "reindex":
            assert slots.candidates is not None, "a reindex layer runs before the candidate source"
            cand = slots.candidates
        sel = indexer_topk(qi, w, index, rows.block_table, n_vis, candidates=cand, **common)
    slots.topk[role.index] = (sel.sel_idx, sel.counts)


def attend_rows(
    block: Block, rows: StepRows, views: PagedViews, slots: RowSlots, h, q, qr, kv_raw, *, encoder: bool
) -> torch.Tensor:
    """o [T, H, hd] for the part's rows at layer ``block``; h [T, D], q [T, H, hd], qr, kv_raw [T, hd].

    Mutates: the pool (a ratio-2 source's entries, encoder part only), the arena rings of this layer
    (the newest ``W`` rows of each sequence) and ``slots``. Needs no lock (the engine thread owns it).
    """
    role, attn, layer = block.role, block.attn, block.role.index
    records = pack_fp8_record(*quantize_fp8(kv_raw.float()))
    if role.ratio == 0:  # window only: no global entry selected (made once per step, not per layer)
        if slots.no_selection is None:
            t = rows.num_rows
            slots.no_selection = (torch.full((t, 1), -1, dtype=torch.int32, device=q.device),
                                  torch.zeros(t, dtype=torch.int32, device=q.device))
        sel_idx, counts = slots.no_selection
        pool = views.main[next(iter(views.main))]
    else:
        if encoder and role.role == "full" and layer in rows.writes:
            w = rows.writes[layer]
            if isinstance(w, DenseWrites):
                slots.opened_rows[layer] = write_dense(block, h, w, views.main[layer], views.index[layer])
            else:
                slots.opened[layer] = write_entries(block, h, w, views.main[layer], views.index[layer])
        if role.role in ("full", "reindex"):
            _select(block, rows, views, slots, h, qr)
        sel_idx, counts = slots.topk[role.index_source]
        pool = views.main[role.kv_source]
    ring = views.ring_data[layer]
    window = torch.where(rows.win_from_step[..., None], records[rows.win_step_row], ring[rows.win_ring_row])
    o = sparse_mqa_decode(q, sel_idx, counts, pool, rows.block_table, window, rows.win_start, rows.win_count,
                          attn.attn_sink.float(), attn.scale)
    ring[rows.ring_dst_rows] = records[rows.ring_src_rows]
    views.ring_pos[layer, rows.ring_dst_rows] = rows.positions[rows.ring_src_rows]
    return o
