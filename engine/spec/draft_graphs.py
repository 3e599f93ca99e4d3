"""CUDA graphs for the drafter's proposal of greedy batches: the DSpark stages and the Markov head's loop.

A proposal (spec/drafter.py) runs the three drafter stages over every drafting sequence's block of draft rows,
then, for each of the k drafts, the Markov head, the shared head over the vocabulary, the confidence head and
an argmax: some 500 kernel launches, launched from Python at every speculative step. For greedy sequences none
of it reads a value on the host, so it is captured once per (sequence bucket, k):

    B sequences, k drafts  ->  bucket Bb = the smallest size >= B (the decode graphs' sizes); graph k in it
    before the replay        static inputs rows 0..B-1 <- the sequences' rings (stacked), last tokens and
                             positions; rows B..Bb-1 <- pad rows (empty rings, token 0 at position 0)
    replay                   draft_rows -> k x (Markov bias, head logits, confidence, argmax)
    after                    drafts [B, k] and confidences [B, k] of rows 0..B-1 copied out

Pad rows see only their own draft rows (their rings hold no position), so they read nothing of a sequence; a
row's outputs depend on its own inputs only. A bucket's static inputs are shared by its k graphs; at most
``MAX_BUCKETS`` buckets are kept, the least recently used dropped beyond that. Sequences that sample (a
temperature) draw each draft from their own generator on the host's say-so and are proposed eagerly
(``Drafter.propose``). Without CUDA (``capture=False``) the same padded program runs eagerly: the CPU tests check
it against the eager proposal that way.

Not thread-safe: the engine thread owns it. Mutates only its own buffers. Failure: a capture error propagates.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from flashtier.engine.model.dspark import DSparkRings, confidence, draft_rows, head_logits, markov
from flashtier.engine.model.moe import MoE

MAX_BUCKETS = 16


@dataclass(frozen=True)
class DraftOutputs:
    """A graph's outputs: the greedy drafts [B, k] (int64) and their acceptance scores [B, k]."""

    drafts: torch.Tensor
    confidence: torch.Tensor


@dataclass
class _Bucket:
    ring_kv: torch.Tensor  # [stages, Bb, W, hd]
    ring_pos: torch.Tensor  # [stages, Bb, W] int64 (-1: empty)
    last: torch.Tensor  # [Bb] int64
    positions: torch.Tensor  # [Bb] int64
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, DraftOutputs]] = field(default_factory=dict)  # k -> captured


def greedy_drafts(model, x: torch.Tensor, last: torch.Tensor, k: int) -> DraftOutputs:
    """The Markov loop of a greedy proposal over the stages' output x [B, block, D]: draft i + 1 is the argmax
    of head(x_i) + the Markov bias of draft i (draft 0: ``last``). The ops ``Drafter.propose`` runs for a greedy
    row, in the same order. Reads only."""
    tokens, conf = [last], []
    for i in range(k):
        bias, me = markov(model, tokens[i])
        logits = (head_logits(model, x[:, i]) + bias).float()
        conf.append(confidence(model, x[:, i], me))
        tokens.append(logits.argmax(dim=-1))
    return DraftOutputs(torch.stack(tokens[1:], dim=1), torch.stack(conf, dim=1))


class DraftGraphs:
    def __init__(self, model, sizes: tuple[int, ...], *, capture: bool):
        """``sizes``: the sequence buckets (ascending; the largest is the most sequences a proposal may have);
        ``capture``: CUDA graphs (else the padded program runs eagerly)."""
        self.model, self.sizes, self.capture = model, tuple(sizes), capture
        cfg = model.cfg
        self.stages, self.window, self.head_dim = len(model.mtp), cfg.sliding_window, cfg.head_dim
        self._buckets: OrderedDict[int, _Bucket] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.runs = 0  # proposals that took this path
        self.captures = 0

    @staticmethod
    def supported(model) -> bool:
        """Whether the drafter's proposal can be captured: its stages' experts in the grouped kernels' formats
        (the float experts' reference loop groups tokens by expert on the host)."""
        return all(m.converted for m in model.mtp.modules() if isinstance(m, MoE))

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    @torch.no_grad()
    def run(self, rings: list[DSparkRings], last: torch.Tensor, positions: torch.Tensor, k: int) -> DraftOutputs:
        """Greedy drafts [B, k] and confidences for the B sequences of ``rings`` (each ring holding its sequence's
        real positions up to ``positions[b] - 1``), ``last`` [B] their last tokens. Copies: valid after the next
        run. Mutates the bucket's static inputs (and captures its graph k at first use)."""
        b = len(rings)
        bucket = self._bucket(next(s for s in self.sizes if s >= b))
        bucket.ring_kv[:, :b].copy_(torch.stack([r.kv for r in rings], dim=1))
        bucket.ring_pos[:, :b].copy_(torch.stack([r.pos for r in rings], dim=1))
        bucket.ring_pos[:, b:].fill_(-1)
        bucket.last[:b].copy_(last)
        bucket.last[b:].zero_()
        bucket.positions[:b].copy_(positions)
        bucket.positions[b:].zero_()
        self.runs += 1
        if not self.capture:
            out = self._program(bucket, k)
            return DraftOutputs(out.drafts[:b], out.confidence[:b])
        if k not in bucket.graphs:
            self._capture(bucket, k)
        graph, out = bucket.graphs[k]
        graph.replay()
        return DraftOutputs(out.drafts[:b].clone(), out.confidence[:b].clone())

    @torch.no_grad()
    def prepare(self, rows: int, k: int) -> bool:
        """Capture graph ``k`` of the bucket of ``rows`` sequences over pad rows, before a proposal needs it (the
        warm-up). Returns whether a graph was made."""
        size = next((s for s in self.sizes if s >= rows), None)
        if size is None or (size in self._buckets and k in self._buckets[size].graphs):
            return False
        bucket = self._bucket(size)
        if self.capture:
            self._capture(bucket, k)
        return True

    def _bucket(self, size: int) -> _Bucket:
        bucket = self._buckets.get(size)
        if bucket is None:
            while len(self._buckets) >= MAX_BUCKETS:
                self._buckets.popitem(last=False)
            dev, dtype = self.model.device, self.model.compute_dtype
            bucket = self._buckets[size] = _Bucket(
                torch.zeros(self.stages, size, self.window, self.head_dim, dtype=dtype, device=dev),
                torch.full((self.stages, size, self.window), -1, dtype=torch.long, device=dev),
                torch.zeros(size, dtype=torch.long, device=dev), torch.zeros(size, dtype=torch.long, device=dev))
        self._buckets.move_to_end(size)
        return bucket

    def _program(self, bucket: _Bucket, k: int) -> DraftOutputs:
        x = draft_rows(self.model, bucket.ring_kv, bucket.ring_pos, bucket.last, bucket.positions)
        return greedy_drafts(self.model, x, bucket.last, k)

    def _capture(self, bucket: _Bucket, k: int) -> None:
        """Warm up on a side stream (Triton compiles, the allocator settles), then capture (a capture records,
        it does not execute). The static inputs hold whatever the last run left: only their shapes matter."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._program(bucket, k)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._program(bucket, k)
        bucket.graphs[k] = (graph, out)
        self.captures += 1
