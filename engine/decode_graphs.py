"""CUDA graphs for the decoder part of a decode step: one graph per (batch bucket, block-table bucket).

A plain decode step runs one row per sequence through the 20 decoder layers; in eager mode that is ~2,700
kernel launches, and Python launching them is most of the step (benchmarks/host_sync_audit.py). The decoder
part has no host sync and no shape that depends on the step's data, so it is captured once per bucket and
replayed:

    rows B, table width mb  ->  bucket (Tb = smallest capture size >= B, MB = next power of two >= mb)
    static inputs [Tb, ...]  <-  rows 0..B-1: this step's StepRows / x / pre;  rows B..Tb-1: pad rows
    replay                   ->  logits [Tb, V];  rows 0..B-1 returned (a copy)

Pad rows read the null block (block 0, never allocated) and write their ring records only to the arena's
pad slot (``RingArena.pad_slot``, never handed out), so they touch no sequence's state. Every static
metadata row is rewritten at each replay (a row that was real in a bigger batch becomes a pad row again);
the pad rows' x / pre keep whatever finite values they last held, which only their own outputs read.

Eligibility: every decoder work is a DECODE of one row and nothing is tapped (no speculative capture);
replays and verifies (several rows per sequence) run eagerly. Graphs share one memory pool (they never run
at once). Without CUDA (``capture=False``) the same padded static path runs eagerly: the CPU tests check
the padding against the unpadded forward that way.

Not thread-safe: the engine thread owns it. Mutates: its static buffers, and what ``decode_rows`` mutates
(the decoder rings of the step's sequences, the pad slot's rings). Failure: a capture error propagates (the
first step of a bucket fails loudly rather than silently running a different program).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from flashtier.engine.model.batch_attention import PagedViews, indexer_impl
from flashtier.engine.model.paged_forward import decode_rows
from flashtier.engine.model.step_rows import StepRows
from flashtier.engine.model.transformer import Transformer

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_TABLE = 16  # smallest block-table bucket (blocks)
_ROW_FIELDS = ("positions", "row_seq", "last_rows", "block_table", "win_ring_row", "win_step_row",
               "win_from_step", "win_start", "win_count", "ring_src_rows", "ring_dst_rows", "ngram_tokens")


@dataclass
class _Bucket:
    rows: StepRows  # static metadata [Tb, ...]
    pad: StepRows  # the pad pattern (every row a pad row), copied over rows B..Tb-1 before each replay
    x: torch.Tensor  # [Tb, hc, D]
    pre: torch.Tensor  # [Tb, hc]
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # the graph's output [Tb, V]


def bucket_size(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest capture size >= n (None when n exceeds them all)."""
    return next((s for s in sizes if s >= n), None)


def table_bucket(mb: int) -> int:
    return max(MIN_TABLE, 1 << max(0, mb - 1).bit_length())


