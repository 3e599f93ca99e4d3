"""CUDA graphs for decode-shaped steps: one graph per (row bucket, block-table bucket, taps), encoder and decoder.

A decode-shaped step (engine/runner/decode_step.py: plain decode, one row per sequence, or speculative verify,
a chunk of rows per sequence) runs its rows through all 40 layers; eagerly that is ~5,500 kernel launches, and
Python launching them is most of the step (benchmarks/host_sync_audit.py). Its shapes do not depend on the
step's data once the rows are padded, so it is captured once per bucket:

    T rows, table width mb   ->  bucket (Tb = smallest capture size >= T, MB = next power of two >= 16, >= mb,
                                 the draft-input taps: none, or a speculative engine's target layers)
    before the replay        static inputs rows 0..T-1 <- this step's (DecodeStep), rows T..Tb-1 <- pad rows;
                             the Engram layers' host-table rows gathered and copied into the static feed
    replay                   embed -> encoder (dense entry writes) -> layer 20's entries -> decoder -> logits of
                             every row (and the taps' block inputs)
    after                    logits (and draft inputs) of rows 0..T-1 copied out; decode_step.install() (groups,
                             counts, tails)

Every row is addressed on its own (its position, block table, window columns, ring slot, entry slot), so the
same graph serves one row per sequence and a verified chunk of several: only the row count is a shape.

Pad rows each sit at position 0 of a sequence with no blocks: they read the null block (block 0, never allocated),
write their entries to its first slot and their ring records to the arena's ``pad_slot`` (never handed out),
so they touch no sequence's state. Every static metadata row is rewritten before each replay (a row that was
real in a bigger batch becomes a pad row again); the pad rows' Engram feed keeps finite stale values, which only
their own outputs read.

Graphs share one memory pool (they never run at once); at most ``MAX_GRAPHS`` buckets per set are kept, the least
recently used one dropped beyond that (a long-running server meets many table widths). Without CUDA (``capture=False``) the same padded static
program runs eagerly: the CPU tests check the padding against the eager step that way.

Not thread-safe: the engine thread owns it. Mutates: its static buffers, the arena rings and pool entries of
the step's sequences, the pad slot and the null block. Failure: a capture error propagates.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

import torch

from flashtier.engine.runner.decode_step import DecodeStep
from flashtier.engine.model.batch_attention import PagedViews, indexer_impl
from flashtier.engine.model.dense_entries import DenseWrites, write_dense
from flashtier.engine.model.engram_offload import prefetch_engram
from flashtier.engine.model.mhc import identity_pre
from flashtier.engine.model.moe import MoE
from flashtier.engine.model.paged_forward import decode_rows, run_layers
from flashtier.engine.model.step_rows import StepRows
from flashtier.engine.model.transformer import Transformer

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_TABLE = 16  # smallest block-table bucket (blocks)
MAX_GRAPHS = 32  # buckets kept per set (plain, verify; each bucket ~40 MB of static inputs and outputs at 64 rows)
# per-row fields copied in before each replay (``last_rows`` stays every row: the program's logits are all rows')
_ROW_FIELDS = ("positions", "row_seq", "block_table", "win_ring_row", "win_step_row", "win_from_step",
               "win_start", "win_count", "ring_src_rows", "ring_dst_rows", "ngram_tokens")
_WRITE_FIELDS = ("block", "offset", "entry_pos", "waiting_kv", "waiting_z", "partner")


@dataclass
class StepOutputs:
    """What the step program returns: logits [T, V] of every row (decoder order), encoder outputs, ratio-2 kv /
    gate rows, and with taps the draft inputs [T, n_taps, D] of every decoder row (else None)."""

    logits: torch.Tensor
    x: torch.Tensor
    pre: torch.Tensor
    opened: dict[int, tuple[torch.Tensor, torch.Tensor]]
    hidden: torch.Tensor | None = None


@dataclass
class _Bucket:
    ids: torch.Tensor  # [Tb]
    enc: StepRows  # static [Tb, ...]; writes: DenseWrites
    dec: StepRows
    perm: torch.Tensor  # [Tb]
    pad: tuple[StepRows, StepRows, torch.Tensor, torch.Tensor]  # the pad pattern of (enc, dec, perm, ids)
    feed: dict[int, torch.Tensor]  # Engram layer -> rows [Tb, H, hd] (host tables only)
    taps: tuple[int, ...] = ()  # layers whose block inputs the program returns (a speculative engine's)
    graph: torch.cuda.CUDAGraph | None = None
    out: StepOutputs | None = None
    real_rows: int = 0  # rows the last load filled with a step's values; rows from there on hold the pad pattern


def bucket_size(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest capture size >= n (None when n exceeds them all)."""
    return next((s for s in sizes if s >= n), None)


