"""A request and its sequences (one per choice, n > 1), as the scheduler tracks them."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from flashtier.kvstore.block_hash import BlockHash

from .outputs import TokenLogprob
from .paged_kv import PagedSequence
from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds nothing
    LOADING = "loading"  # reserved: waiting on tier loads (SSD / snapshot), never blocks a step
    PREFILL = "prefill"  # encoder over the prompt, chunked
    REPLAY = "replay"  # decoder bounded replay over the last `window` prompt tokens -> first token
    DECODE = "decode"
    PREEMPTED = "preempted"  # private state swapped to host, blocks freed; resumes exactly
    FINISHED = "finished"


@dataclass
class Sequence:
    """One choice of a request: its KV state, its generated tokens and its sampler state."""

    index: int
    kv: PagedSequence
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    emitted: int = 0  # tokens already handed out in a RequestOutput
    finish_reason: str | None = None
    stop_token_id: int | None = None
    hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of its full blocks
    swapped: dict | None = None  # preemption: private state + block images on the host

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    namespace: BlockHash | None = None  # prefix-cache namespace (model fingerprint + cache_salt)
    status: RequestStatus = RequestStatus.WAITING
    resume_status: RequestStatus | None = None  # the state a preempted request returns to
    seqs: list[Sequence] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens run through the encoder (incl. the cached prefix)
    cached_tokens: int = 0  # prompt tokens whose global KV came from the cache
    hbm_tokens: int = 0
    ssd_tokens: int = 0
    snapshot_tokens: int = 0
    persisted_bytes: int = 0  # SSD block images + snapshots written for this request
    hashes: list[BlockHash] | None = None  # the prompt's full-block hashes (tier lookups)
    hbm_blocks: int = 0  # HBM hits pinned while LOADING
    lookup: object | None = None  # the pending tier lookup (a concurrent future)
    replayed_tokens: int = 0
    computed_tokens: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    finished_at: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]
