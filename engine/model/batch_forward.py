"""One forward step over a batch of sequences: per-token work batched, attention per sequence.

Everything that is per token (mHC, projections, MoE, Engram) runs once over the concatenation of all
sequences' new tokens; only ``attend`` (which keys a query sees) runs per sequence, against that
sequence's own window rings and global entries. The same code serves the contiguous incremental
path (``incremental.py``) and the paged engine: a sequence is anything with the ``SequenceKV``
interface.

    tokens  seq A: a0 a1 a2 | seq B: b0 | seq C: c0 c1          -> x [6, hc, D]
    layer l:  attn_input, q/kv projections   [6 rows at once]
              attend(A, rows 0:3) attend(B, row 3) attend(C, rows 4:6)
              output projection, FFN           [6 rows at once]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from flashtier.engine.model.compressor import PartialGroup
from flashtier.engine.model.engram import ngram_ids
from flashtier.engine.model.layer_forward import GlobalEntries, LocalKeys, StepSlots, attend, project_decoder_entries
from flashtier.engine.model.mhc import identity_pre
from flashtier.engine.model.numerics import qdq
from flashtier.engine.model.transformer import Transformer
from flashtier.kernels.quant.fp8 import fp8_qdq


class SequenceKV(Protocol):
    """What a sequence carries between steps, whatever its storage."""

    tokens: list[int]  # every token fed to the encoder
    enc_start: int  # encoder window truncation (encoder bounded replay start)
    dec_start: int  # decoder window truncation (decoder bounded replay start)
    write_from: int  # global entries of positions below this come from the cache
    partial: dict[int, PartialGroup | None]  # ratio-2 source layer -> partial group
    stores: Mapping[int, GlobalEntries]  # KV source layer -> its entries
    tail_x: torch.Tensor | None  # encoder outputs of the newest `window` tokens [<=W, hc, D]
    tail_pre: torch.Tensor | None

    def ring_keys(self, layer: int, start: int) -> LocalKeys: ...

    def ring_write(self, layer: int, kv_raw: torch.Tensor, pos: torch.Tensor) -> None: ...


def _segments(lengths: Sequence[int]) -> list[slice]:
    out, at = [], 0
    for n in lengths:
        out.append(slice(at, at + n))
        at += n
    return out


def _run_layers(
    model: Transformer,
    layers: range,
    states: Sequence[SequenceKV],
    x: torch.Tensor,
    pre: torch.Tensor,
    positions: Sequence[torch.Tensor],
    ngrams: torch.Tensor,
    encoder: bool,
    capture: dict[int, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = model.cfg
    segs = _segments([p.numel() for p in positions])
    pos_all = torch.cat(list(positions))
    slots = [StepSlots() for _ in states]
    for layer in layers:
        block = model.layers[layer]
        attn = block.attn
        # Engram, DSpark capture, attention input and mix, projections
        a = block.enter(x, pre, ngrams, pos_all, capture, layer)
        x, h, amix, q, qr, kv_raw = a.x, a.h, a.amix, a.q, a.qr, a.kv_raw
        kv = qdq(fp8_qdq, kv_raw)
        o = torch.empty_like(q)
        for i, (state, seg) in enumerate(zip(states, segs)):
            start = state.enc_start if encoder else state.dec_start
            o[seg], part = attend(
                block, h[seg], q[seg], qr[seg], kv[seg], positions[i], state.ring_keys(layer, start),
                state.stores, slots[i], window=cfg.sliding_window,
                partial=state.partial.get(layer) if encoder else None,
                write_from=state.write_from if encoder else None,
            )
            if encoder and layer in state.partial:
                state.partial[layer] = part
            state.ring_write(layer, kv_raw[seg], positions[i])
        x, pre = block.finish(attn.output(o, pos_all), x, amix)
    return x, pre


@torch.no_grad()
def encode_batch(
    model: Transformer, states: Sequence[SequenceKV], chunks: Sequence[Sequence[int]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run each sequence's new tokens through the encoder and project their decoder entries (S20).

    Mutates every state (tokens, encoder rings, stores, partial groups, replay tail). Returns per sequence the
    encoder outputs (x [L, hc, D], pre [L, hc]) of its new tokens.
    """
    cfg, dev, cdt = model.cfg, model.device, model.compute_dtype
    positions, grams, ids = [], [], []
    for state, chunk in zip(states, chunks):
        if not chunk:
            raise ValueError("every sequence in an encoder batch needs at least one token")
        start = len(state.tokens)
        state.tokens.extend(chunk)
        pos = torch.arange(start, start + len(chunk), device=dev)
        grams.append(_grams(model, state, pos))
        positions.append(pos)
        ids.append(torch.tensor(chunk, device=dev))
    ids_all = torch.cat(ids)
    x = model.embed_streams(ids_all)
    pre = identity_pre(ids_all.numel(), cfg.hc_mult, dev, cdt)
    x, pre = _run_layers(model, range(cfg.n_encoder_layers), states, x, pre, positions, torch.cat(grams), True)
    out = []
    for state, seg, pos in zip(states, _segments([p.numel() for p in positions]), positions):
        # CED: layer 20's ratio-1 compressor on its attention input, for every new token
        project_decoder_entries(model, x[seg], pre[seg], pos, state.stores[cfg.decoder_source], state.write_from)
        push_tail(state, x[seg], pre[seg], cfg.sliding_window)
        out.append((x[seg], pre[seg]))
    return out


