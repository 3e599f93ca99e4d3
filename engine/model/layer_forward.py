"""One layer's forward for a run of query tokens, shared by the reference pass and the incremental path.

What a query token at position i sees in layer l (model.md §3.3)::

    window keys   positions [max(local_start, i - window + 1), i] of this layer's own KV
                  (local_start > 0 only inside a bounded replay: the window is truncated there)
    global keys   top-k entries of the layer's KV source (S2 / S8 / S14 at ratio 2, S20 at ratio 1),
                  chosen by the layer's index source; entry j visible iff j < (i + 1) // ratio

The caller says where the window keys of earlier tokens live (``LocalKeys``: a ring or nothing) and
owns the global entries (``EntryStore`` per KV source). This module never decides *which* run a
token belongs to; that is the plan's job (reference.py) or the request's (incremental.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from flashtier.engine.model.attention import sparse_attention
from flashtier.engine.model.block import Block
from flashtier.engine.model.compressor import PartialGroup
from flashtier.engine.model.indexer import candidate_pool, index_scores, select_topk
from flashtier.engine.model.numerics import qdq
from flashtier.kernels.quant.fp4 import fp4_qdq
from flashtier.kernels.quant.fp8 import fp8_qdq
from flashtier.kernels.quant.mxfp4 import mxfp4_qdq


@dataclass
class LocalKeys:
    """Window keys of earlier tokens a run of queries may also see: kv [K, hd], pos [K] (-1 = empty)."""

    kv: torch.Tensor
    pos: torch.Tensor
    start: int = 0  # window truncation: keys before this position are invisible

    @staticmethod
    def empty(
        head_dim: int, start: int = 0, device: torch.device | None = None, dtype: torch.dtype = torch.float32
    ) -> "LocalKeys":
        return LocalKeys(
            torch.zeros(0, head_dim, device=device, dtype=dtype),
            torch.zeros(0, dtype=torch.long, device=device),
            start,
        )


class GlobalEntries(Protocol):
    """One KV source's global entries as a sequence sees them (contiguous here, paged in the engine).

    ``write`` takes the RAW values (rotated latent, rotated index key) and stores what the format
    holds; readers get the dequantised values (FP4 main KV, MXFP4 index K), identical in every store.
    """

    count: int

    def index_keys(self, n: int) -> torch.Tensor: ...  # [n, ID] dequantised

    def main_rows(self, idx: torch.Tensor) -> torch.Tensor: ...  # [..., hd] dequantised, idx >= 0

    def write(self, entries: torch.Tensor, main_raw: torch.Tensor, index_raw: torch.Tensor) -> None: ...


class EntryStore:
    """Contiguous global entries of one KV source: main KV [cap, hd] and indexer K [cap, ID].

    Holds the quantise-dequantised values. Entries are written in order; ``count`` is the number
    of valid entries.
    """

    def __init__(
        self,
        capacity: int,
        head_dim: int,
        index_dim: int,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.main = torch.zeros(capacity, head_dim, device=device, dtype=dtype)
        self.index_k = torch.zeros(capacity, index_dim, device=device, dtype=dtype)
        self.count = 0

    def index_keys(self, n: int) -> torch.Tensor:
        return self.index_k[:n]

    def main_rows(self, idx: torch.Tensor) -> torch.Tensor:
        return self.main[idx]

    def write(self, entries: torch.Tensor, main_raw: torch.Tensor, index_raw: torch.Tensor) -> None:
        """Store entries at indices ``entries`` [G] (consecutive, starting at or below ``count``)."""
        if entries.numel() == 0:
            return
        first, last = int(entries[0]), int(entries[-1])
        assert first <= self.count and last - first + 1 == entries.numel(), "entries must be appended in order"
        if last >= self.main.shape[0]:
            self._grow(last + 1)
        self.main[first : last + 1] = qdq(fp4_qdq, main_raw)
        self.index_k[first : last + 1] = qdq(mxfp4_qdq, index_raw)
        self.count = max(self.count, last + 1)

    def truncate(self, count: int) -> None:
        self.count = min(self.count, count)

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.main.shape[0], 16)
        for name in ("main", "index_k"):
            old = getattr(self, name)
            new = torch.zeros(cap, old.shape[1], device=old.device, dtype=old.dtype)
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def clone(self) -> "EntryStore":
        other = EntryStore.__new__(EntryStore)
        other.main, other.index_k, other.count = self.main.clone(), self.index_k.clone(), self.count
        return other


@dataclass
class StepSlots:
    """Per-run shared slots, written by source layers before consumers read them in layer order."""

    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index-source layer -> [T, k]
    pool: torch.Tensor | None = None  # layer 20's candidate mask [T, E]


def compute_entries(
    block: Block, h: torch.Tensor, pos: torch.Tensor, partial: PartialGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PartialGroup | None]:
    """A KV-source layer's new global entries from its attention input h [T, D] at positions pos.

    Returns (entry indices [G], raw main KV [G, hd] (RoPE at j*ratio), raw index K [G, ID], new
    partial group); the store quantises (FP4 / MXFP4) on write.
    """
    attn = block.attn
    comp = attn.compressor
    latents, entries, partial = comp.latents(h, pos, partial)
    if entries.numel() == 0:
        empty = latents.new_zeros(0, attn.head_dim), latents.new_zeros(0, attn.indexer.head_dim)
        return entries, empty[0], empty[1], partial
    epos = entries * comp.ratio
    main = attn.rope.apply(latents, epos)
    index_k = attn.indexer.project_k_raw(latents, epos)
    return entries, main, index_k, partial


def attend(
    block: Block,
    h: torch.Tensor,
    q: torch.Tensor,
    qr: torch.Tensor,
    kv: torch.Tensor,
    pos: torch.Tensor,
    local: LocalKeys,
    stores: Mapping[int, GlobalEntries],
    slots: StepSlots,
    *,
    window: int,
    partial: PartialGroup | None = None,
    write_from: int | None = None,
) -> tuple[torch.Tensor, PartialGroup | None]:
    """The attention core of one sequence's run of queries at consecutive positions ``pos`` [T].

    h [T, D] is the attention input, q [T, H, hd] / qr the projected queries, kv [T, hd] these
    tokens' (dequantised) window KV. Mutates ``stores`` (a ratio-2 source layer appends the entries
    its tokens complete, only for positions >= ``write_from``; ``None`` = never, used for layer 20
    whose entries are projected separately) and ``slots``. Returns (o [T, H, hd], new partial group).
    """
    role = block.role
    attn = block.attn
    gkv = gmask = None
    if role.ratio > 0:
        if role.role == "full" and write_from is not None:
            sel = pos >= write_from
            entries, main, index_k, partial = compute_entries(block, h[sel], pos[sel], partial)
            stores[role.index].write(entries, main, index_k)
        store = stores[role.kv_source]
        visible = torch.div(pos + 1, role.ratio, rounding_mode="floor")
        n_vis = int(visible.max())
        assert store.count >= n_vis, f"layer {role.index}: {store.count} entries stored, {n_vis} needed"
        if role.role in ("full", "reindex"):
            qi, w = attn.indexer.project_q(qr, h, pos)
            scores = index_scores(qi, w, store.index_keys(n_vis))
            cfg = block.cfg
            allowed = None
            if role.role == "full" and role.index == cfg.candidate_source_layer_id:
                slots.pool = candidate_pool(scores, visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)
            elif role.role == "reindex":
                assert slots.pool is not None, "a reindex layer runs before the candidate source"
                allowed = slots.pool
            slots.topk[role.index] = select_topk(scores, visible, cfg.index_topk, allowed)
        idx = slots.topk[role.index_source]
        gmask = idx >= 0
        gkv = store.main_rows(idx.clamp(min=0))

    keys = torch.cat((local.kv.to(kv.dtype), kv))
    kpos = torch.cat((local.pos, pos))
    lo = torch.clamp(pos - window + 1, min=local.start)
    mask = (kpos[None, :] >= lo[:, None]) & (kpos[None, :] <= pos[:, None]) & (kpos[None, :] >= 0)
    return sparse_attention(q, keys, mask, gkv, gmask, attn.attn_sink, attn.scale), partial


def layer_forward(
    block: Block,
    x: torch.Tensor,
    pre_in: torch.Tensor,
    pos: torch.Tensor,
    local: LocalKeys,
    stores: Mapping[int, GlobalEntries],
    slots: StepSlots,
    *,
    window: int,
    partial: PartialGroup | None = None,
    write_from: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PartialGroup | None]:
    """Run layer ``block`` over one sequence's queries x [T, hc, D] at consecutive positions pos [T].

    See ``attend`` for what is mutated. Returns (x_out, pre_out, raw window KV of these tokens
    [T, hd] (to be quantised by whoever stores it), new partial group).
    """
    attn = block.attn
    h, amix = block.attn_input(x, pre_in)
    q, qr = attn.project_q(h, pos)
    kv_raw = attn.project_kv_raw(h, pos)
    o, partial = attend(
        block, h, q, qr, qdq(fp8_qdq, kv_raw), pos, local, stores, slots,
        window=window, partial=partial, write_from=write_from,
    )
    x, pre = block.finish(attn.output(o, pos), x, amix)
    return x, pre, kv_raw, partial


def project_decoder_entries(
    model, x: torch.Tensor, pre: torch.Tensor, pos: torch.Tensor, store: EntryStore, write_from: int
) -> None:
    """CED: the decoder's global entries (S20) from the encoder's final streams.

    Layer 20's ratio-1 compressor on layer 20's attention input, for positions >= ``write_from``
    (earlier entries come from the cache and are not overwritten). Mutates ``store``.
    """
    block = model.layers[model.cfg.decoder_source]
    sel = pos >= write_from
    if not bool(sel.any()):
        return
    h, _ = block.attn_input(x[sel], pre[sel])
    entries, main, index_k, _ = compute_entries(block, h, pos[sel], None)
    store.write(entries, main, index_k)
