"""Warm-up before serving: every kernel variant and CUDA graph the configured batch sizes need, compiled and
captured off the request path.

Triton compiles a kernel on its first call for each specialisation, and ``DecodeGraphs`` captures a graph on the
first decode step of each batch bucket: on a fresh process that put 40-58 s (measured on an H200) in front of the
first requests. ``warm_up`` runs throwaway requests through the real ``Engine.step()`` at each batch size, so the
prefill (chunked at the token budget), the first-token sampling and the captured decode steps all run once:

    the smallest b   b requests of one block + 8 tokens (distinct ids: no prefix sharing), 4 decode steps each
    every larger b   b requests of 8 tokens, 4 decode steps each: what a size adds is its decode graph (captured
                     at its first decode step) and its prefill chunk's row count; the per-token paths (a full
                     block, the window, the compressed entries) ran at the smallest size already. 8 tokens rather
                     than a block + 8 takes these batches from ~14.3K prefill tokens to ~1.7K at sizes 1..64
                     (a 28 s restart warm-up on an H100 prefilled ~40K throwaway tokens at ~1.4K tokens/s)
    the smallest b also with one prompt at a time of 4 blocks + 16 tokens and of exactly 4 blocks (beyond the
    sliding window: the compressed-KV and indexer paths; the token count and every count derived from it, the
    compressed entries included, on both sides of Triton's divisible-by-16 specialisation), of one full
    token budget (the largest prefill chunk) and of two budgets + one block + 8 (chunks that continue a
    context, the last one ragged, and a block table past the smallest decode bucket: on an H100 a 2,098-token
    first request after a warm-up without it took 7.9 s to its first token)

A speculative engine's verify steps replay a second set of graphs (the draft inputs returned too) that the
throwaway batches need not reach (the goodput controller may not draft in them): each of its row buckets is
captured over pad rows afterwards (``DecodeGraphs.prepare``, block tables of the smallest bucket), and so is
each of its drafter's graphs (``DraftGraphs.prepare``: every sequence bucket, draft length, greedy and sampled;
the sampled ones' noise and q buffers, which the memory plan counts, are made here).

The tiers are detached meanwhile (nothing reaches the SSD tier or the snapshot pool) and the scheduler's and the
engine's counters are restored afterwards, so /metrics starts from zero. The throwaway prompts' blocks stay in
the HBM prefix cache as free, evictable blocks under a namespace no client can reach (their salt holds a NUL,
which a request's ``cache_salt`` cannot). Block-table widths beyond the smallest bucket (contexts over 16
blocks) still capture on first use.

What the throwaway shapes cannot cover is kept out of the compiled variants instead: the kernels whose integer
arguments count the batch's tokens, pairs or tiles (the grouped MoE GEMM and its split-K reduce, the FP8 GEMM,
the invariant linear, the indexer's score and select passes) leave them unspecialised (their ``*_COUNTS``
tuples), so no combination of "== 1" and "divisible by 16" among a step's counts compiles a new variant. Without
that, the first batch of 64 after a full warm-up compiled 19 on the request path (H100). The indexer's block
pads follow the top-k and a floor of 64 chunks rather than the context's length, so a conversation crossing a
power of two no longer compiles its select passes anew. Other context-dependent variants (the sparse
attention's lengths, for one) have not been audited on a GPU.

The engine core's thread only, before it reports ready (engine/parallel/rank_worker.py). Failure: an exception from a step propagates (a warm-up that
fails would fail the first request the same way); the tiers are reattached first.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, fields

from flashtier.engine.engine import Engine
from flashtier.engine.sample.params import SamplingParams

log = logging.getLogger(__name__)

WARMUP_SALT = "\x00flashtier-warmup"  # a NUL: no request's cache_salt can name this namespace
DECODE_STEPS = 4  # the first decode step of a bucket captures its graph; the next ones replay it
SHORT_PROMPT = 8  # tokens per throwaway request above the smallest size (module docstring)


@dataclass(frozen=True)
class WarmUpReport:
    """What ``warm_up`` ran: the batch sizes in order and the seconds each took (the smallest one's includes its
    longer prompts, whose lengths ``long_prompts`` lists)."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    long_prompts: tuple[int, ...] = ()
    verify_graphs: int = 0  # a speculative engine's verify buckets and draft graphs captured over pad rows
    verify_s: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(self.seconds) + self.verify_s