class DecodeGraphs:
    def __init__(self, model: Transformer, views: PagedViews, pad_slot: int, *, capture: bool,
                 max_rows: int = 64):
        """``pad_slot``: the arena slot pad rows write to; ``capture``: CUDA graphs (else the padded path runs
        eagerly); ``max_rows``: the largest batch that replays (bigger ones run eagerly)."""
        self.model, self.views, self.pad_slot, self.capture = model, views, pad_slot, capture
        self.sizes = tuple(s for s in CAPTURE_SIZES if s < max_rows) + (max_rows,)
        self.window = model.cfg.sliding_window
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.runs = 0  # steps that took this path (replays, or padded eager runs without capture)
        self.captures = 0

    @staticmethod
    def supported(model: Transformer) -> bool:
        """Whether the model's decoder can be captured: not with the reference indexer (index widths other than
        128, e.g. tiny), which checks its addresses on the host."""
        return indexer_impl(model.cfg.index_head_dim) != "reference"

    @property
    def num_graphs(self) -> int:
        return sum(b.graph is not None for b in self._buckets.values())

    def fits(self, rows: StepRows) -> bool:
        """Whether ``rows`` (one row per sequence) has a bucket."""
        t = rows.num_rows
        return t <= self.sizes[-1] and rows.last_rows.numel() == t and rows.ring_src_rows.numel() == t

    @torch.no_grad()
    def run(self, rows: StepRows, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the B rows (one per sequence), as ``decode_rows`` gives them. Mutates the decoder
        rings of the rows' sequences and the pad slot's."""
        b, mb = rows.num_rows, rows.block_table.shape[1]
        key = (bucket_size(b, self.sizes), table_bucket(mb))
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = self._new_bucket(*key, x, pre)
        self._load(bucket, rows, x, pre)
        self.runs += 1
        if not self.capture:
            return decode_rows(self.model, bucket.rows, self.views, bucket.x, bucket.pre)[:b]
        if bucket.graph is None:
            self._capture(bucket)
        bucket.graph.replay()
        return bucket.logits[:b].clone()  # the next replay overwrites the static output

    def _load(self, bucket: _Bucket, rows: StepRows, x: torch.Tensor, pre: torch.Tensor) -> None:
        b, mb = rows.num_rows, rows.block_table.shape[1]
        for name in _ROW_FIELDS:
            dst, src, pad = getattr(bucket.rows, name), getattr(rows, name), getattr(bucket.pad, name)
            dst[b:].copy_(pad[b:])
            if name == "block_table":
                dst[:b, mb:].zero_()
                dst[:b, :mb].copy_(src)
            else:
                dst[:b].copy_(src)
        bucket.x[:b].copy_(x)
        bucket.pre[:b].copy_(pre)

    def _new_bucket(self, tb: int, mbb: int, x: torch.Tensor, pre: torch.Tensor) -> _Bucket:
        pad = self._pad_rows(tb, mbb, x.device)
        rows = StepRows(**{f.name: getattr(pad, f.name).clone() if isinstance(getattr(pad, f.name), torch.Tensor)
                           else getattr(pad, f.name) for f in fields(StepRows)})
        return _Bucket(rows, pad, torch.zeros((tb, *x.shape[1:]), dtype=x.dtype, device=x.device),
                       torch.zeros((tb, *pre.shape[1:]), dtype=pre.dtype, device=pre.device))

    def _pad_rows(self, tb: int, mbb: int, dev: torch.device) -> StepRows:
        """``tb`` rows at position 0 of a sequence with no blocks, ringed in the pad slot."""
        w, n = self.window, self.model.cfg.engram_max_ngram_size
        row = torch.arange(tb, device=dev)
        col = torch.arange(w, device=dev)
        own = col == w - 1  # position 0's window holds only itself, from this step
        return StepRows(
            positions=torch.zeros(tb, dtype=torch.long, device=dev), row_seq=row.clone(), last_rows=row.clone(),
            block_table=torch.zeros((tb, mbb), dtype=torch.int32, device=dev),
            win_ring_row=(self.pad_slot * w + col).expand(tb, w).contiguous(),
            win_step_row=row[:, None].expand(tb, w).contiguous(),
            win_from_step=own.expand(tb, w).contiguous(),
            win_start=torch.full((tb,), w - 1, dtype=torch.int32, device=dev),
            win_count=torch.ones(tb, dtype=torch.int32, device=dev),
            ring_src_rows=row.clone(), ring_dst_rows=torch.full((tb,), self.pad_slot * w, device=dev),
            ngram_tokens=torch.full((tb, n), -1, dtype=torch.long, device=dev), writes={},
        )

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up on a side stream (Triton compiles, allocator settles), then capture; the static rows hold
        the current step's rows, which the capture does not run (a capture records, it does not execute)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        saved = {n: getattr(bucket.rows, n).clone() for n in _ROW_FIELDS}
        for name in _ROW_FIELDS:  # the warm-up runs pad rows only: it writes nothing but the pad slot
            getattr(bucket.rows, name).copy_(getattr(bucket.pad, name))
        with torch.cuda.stream(side):
            decode_rows(self.model, bucket.rows, self.views, bucket.x, bucket.pre)
        torch.cuda.current_stream().wait_stream(side)
        for name in _ROW_FIELDS:
            getattr(bucket.rows, name).copy_(saved[name])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.logits = decode_rows(self.model, bucket.rows, self.views, bucket.x, bucket.pre)
        bucket.graph = graph
        self.captures += 1