def push_tail(state: SequenceKV, x: torch.Tensor, pre: torch.Tensor, window: int) -> None:
    """Keep the encoder outputs of the newest ``window`` tokens: the decoder replay's input."""
    if state.tail_x is None:
        state.tail_x, state.tail_pre = x[-window:].clone(), pre[-window:].clone()
    else:
        state.tail_x = torch.cat((state.tail_x, x))[-window:]
        state.tail_pre = torch.cat((state.tail_pre, pre))[-window:]


def _grams(model: Transformer, state: SequenceKV, pos: torch.Tensor) -> torch.Tensor:
    """Engram n-gram classes [T, N] for consecutive positions ``pos`` of ``state.tokens``.

    Only the N-1 tokens before ``pos[0]`` are needed; rows before position 0 get the pad class.
    """
    cfg = model.cfg
    n = cfg.engram_max_ngram_size
    first, last = int(pos[0]), int(pos[-1])
    hist = torch.tensor(state.tokens[max(0, first - n + 1) : last + 1], device=model.device)
    g = ngram_ids(model.token_map, hist, n, int(model.token_map[cfg.engram_pad_token_id]))
    return g[-pos.numel() :]


@torch.no_grad()
def decode_batch(
    model: Transformer,
    states: Sequence[SequenceKV],
    xs: Sequence[torch.Tensor],
    pres: Sequence[torch.Tensor],
    positions: Sequence[torch.Tensor],
    *,
    capture: dict[int, torch.Tensor | None] | None = None,
    logit_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run encoder outputs through the decoder; logits [B, V] of each sequence's LAST row (or of the rows
    ``logit_rows`` of the concatenation, when given).

    ``capture``: layer -> None entries are filled with that layer's block input, mean over the streams [T, D].
    Mutates the decoder rings of every state (and the top-k/pool slots of this step only).
    """
    cfg = model.cfg
    x, pre = torch.cat(list(xs)), torch.cat(list(pres))
    grams = torch.cat([_grams(model, s, p) for s, p in zip(states, positions)])
    x, pre = _run_layers(
        model, range(cfg.n_encoder_layers, cfg.num_hidden_layers), states, x, pre, positions, grams, False, capture
    )
    last = logit_rows
    if last is None:
        last = torch.tensor([s.stop - 1 for s in _segments([p.numel() for p in positions])], device=x.device)
    return model.logits(x[last], pre[last])
