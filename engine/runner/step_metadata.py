"""Builds the batched forward's ``StepRows`` for one part (encoder or decoder) of a step.

Host work proportional to the number of sequences and rows (Python ints the scheduler already knows:
positions, ring slots, write_from), plus one memcpy per sequence of its block table's int32 array (a 1M-token
context has 16K blocks: converting them from the Python list took ~0.5 ms per sequence and part, 33 ms for 64
sequences); one copy per field to the device, then the ``[T, W]`` window addressing is computed on the
device. The forward reads the result in every layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flashtier.engine.model.step_rows import EntryWrites, StepRows
from flashtier.engine.kv.paged_kv import PagedSequence


@dataclass(frozen=True)
class RowSpan:
    """One sequence's rows in a part: positions [start, end), window truncated at ``lo``."""

    kv: PagedSequence
    start: int
    end: int
    lo: int


_NUMPY = {torch.long: np.int64, torch.int32: np.int32}


def pinned_to(values, device: torch.device, dtype=torch.long) -> torch.Tensor:
    """Host values (ints, a list, a numpy array) as a ``dtype`` tensor on ``device``; on CUDA from pinned memory
    without waiting for the device."""
    if isinstance(values, np.ndarray) and values.dtype == _NUMPY.get(dtype) and values.flags.c_contiguous:
        host = torch.from_numpy(values)  # already in the wanted form (a block-table array): no conversion
    else:
        host = torch.as_tensor(np.asarray(values, dtype=np.int64)).to(dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    # A copy from pageable memory waits for the GPU to drain (36 such waits per step, benchmarks/
    # host_sync_audit.py); from pinned memory it is queued. The caching host allocator keeps the pinned block
    # until the copy has run, so the host may drop its reference at once.
    return host.pin_memory().to(device, non_blocking=True)


def _entry_writes(spans: Sequence[RowSpan], firsts: list[int], src: int, ratio: int, per_block: int,
                  device: torch.device) -> EntryWrites:
    rows, partner, pidx, epos, blk, off = [], [], [], [], [], []
    partials, new_rows, new_pos, new_seqs, consumed, counts = [], [], [], [], [], []
    for b, (span, first) in enumerate(zip(spans, firsts)):
        store, ids = span.kv.stores[src], span.kv.table.ids
        a = max(span.start, span.kv.write_from)
        count = store.count
        ps = range(a, span.end) if ratio == 1 else range(a | 1, span.end, 2)
        for p in ps:
            j = p // ratio
            rows.append(first + p - span.start)
            epos.append(j * ratio)
            blk.append(ids[j // per_block])
            off.append(j % per_block)
            if ratio == 2 and p - 1 < a:
                group = span.kv.partial.get(src)
                assert group is not None and group.position == p - 1, "ratio-2 group lost its first token"
                partner.append(-1)
                pidx.append(len(partials))
                partials.append(group)
                consumed.append(b)
            else:
                partner.append(first + p - 1 - span.start if ratio == 2 else -1)
                pidx.append(0)
            count = max(count, j + 1)
        if ratio == 2 and a < span.end and (span.end - 1) % 2 == 0:
            new_rows.append(first + span.end - 1 - span.start)
            new_pos.append(span.end - 1)
            new_seqs.append(b)
        counts.append(count)
    t = lambda v: pinned_to(v, device)  # noqa: E731
    return EntryWrites(t(rows), t(partner), t(pidx), t(epos), t(blk), t(off), tuple(partials), t(new_rows),
                       tuple(new_pos), tuple(new_seqs), tuple(consumed), tuple(counts))


def _ngram_tokens(spans: Sequence[RowSpan], n: int) -> np.ndarray:
    out = []
    for s in spans:
        hist = np.asarray([-1] * (n - 1) + s.kv.tokens[max(0, s.start - n + 1) : s.end], dtype=np.int64)
        hist = hist[len(hist) - (s.end - s.start) - (n - 1) :]
        out.append(np.stack([hist[n - 1 - k : len(hist) - k] for k in range(n)], axis=1))
    return np.concatenate(out)


def build_step_rows(
    spans: Sequence[RowSpan], window: int, ngram: int, device: torch.device,
    sources: Mapping[int, tuple[int, int]] | None = None,
) -> StepRows:
    """``ngram``: the Engram's n; ``sources``: KV source layer -> (ratio, entries per block) of the entries this
    part writes (encoder part). Reads ``kv.tokens`` (they must already hold the part's positions)."""
    w = window
    lengths = [s.end - s.start for s in spans]
    firsts = list(np.cumsum([0] + lengths[:-1]))
    pos_h = np.concatenate([np.arange(s.start, s.end) for s in spans])
    seq_h = np.repeat(np.arange(len(spans)), lengths)
    start_h = np.repeat([s.start for s in spans], lengths)
    first_h = np.repeat(firsts, lengths)
    lo_h = np.maximum(np.repeat([s.lo for s in spans], lengths), np.maximum(pos_h - w + 1, 0))
    slots = [s.kv.rings.slot for s in spans]
    base_h = np.repeat([sl * w for sl in slots], lengths)
    mb = max(1, max(len(s.kv.table) for s in spans))
    tables = np.zeros((len(spans), mb), dtype=np.int32)
    for i, s in enumerate(spans):  # one memcpy per sequence (its table's array), never a list of its ids
        tables[i, : len(s.kv.table)] = s.kv.table.array()
    src_rows, dst_rows = [], []
    for s, first, sl in zip(spans, firsts, slots):
        for p in range(max(s.start, s.end - w), s.end):
            src_rows.append(first + p - s.start)
            dst_rows.append(sl * w + p % w)

    pos, row_seq = pinned_to(pos_h, device), pinned_to(seq_h, device)
    start, first, base, lo = (pinned_to(v, device) for v in (start_h, first_h, base_h, lo_h))
    col = pos[:, None] - (w - 1) + torch.arange(w, device=device)[None, :]  # position of column j
    from_step = col >= start[:, None]
    step_row = (first[:, None] + col - start[:, None]).clamp(0, max(len(pos_h) - 1, 0))
    count = (pos - lo + 1).to(torch.int32)
    writes = {
        src: _entry_writes(spans, [int(f) for f in firsts], src, ratio, per_block, device)
        for src, (ratio, per_block) in (sources or {}).items()
    }
    grams = _ngram_tokens(spans, ngram)
    return StepRows(
        positions=pos, row_seq=row_seq, last_rows=pinned_to(np.cumsum(lengths) - 1, device),
        block_table=pinned_to(tables, device, torch.int32)[row_seq],
        win_ring_row=base[:, None] + torch.remainder(col, w), win_step_row=step_row, win_from_step=from_step,
        win_start=w - count, win_count=count,
        ring_src_rows=pinned_to(src_rows, device), ring_dst_rows=pinned_to(dst_rows, device),
        ngram_tokens=pinned_to(grams, device), writes=writes, ngram_tokens_host=torch.from_numpy(grams),
    )
