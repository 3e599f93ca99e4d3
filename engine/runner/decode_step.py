"""A decode-shaped step in the fixed shape a CUDA graph replays: its inputs, built on the host, and its results
installed back into the sequences' Python state afterwards.

A decode-shaped step: every sequence feeds a few tokens through the encoder and decodes exactly those rows,
nothing else runs (no prefill chunk, no replay). A plain decode step feeds one token per sequence (a DECODE
work); a speculative step feeds the last token and its drafts (a VERIFY work of the same rows). Then the encoder
part's entry writes have one slot per row (``DenseWrites``: a completing row its real slot, an opening row the
null block's; a ratio-2 row's first token an earlier row of the step or the group its sequence opened before),
the decoder's input rows are the encoder's output rows in another order (``perm``), and what the step changes
on the host is known before it runs:

    before   tokens extended; StepRows of both parts (encoder: DenseWrites per KV source); the waiting first
             tokens of ratio-2 groups (a chunk starting at an odd position) as rows; the Engram n-gram tokens
    after    install(): the ratio-2 group a chunk's last row opens (an even position) from the rows' kv / gate
             outputs, consumed groups cleared, entry counts, the replay tails (the encoder outputs)

Not thread-safe: the engine thread owns the sequences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flashtier.engine.model.batch_forward import push_tail
from flashtier.engine.model.compressor import PartialGroup
from flashtier.engine.model.dense_entries import DenseWrites
from flashtier.engine.model.step_rows import StepRows
from flashtier.engine.kv.paged_kv import PagedSequence
from flashtier.engine.core.scheduler_output import DecoderKind, SchedulerOutput
from flashtier.engine.runner.step_metadata import RowSpan, build_step_rows, pinned_to


@dataclass(frozen=True)
class DecodeStep:
    """One decode-shaped step's inputs. Encoder rows: sequence b's rows ``[firsts[b], firsts[b] + lengths[b])``
    at positions ``positions[b]`` onwards; decoder rows in the decoder works' order, ``perm[i]`` the encoder
    row of decoder row i."""

    seqs: tuple[PagedSequence, ...]  # encoder order
    positions: tuple[int, ...]  # each sequence's first new position
    lengths: tuple[int, ...]  # each sequence's rows (1: a decode; more: a verified chunk)
    ids: torch.Tensor  # [T] token ids
    enc: StepRows  # writes: KV source -> DenseWrites
    dec: StepRows
    perm: torch.Tensor  # [T] int64
    counts: Mapping[int, tuple[int, ...]]  # KV source -> each sequence's entry count after the step

    @property
    def num_rows(self) -> int:
        return sum(self.lengths)

    @property
    def firsts(self) -> tuple[int, ...]:
        return _firsts(self.lengths)


def _firsts(lengths) -> tuple[int, ...]:
    """Each sequence's first row when sequences of ``lengths`` rows lie back to back."""
    return tuple(int(f) for f in np.cumsum([0, *lengths[:-1]]))


def is_decode_shaped(batch: SchedulerOutput) -> bool:
    """Every sequence of the step feeds some tokens and decodes exactly those rows: one (DECODE) or its VERIFY
    chunk; one work per sequence on each side. Reads only."""
    enc, dec = batch.encoder, batch.decoder
    if not dec or len(enc) != len(dec):
        return False
    fed = {id(w.seq.kv): len(w.tokens) for w in enc}
    if len(fed) != len(enc) or len({id(w.seq.kv) for w in dec}) != len(dec):
        return False
    return all(fed.get(id(w.seq.kv)) == w.rows and w.kind is not DecoderKind.REPLAY
               and (w.kind is not DecoderKind.DECODE or w.rows == 1) for w in dec)


def decode_rows_of(batch: SchedulerOutput) -> int:
    """The rows of a decode-shaped step (each part has this many)."""
    return sum(len(w.tokens) for w in batch.encoder)