def warmup_sizes(engine: Engine) -> tuple[int, ...]:
    """The decode batch sizes to warm: the graph buckets when the engine captures graphs, else the configured
    sizes (or 1 and the largest batch), each at most ``max_num_seqs``."""
    paged = engine.runner.paged
    graphs = paged.graphs if paged is not None else None
    cap = engine.config.max_num_seqs
    sizes = graphs.sizes if graphs is not None else (engine.config.cuda_graph_sizes or (1, cap))
    return tuple(sorted({min(s, cap) for s in sizes}))


def _long_prompts(engine: Engine) -> tuple[int, ...]:
    """The smallest batch's longer prompt lengths (module docstring): 4 blocks + 16 and exactly 4 blocks (every
    count derived from the length, the compressed entries at each ratio included, falls on both sides of
    Triton's divisible-by-16 specialisation), one full token budget and two budgets + one block + 8 (prefill
    chunks over an earlier chunk's context); each capped to what the model length and half the pool hold with
    its decode steps, distinct and ascending."""
    block = engine.kvm.layout.block_size
    cap = min(engine.max_model_len, engine.kvm.pool.num_usable * block // 2) - DECODE_STEPS - 1
    budget = engine.config.max_num_batched_tokens
    wanted = (4 * block + 16, 4 * block, budget, 2 * budget + block + 8)
    return tuple(sorted({min(n, cap) for n in wanted if min(n, cap) > block + 8}))


def _prepare_speculative_graphs(engine: Engine) -> tuple[int, float]:
    """A speculative engine's verify buckets, one per graph row size, and its drafter's graphs, one per sequence
    bucket, draft length and greedy / sampled (module docstring): (made, seconds)."""
    paged, taps = engine.runner.paged, engine.runner.taps
    graphs = paged.graphs if paged is not None else None
    if graphs is None or not taps:
        return 0, 0.0
    t0 = time.monotonic()
    made = sum(graphs.prepare(rows, taps) for rows in graphs.sizes)
    drafts = engine.drafter.graphs if engine.drafter is not None else None
    if drafts is not None:
        made += sum(drafts.prepare(rows, k, sampled) for rows in drafts.sizes
                    for k in range(1, engine.drafter.depth + 1) for sampled in (False, True))
    seconds = time.monotonic() - t0
    log.info("warm-up: %d verify and draft graphs in %.2f s", made, seconds)
    return made, seconds


def warm_up(engine: Engine, sizes: tuple[int, ...] | None = None) -> WarmUpReport:
    """Run the throwaway batches (module docstring). Mutates the engine's pool (cached throwaway blocks), its
    graphs (captured) and nothing a client sees. Leaves no request behind."""
    import xgrammar  # noqa: F401 - imported where first used (grammar/compiler.py); now, before any request
    sizes = tuple(sorted(warmup_sizes(engine) if sizes is None else sizes))
    block = engine.kvm.layout.block_size
    vocab = engine.model.cfg.vocab_size
    scheduler = engine.scheduler
    tiers, stats, prompt_tokens = scheduler.tiers, copy.copy(scheduler.stats), engine.prompt_tokens
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS, ignore_eos=True)
    long_prompts = _long_prompts(engine)
    seconds = []
    scheduler.tiers = None
    try:
        for b in sizes:
            t0 = time.monotonic()
            length = block + 8 if b == sizes[0] else SHORT_PROMPT
            for i in range(b):
                start = 1000 + (b * 7919 + i * 104729) % max(1, vocab - 2000)
                prompt = [(start + j) % vocab for j in range(length)]
                engine.add_request(f"warmup-{b}-{i}", prompt, params, cache_salt=WARMUP_SALT)
            while engine.has_unfinished():
                engine.step()
            if b == sizes[0]:
                for n in long_prompts:  # one at a time: each is its own shape of the prefill kernels
                    start = 3000 + n * 131
                    engine.add_request(f"warmup-long-{n}", [(start + j) % vocab for j in range(n)], params,
                                       cache_salt=WARMUP_SALT)
                    while engine.has_unfinished():
                        engine.step()
            seconds.append(time.monotonic() - t0)
            log.info("warm-up: batch %d in %.2f s", b, seconds[-1])
        verify_graphs, verify_s = _prepare_speculative_graphs(engine)
    finally:
        for rid in list(scheduler.requests):  # a failed step: nothing throwaway stays queued
            engine.abort(rid)
        scheduler.tiers = tiers
        for f in fields(stats):  # in place: whoever holds the stats object sees the restored values
            setattr(scheduler.stats, f.name, getattr(stats, f.name))
        engine.prompt_tokens = prompt_tokens
    report = WarmUpReport(tuple(sizes), tuple(seconds), long_prompts, verify_graphs, verify_s)
    log.info("warm-up: %d batch sizes (%s) in %.1f s", len(sizes), ",".join(map(str, sizes)), report.total_s)
    return report
