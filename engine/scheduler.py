"""Continuous batching with one token budget per step (DESIGN §6).

States: WAITING -> PREFILL (encoder, chunked) -> REPLAY (decoder bounded replay, yields the first
token) -> DECODE -> FINISHED; PREEMPTED when a decode step cannot get a block (private state and block
images go to the host, blocks are freed, the request resumes exactly); LOADING is reserved for tier
loads. One step = an encoder batch then a decoder batch::

    encoder batch  | prefill chunks (PREFILL) | one token per DECODE sequence |
    decoder batch  | replay segments (REPLAY) | one token per DECODE sequence |

Budget: every encoder token and every replay token counts; decode sequences come first (they are
latency-bound), then running prefills, then admissions from the queue.

A prefix hit admits a request with encoder bounded replay (plan (c) of the oracle)::

    positions  0 ............................ R-W ...... R ............... n
               [ cached full blocks (touched, never written) ]
                                              [ replay   ][ new tokens     ]  encoder, window from R-W
Hits shorter than the window are not used (R >= W is required to replay).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from flashtier.kvstore.block_hash import BlockHash, hash_block, hash_blocks
from flashtier.kvstore.block_pool import BlockPool

from .request import Request, RequestStatus, Sequence


@dataclass(frozen=True)
class EncoderWork:
    request: Request
    seq: Sequence
    tokens: list[int]  # a prompt chunk, or the one token a DECODE sequence feeds


@dataclass(frozen=True)
class DecoderWork:
    request: Request
    seq: Sequence
    kind: str  # "replay" | "decode"


@dataclass
class SchedulerOutput:
    """What one step runs (scheduler -> runner)."""

    encoder: list[EncoderWork] = field(default_factory=list)
    decoder: list[DecoderWork] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.encoder and not self.decoder


class Scheduler:
    """Owns the queues and the block accounting; the engine owns the requests' lifetimes."""

    def __init__(self, pool: BlockPool, *, block_size: int, window: int, max_num_seqs: int, token_budget: int,
                 new_sequence, swap_out, swap_in, start_lookup=None, apply_lookup=None):
        self.pool = pool
        self.block_size, self.window = block_size, window
        self.max_num_seqs, self.token_budget = max_num_seqs, token_budget
        self._new_sequence = new_sequence  # (request, index) -> Sequence with an empty KV state
        self._swap_out, self._swap_in = swap_out, swap_in  # engine callbacks (they touch the byte pool)
        # tiers (optional): start a resume lookup at admission, apply its result when it is done
        self._start_lookup, self._apply_lookup = start_lookup, apply_lookup
        self.waiting: deque[Request] = deque()
        self.loading: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    # ---- queue ----------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Forget a finished or aborted request; the engine has freed its blocks."""
        for queue in (self.running, self.loading, self.waiting):
            if request in queue:
                queue.remove(request)
                return

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.live_seqs) for r in self.running) + len(self.loading)

    # ---- blocks ---------------------------------------------------------------------------------
    def _ensure_blocks(self, seq: Sequence, upto_position: int) -> bool:
        """Grow the sequence's table to hold positions < ``upto_position``; False if the pool is short."""
        need = -(-upto_position // self.block_size) - len(seq.kv.table)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        for b in blocks:
            seq.kv.table.append(b.block_id)
        return True

    def blocks_of(self, seq: Sequence) -> list:
        return [self.pool.blocks[i] for i in seq.kv.table.ids]

    def free_seq(self, seq: Sequence) -> None:
        """Release a sequence's blocks (full ones stay cached, LRU). Mutates the pool and the table."""
        self.pool.free(self.blocks_of(seq))
        seq.kv.table.replace([])

    def cache_new_full_blocks(self, seq: Sequence, namespace: BlockHash) -> list[tuple[int, BlockHash]]:
        """Hash and register every block that became full (all streams written) since the last call.

        Returns the (block id, hash) pairs registered (the caller writes them through to SSD).
        """
        bs = self.block_size
        tokens = seq.kv.tokens
        new = []
        while (len(seq.hashes) + 1) * bs <= len(tokens) and len(seq.hashes) < len(seq.kv.table):
            k = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else namespace
            h = hash_block(parent, tokens[k * bs : (k + 1) * bs])
            seq.hashes.append(h)
            block_id = seq.kv.table.ids[k]
            self.pool.cache_full_block(self.pool.blocks[block_id], h)
            new.append((block_id, h))
        return new

    # ---- admission --------------------------------------------------------------------------------
    def _admit(self, req: Request) -> bool:
        """WAITING -> PREFILL: match the prompt's prefix in the pool, set up encoder bounded replay."""
        seq = self._new_sequence(req, 0)
        n, bs, w = len(req.prompt), self.block_size, self.window
        hashes = hash_blocks(req.namespace, req.prompt, bs)
        matched = self.pool.match_prefix(hashes)
        self.prefix_queries_tokens += n
        k = len(matched)
        if k * bs < w:
            k = 0
        r = k * bs
        req.seqs = [seq]
        if self._start_lookup is not None:
            # pin every HBM hit while the tiers are asked for more (SSD blocks, a snapshot)
            self.pool.touch(matched)
            seq.kv.table.replace([b.block_id for b in matched])
            req.hashes = hashes
            req.hbm_blocks = len(matched)
            req.lookup = self._start_lookup(req)
            req.status = RequestStatus.LOADING
            return True
        self.pool.touch(matched[:k])
        seq.kv.table.replace([b.block_id for b in matched[:k]])
        seq.hashes = list(hashes[:k])
        if r:
            self.setup_replay(req, seq, r)
            req.hbm_tokens = r
        req.status = RequestStatus.PREFILL
        return True

    def setup_replay(self, req: Request, seq: Sequence, r: int) -> None:
        """Encoder bounded replay from a block-aligned hit r >= window (the first r // bs blocks are in
        the table): keep their entries, re-encode [r - W, ...) with the window truncated at r - W."""
        start = r - self.window
        seq.kv.write_from, seq.kv.enc_start = r, start
        seq.kv.tokens = list(req.prompt[:start])
        for store in seq.kv.stores.values():
            store.count = r // (self.block_size // store.per_block)
        req.prefilled = start
        req.cached_tokens = r
        req.replayed_tokens += self.window
        self.prefix_hits_tokens += r

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget

        # 0. tier lookups that finished: LOADING -> PREFILL (a lookup in flight never blocks the step)
        for req in list(self.loading):
            if req.lookup.done() and self._apply_lookup(req):
                self.loading.remove(req)
                req.status = RequestStatus.PREFILL
                self.running.append(req)

        # 1. decode: one token per live sequence, oldest requests first; preempt the newest on shortage
        for req in list(self.running):
            if req.status is not RequestStatus.DECODE or req not in self.running:
                continue
            for seq in req.live_seqs:
                if budget < 1:
                    break
                pos = len(seq.kv.tokens)
                while not self._ensure_blocks(seq, pos + 1):
                    victim = self._pick_victim(exclude=req)
                    if victim is None:
                        break
                    self._preempt(victim, out)
                else:
                    out.encoder.append(EncoderWork(req, seq, [seq.output[-1]]))
                    out.decoder.append(DecoderWork(req, seq, "decode"))
                    budget -= 1
                    continue
                # no victim left: preempt this request itself
                self._preempt(req, out)
                break

        # 2. running prefills / pending replays
        for req in list(self.running):
            if req.status is RequestStatus.PREFILL:
                budget = self._schedule_prefill(req, budget, out)
            elif req.status is RequestStatus.REPLAY:
                budget = self._schedule_replay(req, budget, out)

        # 3. admissions (preempted first: they sit at the queue front)
        while self.waiting and budget > 0 and self.num_running_seqs < self.max_num_seqs:
            req = self.waiting[0]
            if req.status is RequestStatus.PREEMPTED:
                if not self._swap_in(req):
                    break
                self.waiting.popleft()
                self.running.append(req)
                if req.status is RequestStatus.DECODE:
                    continue  # decodes next step
            else:
                self.waiting.popleft()
                self._admit(req)
                if req.status is RequestStatus.LOADING:
                    self.loading.append(req)
                    continue
                self.running.append(req)
            if req.status is RequestStatus.PREFILL:
                budget = self._schedule_prefill(req, budget, out)
            elif req.status is RequestStatus.REPLAY:
                budget = self._schedule_replay(req, budget, out)
        out.num_tokens = self.token_budget - budget
        return out

    def _schedule_prefill(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        if budget <= 0:
            return budget
        seq = req.seqs[0]
        remaining = len(req.prompt) - req.prefilled
        chunk = min(remaining, budget)
        if not self._ensure_blocks(seq, req.prefilled + chunk):
            return budget
        out.encoder.append(EncoderWork(req, seq, req.prompt[req.prefilled : req.prefilled + chunk]))
        req.prefilled += chunk
        req.computed_tokens += chunk
        budget -= chunk
        if req.prefilled == len(req.prompt):
            req.status = RequestStatus.REPLAY
            budget = self._schedule_replay(req, budget, out)
        return budget

    def _replay_len(self, req: Request) -> int:
        seq = req.seqs[0]
        n = len(req.prompt)
        return n - max(seq.kv.enc_start, n - self.window, 0)

    def _schedule_replay(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        need = self._replay_len(req)
        if need > budget and (out.encoder or out.decoder):
            return budget  # next step (a replay longer than the whole budget runs alone)
        out.decoder.append(DecoderWork(req, req.seqs[0], "replay"))
        req.replayed_tokens += need
        return budget - need

    # ---- preemption -----------------------------------------------------------------------------
    def _pick_victim(self, exclude: Request) -> Request | None:
        for req in reversed(self.running):
            if req is not exclude and req.status in (RequestStatus.DECODE, RequestStatus.PREFILL,
                                                     RequestStatus.REPLAY):
                return req
        return None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Swap a request's private state and block images to the host, free its blocks, requeue it."""
        # drop any work already scheduled for it in this step
        out.encoder = [w for w in out.encoder if w.request is not req]
        out.decoder = [w for w in out.decoder if w.request is not req]
        self._swap_out(req)
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        out.preempted.append(req.request_id)
