"""The drafter's proposal program (the Markov loop over the DSpark stages' output) and its CUDA graphs.

A proposal (spec/drafter.py) runs the three drafter stages over every drafting sequence's block of draft rows,
then, for each of the k drafts, the Markov head, the shared head over the vocabulary, the confidence head and
an argmax or a draw: some 500 kernel launches, launched from Python at every speculative step. None of it reads
a value on the host, so it is captured once per (sequence bucket, k, whether any sequence samples):

    B sequences, k drafts  ->  bucket Bb = the smallest size >= B (the decode graphs' sizes); graph (k, sampled)
    before the replay        static inputs rows 0..B-1 <- the sequences' rings (stacked), last tokens and
                             positions; rows B..Bb-1 <- pad rows (empty rings, token 0 at position 0); sampled:
                             each sampling row's temperature and its k noise rows, drawn from its generator
    replay                   draft_rows -> k x (Markov bias, head logits, confidence, argmax; sampled: also
                             q = softmax(logits / T) and the exponential race argmax(q / noise) for its rows)
    after                    drafts [B, k] and confidences [B, k] (and q [B, k, V]) of rows 0..B-1 copied out

A draw is the exponential race (``accept.draw``): token = argmax(q / noise), noise V exponentials per draft
position from the request's generator (the default one for a request without a seed), drawn before the program
runs (``draw_noise``) so that no draw reads the host and the eager program (``propose_rows``, a batch too large
for the graphs or an engine without them) and the graphs consume the generators alike. The sampled graphs'
buffers (noise and q, each [Bb, depth, V]) are made when the warm-up prepares the bucket's sampled graphs (or at
its first sampled proposal).

Pad rows see only their own draft rows (their rings hold no position), so they read nothing of a sequence; a
row's outputs depend on its own inputs only. A bucket's static inputs are shared by its graphs; at most
``MAX_BUCKETS`` buckets are kept, the least recently used dropped beyond that. Without CUDA
(``capture=False``) the same padded program runs eagerly: the CPU tests check it against the eager proposal
that way.

Not thread-safe: the engine thread owns it. Mutates only its own buffers. Failure: a capture error propagates.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from flashtier.engine.model.dspark import DSparkRings, confidence, draft_rows, head_logits, markov
from flashtier.engine.model.moe import MoE
from flashtier.engine.runner.decode_graphs import bucket_size

MAX_BUCKETS = 16


@dataclass(frozen=True)
class DraftOutputs:
    """A graph's outputs: the drafts [B, k] (int64), their acceptance scores [B, k] and, when any row samples,
    every row's draft distributions q [B, k, V] (only the sampling rows' are meaningful)."""

    drafts: torch.Tensor
    confidence: torch.Tensor
    q: torch.Tensor | None = None


@dataclass(frozen=True)
class DraftSampling:
    """The sampling rows of a proposal: ``rows`` (indices into the proposal's sequences), their temperatures and
    their noise [len(rows), k, V] (fp32 exponential draws, clamped to the smallest normal)."""

    rows: tuple[int, ...]
    temperature: tuple[float, ...]
    noise: torch.Tensor


@dataclass
class _Bucket:
    ring_kv: torch.Tensor  # [stages, Bb, W, hd]
    ring_pos: torch.Tensor  # [stages, Bb, W] int64 (-1: empty)
    last: torch.Tensor  # [Bb] int64
    positions: torch.Tensor  # [Bb] int64
    # sampled graphs only (made at the bucket's first sampled proposal): noise and q [Bb, depth, V], T [Bb],
    # mask [Bb]; graph k writes q[:, :k] (one q buffer for the bucket's graphs, not one each)
    noise: torch.Tensor | None = None
    q: torch.Tensor | None = None
    temperature: torch.Tensor | None = None
    sampled: torch.Tensor | None = None
    graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, DraftOutputs]] = field(default_factory=dict)


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


def sampled_drafts(model, x: torch.Tensor, last: torch.Tensor, k: int, noise: torch.Tensor,
                   temperature: torch.Tensor, sampled: torch.Tensor) -> DraftOutputs:
    """``greedy_drafts`` where the rows of ``sampled`` [B] (bool) draw instead: q = softmax(logits / T) and the
    draft argmax(q / noise[:, i]) (the exponential race of ``accept.draw_on_device`` over the given noise
    [B, >= k, V]); ``temperature`` [B] (1 on greedy rows). Returns q [B, k, V] too. Reads only."""
    tokens, conf, qs = [last], [], []
    for i in range(k):
        bias, me = markov(model, tokens[i])
        logits = (head_logits(model, x[:, i]) + bias).float()
        conf.append(confidence(model, x[:, i], me))
        q = (logits / temperature[:, None]).softmax(dim=-1)
        qs.append(q)
        tokens.append(torch.where(sampled, (q / noise[:, i]).argmax(dim=-1), logits.argmax(dim=-1)))
    return DraftOutputs(torch.stack(tokens[1:], dim=1), torch.stack(conf, dim=1), torch.stack(qs, dim=1))


def draw_noise(generators, k: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The sampling rows' noise [rows, k, V] fp32, clamped as ``accept.draw`` clamps it: a row with a generator
    (a seeded request) draws its k x V exponentials from it in one call, the rows without one share one call of
    the default generator (as the sampler's ``exponential_race`` does): 1 + seeded rows launches per proposal,
    not one per row and draft. Mutates the generators (their draws consumed)."""
    out = torch.empty(len(generators), k, vocab, dtype=torch.float32, device=device)
    unseeded = [j for j, gen in enumerate(generators) if gen is None]
    if unseeded:
        shared = torch.empty(len(unseeded), k, vocab, dtype=torch.float32, device=device).exponential_()
        out[torch.tensor(unseeded, device=device)] = shared
    for j, gen in enumerate(generators):
        if gen is not None:
            out[j].exponential_(generator=gen)
    return out.clamp_min_(torch.finfo(torch.float32).tiny)


def sampling_tensors(rows: int, k: int, vocab: int, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sampled_drafts``' input tensors for ``rows`` rows, every row greedy: noise [rows, k, V] of ones,
    temperature [rows] of ones, the sampled mask [rows] all False (``fill_sampling`` writes the drawing rows)."""
    noise = torch.ones(rows, k, vocab, dtype=torch.float32, device=device)
    temperature = torch.ones(rows, dtype=torch.float32, device=device)
    return noise, temperature, torch.zeros(rows, dtype=torch.bool, device=device)


def fill_sampling(sampling: DraftSampling, noise: torch.Tensor, temperature: torch.Tensor, mask: torch.Tensor
                  ) -> None:
    """Write ``sampled_drafts``' inputs in place: the sampling rows' noise (``noise`` [rows, >= k, V]; the other
    rows' noise is left as it is, ``sampled_drafts`` never reads it for them), every row's temperature (1 where
    greedy) and the sampled mask. Mutates the three tensors."""
    idx = torch.tensor(sampling.rows, dtype=torch.long, device=noise.device)
    noise[idx, : sampling.noise.shape[1]] = sampling.noise
    temperature.fill_(1.0)
    temperature[idx] = torch.tensor(sampling.temperature, dtype=torch.float32, device=noise.device)
    mask.zero_()
    mask[idx] = True


def propose_rows(model, x: torch.Tensor, last: torch.Tensor, k: int, sampling: DraftSampling | None
                 ) -> DraftOutputs:
    """The proposal over the stages' output x [B, block, D] of B sequences, unpadded and eager: greedy, or with
    ``sampling``'s rows drawing (q of every row returned). Reads only."""
    if sampling is None:
        return greedy_drafts(model, x, last, k)
    noise, temperature, mask = sampling_tensors(last.numel(), k, model.cfg.vocab_size, last.device)
    fill_sampling(sampling, noise, temperature, mask)
    return sampled_drafts(model, x, last, k, noise, temperature, mask)


class DraftGraphs:
    def __init__(self, model, sizes: tuple[int, ...], depth: int, *, capture: bool):
        """``sizes``: the sequence buckets (ascending; the largest is the most sequences a proposal may have);
        ``depth``: the most drafts a proposal asks for; ``capture``: CUDA graphs (else the padded program runs
        eagerly)."""
        self.model, self.sizes, self.depth, self.capture = model, tuple(sizes), depth, capture
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
    def run(self, rings: list[DSparkRings], last: torch.Tensor, positions: torch.Tensor, k: int,
            sampling: DraftSampling | None = None) -> DraftOutputs:
        """Drafts [B, k] and confidences for the B sequences of ``rings`` (each ring holding its sequence's real
        positions up to ``positions[b] - 1``), ``last`` [B] their last tokens; ``sampling``: the rows that draw
        (None: all greedy), with q of every row. Copies: valid after the next run. Mutates the bucket's static
        inputs (and captures its graph at first use)."""
        b = len(rings)
        assert 1 <= k <= self.depth, f"k must be in [1, {self.depth}], got {k}"
        bucket = self._bucket(bucket_size(b, self.sizes))
        sampled = sampling is not None
        if sampled:  # the pad rows (and greedy rows) get T = 1 and no draw
            self._sampling_buffers(bucket)
            fill_sampling(sampling, bucket.noise, bucket.temperature, bucket.sampled)
        bucket.ring_kv[:, :b].copy_(torch.stack([r.kv for r in rings], dim=1))
        bucket.ring_pos[:, :b].copy_(torch.stack([r.pos for r in rings], dim=1))
        bucket.ring_pos[:, b:].fill_(-1)
        bucket.last[:b].copy_(last)
        bucket.last[b:].zero_()
        bucket.positions[:b].copy_(positions)
        bucket.positions[b:].zero_()
        self.runs += 1
        if not self.capture:
            out = self._program(bucket, k, sampled)
            # q is a view of the bucket's buffer, which the next proposal overwrites: a copy, as after a replay
            return DraftOutputs(out.drafts[:b], out.confidence[:b], None if out.q is None else out.q[:b].clone())
        if (k, sampled) not in bucket.graphs:
            self._capture(bucket, k, sampled)
        graph, out = bucket.graphs[(k, sampled)]
        graph.replay()
        return DraftOutputs(out.drafts[:b].clone(), out.confidence[:b].clone(),
                            None if out.q is None else out.q[:b].clone())

    @torch.no_grad()
    def prepare(self, rows: int, k: int, sampled: bool = False) -> bool:
        """Make the bucket of ``rows`` sequences (with its sampling buffers when ``sampled``) and capture its graph
        (k, sampled) over pad rows, before a proposal needs it (the warm-up). Returns whether a graph was
        captured (never without CUDA)."""
        size = bucket_size(rows, self.sizes)
        if size is None or (size in self._buckets and (k, sampled) in self._buckets[size].graphs):
            return False
        bucket = self._bucket(size)
        if sampled:
            self._sampling_buffers(bucket)
        if self.capture:
            self._capture(bucket, k, sampled)
        return self.capture

    def _sampling_buffers(self, bucket: _Bucket) -> None:
        """The bucket's sampled-graph buffers, made once: noise and q [Bb, depth, V], every row greedy."""
        if bucket.noise is None:
            bucket.noise, bucket.temperature, bucket.sampled = sampling_tensors(
                bucket.last.numel(), self.depth, self.model.cfg.vocab_size, bucket.last.device)
            bucket.q = torch.zeros_like(bucket.noise)

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

    def _program(self, bucket: _Bucket, k: int, sampled: bool) -> DraftOutputs:
        x = draft_rows(self.model, bucket.ring_kv, bucket.ring_pos, bucket.last, bucket.positions)
        if not sampled:
            return greedy_drafts(self.model, x, bucket.last, k)
        out = sampled_drafts(self.model, x, bucket.last, k, bucket.noise, bucket.temperature, bucket.sampled)
        bucket.q[:, :k].copy_(out.q)  # the stacked q is freed: a capture's pool reuses it
        return DraftOutputs(out.drafts, out.confidence, bucket.q[:, :k])

    def _capture(self, bucket: _Bucket, k: int, sampled: bool) -> None:
        """Warm up on a side stream (Triton compiles, the allocator settles), then capture (a capture records,
        it does not execute). The static inputs hold whatever the last run left: only their shapes matter."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._program(bucket, k, sampled)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._program(bucket, k, sampled)
        bucket.graphs[(k, sampled)] = (graph, out)
        self.captures += 1