def _dense(seqs: Sequence[PagedSequence], positions: Sequence[int], lengths: Sequence[int], src: int, ratio: int,
           per_block: int, hd: int, dev: torch.device) -> tuple[DenseWrites, tuple[int, ...]]:
    block, offset, epos, partner, counts, waiting_rows, waiting = [], [], [], [], [], [], []
    row = 0
    for kv, p0, r in zip(seqs, positions, lengths):
        count = kv.stores[src].count
        for p in range(p0, p0 + r):
            if ratio == 1 or p % 2:
                j = p // ratio
                block.append(kv.table.ids[j // per_block])
                offset.append(j % per_block)
                epos.append(j * ratio)
                count = max(count, j + 1)
                if ratio == 2 and p > p0:  # the pair's first token is the row before, in this step
                    partner.append(row - 1)
                elif ratio == 2:
                    group = kv.partial.get(src)
                    assert group is not None and group.position == p - 1, "ratio-2 group lost its first token"
                    partner.append(-1)
                    waiting_rows.append(row)
                    waiting.append(group)
            else:
                block.append(0)
                offset.append(0)
                epos.append(0)
                partner.append(-1)
            row += 1
        counts.append(count)
    wkv = wz = part = None
    if ratio == 2:
        wkv = torch.zeros((row, hd), dtype=torch.float32, device=dev)
        wz = torch.zeros_like(wkv)
        if waiting:
            idx = pinned_to(waiting_rows, dev)
            wkv[idx] = torch.stack([g.kv for g in waiting]).float()
            wz[idx] = torch.stack([g.score for g in waiting]).float()
        part = pinned_to(partner, dev)
    t = lambda v: pinned_to(v, dev)  # noqa: E731
    return DenseWrites(t(block), t(offset), t(epos), wkv, wz, part), tuple(counts)


def build_decode_step(batch: SchedulerOutput, window: int, ngram: int, sources: Mapping[int, tuple[int, int]],
                      head_dim: int, dev: torch.device) -> DecodeStep:
    """The step's inputs (``is_decode_shaped(batch)`` must hold). Mutates each sequence's ``tokens`` (the fed
    tokens appended), as the eager runner does before building its rows."""
    seqs, positions, lengths, ids = [], [], [], []
    for w in batch.encoder:
        kv = w.seq.kv
        assert kv.write_from <= len(kv.tokens), "a decode token below the cached prefix"
        assert len(w.tokens) <= window, "a chunk longer than the window (the rings keep its newest rows only)"
        positions.append(len(kv.tokens))
        lengths.append(len(w.tokens))
        kv.tokens.extend(w.tokens)
        seqs.append(kv)
        ids.extend(w.tokens)
    spans = [RowSpan(kv, p, p + r, kv.enc_start) for kv, p, r in zip(seqs, positions, lengths)]
    enc = build_step_rows(spans, window, ngram, dev)
    writes, counts = {}, {}
    for src, (ratio, per_block) in sources.items():
        writes[src], counts[src] = _dense(seqs, positions, lengths, src, ratio, per_block, head_dim, dev)
    enc = dataclasses.replace(enc, writes=writes)
    first_of = {id(kv): f for kv, f in zip(seqs, _firsts(lengths))}
    dec_spans, perm = [], []
    for w in batch.decoder:
        kv = w.seq.kv
        n = len(kv.tokens)
        dec_spans.append(RowSpan(kv, n - w.rows, n, kv.dec_start))
        perm.extend(range(first_of[id(kv)], first_of[id(kv)] + w.rows))
    dec = build_step_rows(dec_spans, window, ngram, dev)
    return DecodeStep(tuple(seqs), tuple(positions), tuple(lengths), pinned_to(ids, dev), enc, dec,
                      pinned_to(perm, dev), counts)


def install(step: DecodeStep, x: torch.Tensor, pre: torch.Tensor,
            opened: Mapping[int, tuple[torch.Tensor, torch.Tensor]], window: int) -> None:
    """After the step ran: the sequences' ratio-2 groups (opened by a last row at an even position, from
    ``opened[src]``'s rows; consumed otherwise), entry counts and replay tails (encoder outputs x [>=T, hc, D],
    pre). Mutates the sequences; the tensors may be a graph's static outputs (everything kept is copied out of
    them)."""
    firsts = step.firsts
    lasts = [(b, f + r - 1, p + r - 1) for b, (f, r, p) in enumerate(zip(firsts, step.lengths, step.positions))]
    even = [(b, row, p) for b, row, p in lasts if p % 2 == 0]
    idx = pinned_to([row for _, row, _ in even], x.device) if even else None
    for src, (kv_rows, z_rows) in opened.items():
        for kv in step.seqs:
            kv.partial[src] = None
        if idx is not None:
            g_kv, g_z = kv_rows[idx], z_rows[idx]  # one gather each: copies, views below
            for j, (b, _, p) in enumerate(even):
                step.seqs[b].partial[src] = PartialGroup(g_kv[j], g_z[j], p)
    for src, counts in step.counts.items():
        for kv, n in zip(step.seqs, counts):
            kv.stores[src].count = n
    t = step.num_rows
    xs, pres = x[:t].clone(), pre[:t].clone()
    for kv, f, r in zip(step.seqs, firsts, step.lengths):
        push_tail(kv, xs[f : f + r], pres[f : f + r], window)
