"""A plain decode step in the fixed shape a CUDA graph replays: its inputs, built on the host, and its results
installed back into the sequences' Python state afterwards.

A plain decode step: every sequence feeds one token through the encoder and decodes one row, nothing else runs
(no prefill chunk, no replay, no verify). Then the encoder part's entry writes have one slot per row
(``DenseWrites``: a completing row its real slot, an opening row the null block's), the decoder's input rows
are the encoder's output rows in another order (``perm``), and what the step changes on the host is known
before it runs:

    before   tokens extended; StepRows of both parts (encoder: DenseWrites per KV source); the waiting first
             tokens of ratio-2 groups (odd positions) as rows; the Engram n-gram tokens on the host
    after    install(): ratio-2 groups opened by even positions (from the rows' kv / gate outputs), consumed
             groups cleared, entry counts, the replay tails (the encoder outputs)

Not thread-safe: the engine thread owns the sequences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
    """One plain decode step's inputs (rows in encoder order; ``perm[i]``: the encoder row of decoder row i)."""

    seqs: tuple[PagedSequence, ...]  # encoder order
    positions: tuple[int, ...]  # each row's position
    ids: torch.Tensor  # [B] token ids
    enc: StepRows  # writes: KV source -> DenseWrites
    dec: StepRows
    perm: torch.Tensor  # [B] int64
    counts: Mapping[int, tuple[int, ...]]  # KV source -> each sequence's entry count after the step


def is_plain_decode(batch: SchedulerOutput) -> bool:
    """Every sequence of the step feeds exactly one token and decodes exactly that row."""
    enc, dec = batch.encoder, batch.decoder
    if not dec or len(enc) != len(dec) or any(len(w.tokens) != 1 for w in enc):
        return False
    if any(w.kind is not DecoderKind.DECODE or w.rows != 1 for w in dec):
        return False
    enc_ids = {id(w.seq.kv) for w in enc}
    return len(enc_ids) == len(enc) and enc_ids == {id(w.seq.kv) for w in dec}


def _dense(seqs: Sequence[PagedSequence], positions: Sequence[int], src: int, ratio: int, per_block: int,
           hd: int, dev: torch.device) -> tuple[DenseWrites, tuple[int, ...]]:
    block, offset, epos, counts, waiting_rows, waiting = [], [], [], [], [], []
    for b, (kv, p) in enumerate(zip(seqs, positions)):
        count = kv.stores[src].count
        if ratio == 1 or p % 2:
            j = p // ratio
            block.append(kv.table.ids[j // per_block])
            offset.append(j % per_block)
            epos.append(j * ratio)
            count = max(count, j + 1)
            if ratio == 2:
                group = kv.partial.get(src)
                assert group is not None and group.position == p - 1, "ratio-2 group lost its first token"
                waiting_rows.append(b)
                waiting.append(group)
        else:
            block.append(0)
            offset.append(0)
            epos.append(0)
        counts.append(count)
    wkv = wz = None
    if ratio == 2:
        wkv = torch.zeros((len(seqs), hd), dtype=torch.float32, device=dev)
        wz = torch.zeros_like(wkv)
        if waiting:
            idx = pinned_to(waiting_rows, dev)
            wkv[idx] = torch.stack([g.kv for g in waiting]).float()
            wz[idx] = torch.stack([g.score for g in waiting]).float()
    t = lambda v: pinned_to(v, dev)  # noqa: E731
    return DenseWrites(t(block), t(offset), t(epos), wkv, wz), tuple(counts)


def build_decode_step(batch: SchedulerOutput, window: int, ngram: int, sources: Mapping[int, tuple[int, int]],
                      head_dim: int, dev: torch.device) -> DecodeStep:
    """The step's inputs (``is_plain_decode(batch)`` must hold). Mutates each sequence's ``tokens`` (the fed
    token appended), as the eager runner does before building its rows."""
    seqs, positions, ids = [], [], []
    for w in batch.encoder:
        kv = w.seq.kv
        assert kv.write_from <= len(kv.tokens), "a decode token below the cached prefix"
        positions.append(len(kv.tokens))
        kv.tokens.extend(w.tokens)
        seqs.append(kv)
        ids.extend(w.tokens)
    spans = [RowSpan(kv, p, p + 1, kv.enc_start) for kv, p in zip(seqs, positions)]
    enc = build_step_rows(spans, window, ngram, dev)
    writes, counts = {}, {}
    for src, (ratio, per_block) in sources.items():
        writes[src], counts[src] = _dense(seqs, positions, src, ratio, per_block, head_dim, dev)
    enc = dataclasses.replace(enc, writes=writes)
    row_of = {id(kv): b for b, kv in enumerate(seqs)}
    dec_seqs = [w.seq.kv for w in batch.decoder]
    dec = build_step_rows([RowSpan(kv, len(kv.tokens) - 1, len(kv.tokens), kv.dec_start) for kv in dec_seqs],
                          window, ngram, dev)
    perm = pinned_to([row_of[id(kv)] for kv in dec_seqs], dev)
    return DecodeStep(tuple(seqs), tuple(positions), pinned_to(ids, dev), enc, dec, perm, counts)


def install(step: DecodeStep, x: torch.Tensor, pre: torch.Tensor,
            opened: Mapping[int, tuple[torch.Tensor, torch.Tensor]], window: int) -> None:
    """After the step ran: the sequences' ratio-2 groups (opened by even positions from ``opened[src]``'s rows,
    consumed by odd ones), entry counts and replay tails (encoder outputs x [>=B, hc, D], pre). Mutates the
    sequences; the tensors may be a graph's static outputs (everything kept is copied out of them)."""
    b = len(step.seqs)
    even = [i for i, p in enumerate(step.positions) if p % 2 == 0]
    idx = pinned_to(even, x.device) if even else None
    for src, (kv_rows, z_rows) in opened.items():
        for kv in step.seqs:
            kv.partial[src] = None
        if idx is not None:
            g_kv, g_z = kv_rows[idx], z_rows[idx]  # one gather each: copies, views below
            for j, i in enumerate(even):
                step.seqs[i].partial[src] = PartialGroup(g_kv[j], g_z[j], step.positions[i])
    for src, counts in step.counts.items():
        for kv, n in zip(step.seqs, counts):
            kv.stores[src].count = n
    xs, pres = x[:b].clone(), pre[:b].clone()
    for i, kv in enumerate(step.seqs):
        push_tail(kv, xs[i : i + 1], pres[i : i + 1], window)