def table_bucket(mb: int) -> int:
    return max(MIN_TABLE, 1 << max(0, mb - 1).bit_length())


def _copy_rows(dst: torch.Tensor, src: torch.Tensor, pad: torch.Tensor, b: int, stale: int) -> None:
    """Rows 0..b-1 of ``dst`` <- ``src``; rows b..stale-1 (real in an earlier, bigger step) <- the pad pattern.
    Rows from ``stale`` on already hold it (the program never writes its inputs), so a steady batch copies its
    real rows only."""
    if stale > b:
        dst[b:stale].copy_(pad[b:stale])
    if dst.dim() == 2 and dst.shape[1] != src.shape[1]:  # a block table narrower than the bucket's
        dst[:b, src.shape[1] :].zero_()
        dst[:b, : src.shape[1]].copy_(src)
    else:
        dst[:b].copy_(src)


class DecodeGraphs:
    def __init__(self, model: Transformer, views: PagedViews, pad_slot: int, sources: dict[int, tuple[int, int]],
                 *, capture: bool, max_rows: int = 64, sizes: tuple[int, ...] = ()):
        """``pad_slot``: the arena slot pad rows write to; ``sources``: KV source -> (ratio, entries per block);
        ``capture``: CUDA graphs (else the padded program runs eagerly); ``max_rows``: the most rows a step
        may have (a batch of plain decodes, or of verified chunks); ``sizes``: the row buckets (default
        ``CAPTURE_SIZES``), cut at ``max_rows``, which is always one."""
        self.model, self.views, self.pad_slot, self.capture = model, views, pad_slot, capture
        self.sources = sources
        self.sizes = tuple(s for s in (sizes or CAPTURE_SIZES) if s < max_rows) + (max_rows,)
        cfg = model.cfg
        self.window, self.enc_layers = cfg.sliding_window, range(cfg.n_encoder_layers)
        self.host = next((b.engram.host for b in model.layers if b.engram is not None and b.engram.host), None)
        self._buckets: OrderedDict[tuple[int, int], _Bucket] = OrderedDict()  # least recently used first
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.runs = 0  # steps that took this path (replays, or padded eager runs without capture)
        self.captures = 0

    @staticmethod
    def supported(model: Transformer) -> bool:
        """Whether the model's step can be captured: its experts in the grouped kernels' formats (the float
        experts' reference loop groups tokens by expert on the host) and the Triton indexer (the reference, at
        index widths other than 128 such as tiny's, checks its addresses on the host)."""
        moes = [b.ffn for b in model.layers if isinstance(b.ffn, MoE)]
        return indexer_impl(model.cfg.index_head_dim) != "reference" and all(m.converted for m in moes)

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    @torch.no_grad()
    def prepare(self, rows: int, taps: tuple[int, ...] = (), table: int = MIN_TABLE) -> bool:
        """Make (and capture) the bucket a step of ``rows`` rows with ``taps`` and a block table of ``table``
        blocks replays, over pad rows only, before a step needs it (the warm-up: a speculative engine's verify
        set, which its throwaway batches do not reach). Returns whether a bucket was made. Mutates its buckets
        (the least recently used one dropped beyond ``MAX_GRAPHS``), the pad slot and the null block."""
        key = (bucket_size(rows, self.sizes), table_bucket(table), tuple(taps))
        if key[0] is None or key in self._buckets:
            return False
        self._make_room(key[2])
        bucket = self._buckets[key] = self._new_bucket(*key)
        if self.capture:
            self._capture(bucket)
        return True

    @torch.no_grad()
    def run(self, step: DecodeStep, taps: tuple[int, ...] = ()) -> StepOutputs:
        """The step's outputs (rows 0..T-1 valid; logits and draft inputs copies, the rest the bucket's static
        tensors, valid until the next run). ``taps``: the layers whose block inputs come back as draft inputs
        (empty: none). Mutates what the module docstring says."""
        t, mb = step.num_rows, max(step.enc.block_table.shape[1], step.dec.block_table.shape[1])
        key = (bucket_size(t, self.sizes), table_bucket(mb), tuple(taps))
        bucket = self._buckets.get(key)
        if bucket is None:
            self._make_room(key[2])
            bucket = self._buckets[key] = self._new_bucket(*key)
        self._buckets.move_to_end(key)
        self._load(bucket, step)
        self.runs += 1
        if not self.capture:
            with self._feeding(bucket):
                out = self._program(bucket)
            hidden = None if out.hidden is None else out.hidden[:t]
            return StepOutputs(out.logits[:t], out.x, out.pre, out.opened, hidden)
        if bucket.graph is None:
            self._capture(bucket)
        bucket.graph.replay()
        out = bucket.out
        hidden = None if out.hidden is None else out.hidden[:t].clone()
        return StepOutputs(out.logits[:t].clone(), out.x, out.pre, out.opened, hidden)

    def _make_room(self, taps: tuple[int, ...]) -> None:
        """Drop the least recently used buckets of the set of ``taps`` (plain or verify) until it holds fewer than
        ``MAX_GRAPHS``: one set's churn never evicts the other's graphs. Their graphs and buffers go with them."""
        same = [k for k in self._buckets if k[2] == taps]  # least recently used first
        for k in same[: max(0, len(same) - MAX_GRAPHS + 1)]:
            del self._buckets[k]

    @contextmanager
    def _feeding(self, bucket: _Bucket):
        """While the program runs outside a replay, the Engram layers read the bucket's static feed."""
        if self.host is not None:
            self.host.feed = bucket.feed
        try:
            yield
        finally:
            if self.host is not None:
                self.host.feed = None

    def _program(self, bucket: _Bucket) -> StepOutputs:
        """The whole step over the static inputs (what a graph records)."""
        model, cfg, views = self.model, self.model.cfg, self.views
        x = model.embed_streams(bucket.ids)
        pre = identity_pre(bucket.ids.numel(), cfg.hc_mult, x.device, model.compute_dtype)
        x, pre, slots = run_layers(model, self.enc_layers, bucket.enc, views, x, pre, encoder=True)
        src = cfg.decoder_source
        h, _ = model.layers[src].attn_input(x, pre)  # CED: layer 20's entries of every row
        write_dense(model.layers[src], h, bucket.enc.writes[src], views.main[src], views.index[src])
        capture = {layer: None for layer in bucket.taps} if bucket.taps else None
        logits = decode_rows(model, bucket.dec, views, x[bucket.perm], pre[bucket.perm], capture=capture)
        hidden = torch.stack([capture[layer] for layer in bucket.taps], dim=1) if capture else None
        return StepOutputs(logits, x, pre, slots.opened_rows, hidden)

    def _load(self, bucket: _Bucket, step: DecodeStep) -> None:
        b = step.num_rows
        stale, bucket.real_rows = bucket.real_rows, b
        pad_enc, pad_dec, pad_perm, pad_ids = bucket.pad
        for dst, src, pad in ((bucket.enc, step.enc, pad_enc), (bucket.dec, step.dec, pad_dec)):
            for name in _ROW_FIELDS:
                _copy_rows(getattr(dst, name), getattr(src, name), getattr(pad, name), b, stale)
        for layer, w in bucket.enc.writes.items():
            for name in _WRITE_FIELDS:
                if getattr(w, name) is not None:
                    _copy_rows(getattr(w, name), getattr(step.enc.writes[layer], name),
                               getattr(pad_enc.writes[layer], name), b, stale)
        _copy_rows(bucket.ids, step.ids, pad_ids, b, stale)
        _copy_rows(bucket.perm, step.perm, pad_perm, b, stale)
        if bucket.feed:  # the Engram rows of the real rows, gathered from the host tables as the eager step does
            key = step.enc.ngram_tokens
            prefetch_engram(self.model, self.enc_layers, key, step.enc.ngram_tokens_host)
            for layer, buf in bucket.feed.items():
                engram = self.model.layers[layer].engram
                buf[:b].copy_(self.host.take(layer, key, engram.rows))

    def _new_bucket(self, tb: int, mbb: int, taps: tuple[int, ...]) -> _Bucket:
        dev, cfg = self.model.device, self.model.cfg
        enc, dec = self._pad_rows(tb, mbb, dev, True), self._pad_rows(tb, mbb, dev, False)
        perm = torch.arange(tb, device=dev)
        feed = {}
        if self.host is not None:
            for layer in self.enc_layers:
                e = self.model.layers[layer].engram
                if e is not None:
                    feed[layer] = torch.zeros((tb, e.n_hashes, cfg.engram_head_dim), dtype=self.host.dtype,
                                              device=dev)
        ids = torch.zeros(tb, dtype=torch.long, device=dev)
        return _Bucket(ids.clone(), _clone(enc), _clone(dec), perm.clone(), (enc, dec, perm, ids), feed, taps)

    def _pad_rows(self, tb: int, mbb: int, dev: torch.device, encoder: bool) -> StepRows:
        """``tb`` rows, each at position 0 of its own sequence with no blocks, ringed in the pad slot."""
        w, n, hd = self.window, self.model.cfg.engram_max_ngram_size, self.model.cfg.head_dim
        row, col = torch.arange(tb, device=dev), torch.arange(w, device=dev)
        zeros = torch.zeros(tb, dtype=torch.long, device=dev)
        writes = {}
        if encoder:
            for src, (ratio, _) in self.sources.items():
                wait = torch.zeros((tb, hd), dtype=torch.float32, device=dev) if ratio == 2 else None
                partner = torch.full((tb,), -1, dtype=torch.long, device=dev) if ratio == 2 else None
                writes[src] = DenseWrites(zeros.clone(), zeros.clone(), zeros.clone(), wait,
                                          None if wait is None else wait.clone(), partner)
        return StepRows(
            positions=zeros.clone(), row_seq=row.clone(), last_rows=row.clone(),
            block_table=torch.zeros((tb, mbb), dtype=torch.int32, device=dev),
            win_ring_row=(self.pad_slot * w + col).expand(tb, w).contiguous(),
            win_step_row=row[:, None].expand(tb, w).contiguous(),
            win_from_step=(col == w - 1).expand(tb, w).contiguous(),  # position 0 sees only itself
            win_start=torch.full((tb,), w - 1, dtype=torch.int32, device=dev),
            win_count=torch.ones(tb, dtype=torch.int32, device=dev),
            ring_src_rows=row.clone(), ring_dst_rows=torch.full((tb,), self.pad_slot * w, device=dev),
            ngram_tokens=torch.full((tb, n), -1, dtype=torch.long, device=dev), writes=writes,
        )

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up on a side stream (Triton compiles, the allocator settles) with pad rows only (they write
        nothing but the pad slot and the null block), then capture the program over the step's rows (a capture
        records, it does not execute)."""
        saved = (bucket.enc, bucket.dec, bucket.perm)
        bucket.enc, bucket.dec, bucket.perm = _clone(bucket.pad[0]), _clone(bucket.pad[1]), bucket.pad[2].clone()
        try:
            with self._feeding(bucket):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._program(bucket)
                torch.cuda.current_stream().wait_stream(side)
                bucket.enc, bucket.dec, bucket.perm = saved
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    bucket.out = self._program(bucket)
        finally:
            bucket.enc, bucket.dec, bucket.perm = saved
        bucket.graph = graph
        self.captures += 1


def _clone(rows: StepRows) -> StepRows:
    """A copy of ``rows`` with fresh tensors (writes included)."""
    out = {f.name: getattr(rows, f.name) for f in fields(StepRows)}
    for name, v in out.items():
        if isinstance(v, torch.Tensor):
            out[name] = v.clone()
    out["writes"] = {k: replace(w, **{n: None if getattr(w, n) is None else getattr(w, n).clone()
                                      for n in _WRITE_FIELDS}) for k, w in rows.writes.items()}
    return StepRows(**out)
