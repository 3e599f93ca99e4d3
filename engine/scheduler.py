"""Continuous batching with one token budget per step (DESIGN §6); the owner of requests' lifecycles.

The scheduler owns the queues, the ``KVManager`` (blocks and bytes) and, optionally, a ``TierClient``;
it never calls the engine. Every status change goes through ``request_state.transition``.

Budget: every encoder token and every replay token counts; decode sequences come first (they are
latency-bound), then running prefills and replays, then admissions from the queue (preempted
requests first: they sit at its front). A decode that cannot get a block preempts the newest running
request (swap to the host, ``preemption.py``); with no victim left it preempts itself. With speculative
decoding a decoding sequence feeds a VERIFY chunk (``SpecPolicy.feed``: known tokens + drafts, at most the
goodput controller's draft length); short of blocks it verifies no draft before it preempts anyone. At draft
length 0 a sequence with a single known token feeds a plain DECODE work instead (the step can then replay a
CUDA graph).

A prefix hit admits a request with encoder bounded replay (plan (c) of the oracle)::

    positions  0 ............................ R-W ...... R ............... n
               [ cached full blocks (pinned, never written) ]
                                              [ replay   ][ new tokens     ]  encoder, window from R-W
Hits shorter than the window are not used (R >= W is required to replay). With tiers, admission pins
every HBM hit and starts a lookup; the request waits in LOADING (never blocking a step) until the
lookup is done and ``resume.py`` installs SSD blocks and a snapshot. A finished lookup calls
``on_lookup_done`` (from the tier I/O thread): the engine loop sleeps while nothing can run and wakes
on it, rather than stepping idly: an idle step loop holds the GIL and starves the lookup's reader
threads, each of which then waits a whole switch interval (5 ms) for it after every release.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashtier.engine.core.fork import fork
from flashtier.engine.kv.manager import KVManager
from flashtier.engine.grammar.constraint import GrammarState
from flashtier.engine.core.preemption import blocks_to_swap_in, swap_in, swap_out
from flashtier.engine.core.outputs import ResumeInfo
from flashtier.engine.core.request import FinishReason, Request, Sequence
from flashtier.engine.core.request_state import RUNNING, RequestStatus, transition
from flashtier.engine.tiers.resume import ResumeKind, install_resume, plan_resume
from flashtier.engine.core.scheduler_output import DecoderKind, DecoderWork, EncoderWork, SchedulerOutput
from flashtier.engine.spec.controller import SpecController
from flashtier.engine.spec.schedule import SpecPolicy
from flashtier.engine.tiers.client import TierClient
from flashtier.kvstore.block_hash import fork_chain, hash_blocks
from flashtier.kvstore.tenant import tag_of_salt

S = RequestStatus


@dataclass
class SchedulerStats:
    """Monotonic counters (tokens and events)."""

    preemptions: int = 0
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0


class Scheduler:
    def __init__(self, kvm: KVManager, *, max_num_seqs: int, token_budget: int, tiers: TierClient | None = None,
                 allow_replay: bool = True, speculative: SpecPolicy | None = None,
                 spec_control: SpecController | None = None):
        """``allow_replay`` False (resume policy exact-or-cold): a cached prefix without an exact
        snapshot is recomputed rather than resumed by an approximate bounded replay. ``speculative``:
        decoding sequences with drafter state verify their drafts (VERIFY work), at most
        ``spec_control.draft_length`` of them (read only; None: the policy's depth)."""
        self.kvm = kvm
        self.speculative = speculative
        self.spec_control = spec_control
        self.tiers = tiers
        self.allow_replay = allow_replay
        self.window = kvm.spec.window
        self.max_num_seqs, self.token_budget = max_num_seqs, token_budget
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.loading: list[Request] = []
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        # called with no arguments when a lookup this scheduler started finishes, on the tier I/O thread
        # (or here, if it finished before the callback was added): it must only wake the engine loop
        self.on_lookup_done: Callable[[], None] | None = None

    # ---- queue ------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a WAITING request. Mutates the queue and the registry."""
        assert req.status is S.WAITING and req.request_id not in self.requests
        self.requests[req.request_id] = req
        self.waiting.append(req)

    @property
    def num_running_seqs(self) -> int:
        """Live sequences of running requests (what the admission cap counts, with LOADING ones)."""
        return sum(len(r.live_seqs) for r in self.running)

    def abort(self, request_id: str) -> Request | None:
        """Abort in any state: every block (pinned hits, table, swapped state) is released.

        Mutates the request (FINISHED, choices "abort"), the pool and the queues. None if unknown.
        """
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = FinishReason.ABORT
            seq.swapped = None
            self.kvm.free(seq.kv)
        if self.tiers is not None:  # a lookup in flight completes on the I/O thread and gives its buffer back
            self.tiers.drop_lookup(req)
        self._finish(req)
        return req

    def _finish(self, req: Request) -> None:
        transition(req, S.FINISHED)
        req.finished_at = time.monotonic()
        for queue in (self.running, self.loading, self.waiting):
            if req in queue:
                queue.remove(req)
        del self.requests[req.request_id]

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block is referenced at least once per live table holding it,
        and no block outside the live tables is referenced (nothing leaks). Raises RuntimeError."""
        pool = self.kvm.pool
        pool.check_integrity()
        owners: dict[int, int] = {}
        for req in self.requests.values():
            for seq in req.live_seqs:
                for b in seq.kv.table.ids:
                    owners[b] = owners.get(b, 0) + 1
        for b, n in owners.items():
            if pool.blocks[b].ref_cnt < n:
                raise RuntimeError(f"block {b} is in {n} block tables but has ref count {pool.blocks[b].ref_cnt}")
        held = {b.block_id for b in pool.blocks if b.ref_cnt > 0 and not b.is_null}
        if held != owners.keys():
            raise RuntimeError(f"referenced blocks {sorted(held)} != blocks in live tables {sorted(owners)}")

    # ---- sequences --------------------------------------------------------------------------------
    def new_sequence(self, req: Request, index: int) -> Sequence:
        gen = None
        if req.params.seed is not None:
            gen = torch.Generator(device=self.kvm.spec.device).manual_seed(req.params.seed + index)
        constraint = req.params.constraint
        grammar = GrammarState(constraint) if constraint is not None else None
        return Sequence(index, self.kvm.new_kv(), gen, grammar=grammar, tenant=tag_of_salt(req.cache_salt))

    def start_decode(self, req: Request) -> None:
        """REPLAY -> DECODE once the replay produced the first logits; n > 1 forks the prompt's sequence.

        Mutates the request (state, seqs) and the pool. A child that gets no block is aborted.
        """
        transition(req, S.DECODE)
        parent = req.seqs[0]
        for i in range(1, req.params.n):
            child = self.new_sequence(req, i)
            if not fork(self.kvm, parent, child):
                child.finish_reason = FinishReason.ABORT
            req.seqs.append(child)

    def finish_seq(self, req: Request, seq: Sequence, reason: FinishReason, stop_token_id: int | None = None) -> None:
        """End a choice: snapshot at generation end, free its blocks; the last choice finishes the request."""
        seq.finish_reason, seq.stop_token_id = reason, stop_token_id
        if self.tiers is not None:
            self.tiers.snapshot(req, seq)
        self.kvm.free(seq.kv)
        if not req.live_seqs:
            self._finish(req)

    # ---- admission and resume ---------------------------------------------------------------------
    def _admit(self, req: Request) -> None:
        """WAITING -> PREFILL (prefix hit: bounded replay), or -> LOADING when tiers are attached."""
        seq = self.new_sequence(req, 0)
        req.seqs = [seq]
        bs = self.kvm.block_size
        hashes = hash_blocks(req.namespace, req.prompt, bs)
        matched = self.kvm.match_prefix(hashes)
        fork_block = None
        if self.allow_replay and len(matched) < len(hashes):
            # a conversation that went through a bounded replay continues on its replayed fork (approximate
            # blocks, never found as exact); resuming over them is a replay, reported as such
            forked = fork_chain(hashes, req.namespace, req.prompt, bs, len(matched))
            on_fork = self.kvm.match_prefix(forked)
            if len(on_fork) > len(matched):
                hashes, matched, fork_block = forked, on_fork, len(matched)
        req.fork_block = fork_block
        self.stats.prefix_queries_tokens += len(req.prompt)
        if self.tiers is not None:  # pin every HBM hit while the tiers are asked for more
            self.kvm.pin(matched)
            seq.kv.table.replace(matched)
            req.hashes, req.hbm_blocks = hashes, len(matched)
            req.lookup = self.tiers.start_lookup(req)
            if self.on_lookup_done is not None:
                req.lookup.add_done_callback(lambda _f, wake=self.on_lookup_done: wake())
            transition(req, S.LOADING)
            return
        r = len(matched) * bs
        k = len(matched) if r == self.window or (r > self.window and self.allow_replay) else 0
        self.kvm.pin(matched[:k])
        seq.kv.table.replace(matched[:k])
        seq.take_hashes(hashes, k, fork_block)
        if k:
            self._start_replay(req, seq, k * bs)
            req.hbm_tokens = k * bs
        self._enter_prefill(req)

    def _enter_prefill(self, req: Request) -> None:
        """-> PREFILL, recording the window state's provenance for the response."""
        kv = req.seqs[0].kv
        if not req.cached_tokens:
            req.resume = ResumeInfo("cold")
        elif kv.replayed_from is None:
            req.resume = ResumeInfo("exact")
        else:
            req.resume = ResumeInfo("replay", kv.replayed_from)
        transition(req, S.PREFILL)

    def _start_replay(self, req: Request, seq: Sequence, r: int) -> None:
        """Encoder bounded replay from a block-aligned cached prefix of ``r`` tokens (blocks in the table)."""
        seq.kv.rewind(req.prompt, r)
        req.prefilled = r - self.window
        req.cached_tokens = r
        if seq.kv.replayed_from is not None:  # from R = window the re-fed tokens are a plain (exact) recompute
            req.approximate_replay_tokens += self.window
        self.stats.prefix_hits_tokens += r

    def _resume(self, req: Request) -> bool:
        """LOADING -> PREFILL with the finished lookup installed; False (stay LOADING) if the pool is short."""
        lookup = req.lookup.result()
        plan = plan_resume(lookup, req.hbm_blocks, self.kvm.block_size)
        fresh = self.kvm.allocate(plan.num_new_blocks)
        if fresh is None:
            return False
        if lookup.fork is not None:  # the SSD blocks after the HBM hits follow a replayed fork
            req.hashes, req.fork_block = list(lookup.fork.hashes), lookup.fork.block
        seq = req.seqs[0]
        res = install_resume(self.kvm, seq, req.prompt, req.hashes, plan, fresh, allow_replay=self.allow_replay,
                             fork_block=req.fork_block)
        self.tiers.count_resume(plan, res)
        req.lookup = None
        if res.kind is ResumeKind.EXACT:
            req.prefilled = req.cached_tokens = res.cached_tokens
            req.snapshot_tokens = res.snapshot_tokens
            self.stats.prefix_hits_tokens += res.cached_tokens
        elif res.kind is ResumeKind.REPLAY:
            self._start_replay(req, seq, res.cached_tokens)
        req.hbm_tokens, req.ssd_tokens = res.hbm_tokens, res.ssd_tokens
        self._enter_prefill(req)
        return True

    def _swap_in(self, req: Request) -> bool:
        """PREEMPTED -> the state it left, blocks restored; False (stays queued) if the pool is short."""
        if self.kvm.num_free < blocks_to_swap_in(req.live_seqs):
            return False
        for seq in req.live_seqs:
            swap_in(self.kvm, seq)
        transition(req, req.resume_status)
        return True

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work. Mutates queues, states, tables, the pool and the requests' progress."""
        out = SchedulerOutput()
        budget = self.token_budget
        # 0. tier lookups that finished: LOADING -> PREFILL (a lookup in flight never blocks the step)
        for req in list(self.loading):
            if req.lookup.done() and self._resume(req):
                self.loading.remove(req)
                self.running.append(req)
        # 1. decode: one token per live sequence, oldest requests first
        for req in list(self.running):
            if req.status is S.DECODE and req in self.running:
                budget = self._schedule_decode(req, budget, out)
        # 2. running prefills / pending replays
        for req in list(self.running):
            budget = self._schedule_prompt(req, budget, out)
        # 3. admissions (preempted first: they sit at the queue front)
        while self.waiting and budget > 0 and self.num_running_seqs + len(self.loading) < self.max_num_seqs:
            req = self.waiting[0]
            if req.status is S.PREEMPTED:
                if not self._swap_in(req):
                    break
                self.waiting.popleft()
                self.running.append(req)
                if req.status is S.DECODE:
                    continue  # decodes next step
            else:
                self.waiting.popleft()
                self._admit(req)
                if req.status is S.LOADING:
                    self.loading.append(req)
                    continue
                self.running.append(req)
            budget = self._schedule_prompt(req, budget, out)
        out.num_tokens = self.token_budget - budget
        now = time.monotonic()
        for w in (*out.encoder, *out.decoder):  # a resume at P = n starts with its decoder replay
            if w.request.first_scheduled is None:
                w.request.first_scheduled = now
        return out

    def _schedule_decode(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        cap = self.spec_control.draft_length if self.spec_control is not None else None
        for seq in req.live_seqs:
            feed, n_drafts = ([seq.output[-1]], 0) if self.speculative is None else self.speculative.feed(
                req, seq, budget, cap)
            if budget < len(feed):
                break
            while not self.kvm.ensure_blocks(seq.kv, len(seq.kv.tokens) + len(feed)):
                if n_drafts:  # speculation never preempts: verify no draft first
                    feed, n_drafts = feed[: len(feed) - n_drafts], 0
                    continue
                victim = self._pick_victim(exclude=req)
                if victim is None:  # no victim left: preempt this request itself
                    return budget + self._preempt(req, out)
                budget += self._preempt(victim, out)
            out.encoder.append(EncoderWork(req, seq, feed))
            if seq.spec is None or (cap == 0 and len(feed) == 1):  # draft length 0, one token to feed: plain
                out.decoder.append(DecoderWork(req, seq, DecoderKind.DECODE))
            else:
                out.decoder.append(DecoderWork(req, seq, DecoderKind.VERIFY, tuple(feed[len(feed) - n_drafts :]),
                                               len(feed)))
            budget -= len(feed)
        return budget

    def _schedule_prompt(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        if req.status is S.PREFILL:
            return self._schedule_prefill(req, budget, out)
        if req.status is S.REPLAY:
            return self._schedule_replay(req, budget, out)
        return budget

    def _schedule_prefill(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        if req.prefilled == len(req.prompt):
            # resumed at P = n (the same prompt again: its prompt-end snapshot): no encoder token to feed, the
            # decoder replay reads the snapshot's replay tail
            transition(req, S.REPLAY)
            return self._schedule_replay(req, budget, out)
        if budget <= 0:
            return budget
        seq = req.seqs[0]
        chunk = min(len(req.prompt) - req.prefilled, budget)
        if not self.kvm.ensure_blocks(seq.kv, req.prefilled + chunk):
            return budget
        out.encoder.append(EncoderWork(req, seq, req.prompt[req.prefilled : req.prefilled + chunk]))
        req.prefilled += chunk
        req.computed_tokens += chunk
        budget -= chunk
        if req.prefilled == len(req.prompt):
            transition(req, S.REPLAY)
            budget = self._schedule_replay(req, budget, out)
        return budget

    def _schedule_replay(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        n = len(req.prompt)
        need = n - req.seqs[0].kv.replay_start(n)
        if need > budget and not out.empty:
            return budget  # next step (a replay longer than the whole budget runs alone)
        out.decoder.append(DecoderWork(req, req.seqs[0], DecoderKind.REPLAY))
        req.decoder_tokens += need
        return budget - need

    # ---- preemption -------------------------------------------------------------------------------
    def _pick_victim(self, exclude: Request) -> Request | None:
        for req in reversed(self.running):
            if req is not exclude and req.status in RUNNING:
                return req
        return None

    def _preempt(self, req: Request, out: SchedulerOutput) -> int:
        """Swap a request's sequences to the host (snapshotting them first), requeue it at the front.

        Victims are picked while decodes are scheduled (before any prefill of this step), so only
        decode work is dropped; returns the budget it had spent.
        """
        refund = out.drop(req)
        for seq in req.live_seqs:
            if self.tiers is not None:
                self.tiers.snapshot(req, seq)
            swap_out(self.kvm, seq)
        transition(req, S.PREEMPTED)
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.stats.preemptions += 1
        out.preempted.append(req.request_id)
        return refund
