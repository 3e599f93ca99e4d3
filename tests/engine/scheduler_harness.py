"""Test doubles for driving the scheduler without a model: a runner that only feeds tokens, a tier
client with hand-settled lookups, and a small-pool factory.

``TokenRunner`` does the bookkeeping half of ``ModelRunner.execute`` (tokens fed, decoder replay
start) and returns logits whose argmax is a fixed token, so the real ``Postprocessor`` and ``Sampler``
run unchanged.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import torch

from flashtier.engine.kv.manager import CachedBlock, KVManager, SequenceSpec
from flashtier.engine.model.config import preset
from flashtier.engine.postprocess import Postprocessor
from flashtier.engine.core.request import Request, Sequence
from flashtier.engine.tiers.resume import ResumePlan, ResumeResult
from flashtier.engine.runner.runner import ModelRunnerOutput
from flashtier.engine.sample.sampler import Sampler
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.scheduler import Scheduler
from flashtier.engine.core.scheduler_output import DecoderKind, SchedulerOutput
from flashtier.engine.tiers.manager import SnapshotOutcome, TierLookup
from flashtier.kvstore.block_hash import namespace_hash
from flashtier.kvstore.layout import BlockLayout

VOCAB = 64
NEXT_TOKEN = 7  # what every sampled row yields (greedy over TokenRunner's logits)
EOS = 1
NAMESPACE = namespace_hash("scheduler-tests", None)


def tiny_spec() -> SequenceSpec:
    """The tiny preset's KV geometry (window 16, 40 layers, 4 sources); no weights are built."""
    return SequenceSpec.from_config(preset("tiny"), torch.float32, "cpu")


class TokenRunner:
    """Feeds scheduled tokens into each sequence's KV state; logits put all mass on ``NEXT_TOKEN``."""

    def __init__(self, spec: SequenceSpec):
        self.decoder_layers = range(spec.n_encoder_layers, spec.n_layers)
        self.replay_starts: list[int] = []

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for w in sched.encoder:
            w.seq.kv.tokens.extend(w.tokens)
        for w in sched.decoder:
            if w.kind is DecoderKind.REPLAY:
                self.replay_starts.append(w.seq.kv.begin_decoder_replay(self.decoder_layers))
        if not sched.decoder:
            return ModelRunnerOutput()
        logits = torch.full((len(sched.decoder), VOCAB), -30.0)
        logits[:, NEXT_TOKEN] = 30.0
        return ModelRunnerOutput(logits)


@dataclass
class ManualTiers:
    """A ``TierClient`` stand-in: lookups are futures the test settles; writes are recorded."""

    kvm: KVManager
    lookups: dict[str, concurrent.futures.Future] = field(default_factory=dict)
    snapshots: list[tuple[str, int]] = field(default_factory=list)  # (request id, point)
    written: list[int] = field(default_factory=list)  # block ids written through
    resumes: list[ResumeResult] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # request ids whose lookup was dropped

    def start_lookup(self, req: Request) -> concurrent.futures.Future[TierLookup]:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.lookups[req.request_id] = fut
        return fut

    def drop_lookup(self, req: Request) -> None:
        if req.lookup is not None:
            self.dropped.append(req.request_id)
            req.lookup = None

    def write_through(self, req: Request, blocks: list[CachedBlock]) -> None:
        self.written += [b.block_id for b in blocks]

    def snapshot(self, req: Request, seq: Sequence) -> None:
        self.snapshots.append((req.request_id, len(seq.kv.tokens)))

    def count_resume(self, plan: ResumePlan, result: ResumeResult) -> None:
        self.resumes.append(result)


class Harness:
    """Scheduler + TokenRunner + the real Postprocessor over a small pool."""

    def __init__(self, *, block_size: int = 4, num_blocks: int = 32, budget: int = 8, max_seqs: int = 8,
                 tiers: bool = False, allow_replay: bool = True):
        self.spec = tiny_spec()
        self.kvm = KVManager(self.spec, BlockLayout(self.spec.geometry, block_size), num_blocks)
        self.tiers = ManualTiers(self.kvm) if tiers else None
        self.scheduler = Scheduler(self.kvm, max_num_seqs=max_seqs, token_budget=budget, tiers=self.tiers,
                                   allow_replay=allow_replay)
        self.runner = TokenRunner(self.spec)
        self.post = Postprocessor(self.scheduler, Sampler(eos_token_id=EOS), eos_token_id=EOS, max_model_len=4096)

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4, n: int = 1) -> Request:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
        req = Request(rid, list(prompt), params, namespace=NAMESPACE)
        self.scheduler.add(req)
        return req

    def step(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        self.post.process(sched, self.runner.execute(sched))
        self.check()
        return sched

    def check(self) -> None:
        self.scheduler.check_integrity()


def settle(h: Harness, rid: str, lookup: TierLookup | None = None) -> None:
    """Finish request ``rid``'s pending tier lookup (default: nothing found)."""
    h.tiers.lookups[rid].set_result(lookup or TierLookup((), outcome=SnapshotOutcome.NONE))


def warm_tier_harness() -> Harness:
    """A tier harness whose pool caches the 5 full blocks of ``prompt_of(20)`` (ids 1..5)."""
    h = Harness(budget=8, tiers=True)
    h.add("warm", prompt_of(20), max_tokens=3)
    h.step()
    settle(h, "warm")
    while h.scheduler.requests:
        h.step()
    assert h.kvm.pool.num_cached == 5
    return h


def prompt_of(n: int, base: int = 10) -> list[int]:
    return [base + i for i in range(n)]


def work(sched: SchedulerOutput) -> tuple[list[tuple[str, int]], list[tuple[str, str]]]:
    """(request id, tokens) per encoder item and (request id, kind) per decoder item."""
    return ([(w.request.request_id, len(w.tokens)) for w in sched.encoder],
            [(w.request.request_id, w.kind.value) for w in sched.decoder])
