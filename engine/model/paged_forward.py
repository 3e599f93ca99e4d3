"""The step's forward over the paged stores with every op batched over all rows (the GPU engine's path).

Same layer sequence as ``batch_forward`` (which stays the per-sequence path: the contiguous incremental
model and steps holding a sequence outside the ring arena use it), but attention runs through
``batch_attention.attend_rows`` and the per-part bookkeeping (Engram n-grams, the decoder's S20 entries,
partial groups) is gathered from the host-built ``StepRows``. Nothing here loops over sequences except the
host-side updates of the sequences' Python state between layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashtier.engine.model.batch_attention import PagedViews, RowSlots, attend_rows
from flashtier.engine.model.batch_entries import write_entries
from flashtier.engine.model.batch_forward import SequenceKV
from flashtier.engine.model.engram_offload import prefetch_engram
from flashtier.engine.model.mhc import identity_pre
from flashtier.engine.model.step_rows import StepRows
from flashtier.engine.model.transformer import Transformer


def ngram_classes(model: Transformer, rows: StepRows) -> torch.Tensor:
    """Engram classes [T, n] of the rows (the pad class before position 0)."""
    pad = model.token_map[model.cfg.engram_pad_token_id]
    ids = rows.ngram_tokens
    return torch.where(ids >= 0, model.token_map[ids.clamp(min=0)], pad)


def _install_partials(states: Sequence[SequenceKV], rows: StepRows, slots: RowSlots) -> None:
    for src, opened in slots.opened.items():
        w = rows.writes[src]
        for b in w.consumed_seqs:
            states[b].partial[src] = None
        for b, group in zip(w.new_partial_seqs, opened):
            states[b].partial[src] = group


def run_layers(
    model: Transformer, layers: range, rows: StepRows, views: PagedViews, x: torch.Tensor, pre: torch.Tensor,
    *, encoder: bool, capture: dict[int, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, RowSlots]:
    """Layers ``layers`` over every row: (x, pre) [T, hc, D], [T, hc] -> their outputs. Mutates the rings and
    (encoder) the pool's entries; returns the part's selections and opened groups too. ``capture``: as in
    ``batch_forward.decode_batch``."""
    grams = ngram_classes(model, rows)
    prefetch_engram(model, layers, grams, rows.ngram_tokens_host)  # host tables: rows copied in ahead of use
    pos = rows.positions
    slots = RowSlots()
    for layer in layers:
        block = model.layers[layer]
        attn = block.attn
        # Engram, DSpark capture, attention input and mix, projections
        a = block.enter(x, pre, grams, pos, capture, layer)
        x, h, amix, q, qr, kv_raw = a.x, a.h, a.amix, a.q, a.qr, a.kv_raw
        o = attend_rows(block, rows, views, slots, h, q, qr, kv_raw, encoder=encoder)
        x, pre = block.finish(attn.output(o, pos), x, amix)
    return x, pre, slots


@torch.no_grad()
def encode_rows(
    model: Transformer, states: Sequence[SequenceKV], rows: StepRows, views: PagedViews, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder over the part's rows (token ids [T]) and the decoder's S20 entries they complete.

    The states' ``tokens`` must already hold the rows. Mutates the encoder rings, the pool, the states'
    partial groups and entry counts. Returns the encoder outputs (x [T, hc, D], pre [T, hc]).
    """
    cfg = model.cfg
    x = model.embed_streams(ids)
    pre = identity_pre(ids.numel(), cfg.hc_mult, x.device, model.compute_dtype)
    x, pre, slots = run_layers(model, range(cfg.n_encoder_layers), rows, views, x, pre, encoder=True)
    _install_partials(states, rows, slots)
    src = cfg.decoder_source
    w = rows.writes[src]
    if not w.empty:  # CED: layer 20's ratio-1 compressor on its attention input, for every new token
        block = model.layers[src]
        h, _ = block.attn_input(x, pre)
        write_entries(block, h, w, views.main[src], views.index[src])
    for src, w in rows.writes.items():
        for state, n in zip(states, w.count_after):
            state.stores[src].count = n
    return x, pre


@torch.no_grad()
def decode_rows(
    model: Transformer, rows: StepRows, views: PagedViews, x: torch.Tensor, pre: torch.Tensor, *,
    capture: dict[int, torch.Tensor | None] | None = None, logit_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoder over the part's rows (encoder outputs x, pre); logits [B, V] of each sequence's last row
    (or of ``logit_rows``, when given). ``capture``: as in ``batch_forward.decode_batch``.

    Mutates the decoder rings."""
    cfg = model.cfg
    x, pre, _ = run_layers(model, range(cfg.n_encoder_layers, cfg.num_hidden_layers), rows, views, x, pre,
                           encoder=False, capture=capture)
    sel = rows.last_rows if logit_rows is None else logit_rows
    return model.logits(x[sel], pre[sel])

