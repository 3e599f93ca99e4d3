"""A request and its sequences (one per choice, n > 1), as the scheduler tracks them.

``Request.status`` is read-only here: ``request_state.transition`` is the only writer.
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from flashtier.engine.grammar.constraint import GrammarState
from flashtier.engine.core.outputs import ResumeInfo, TokenLogprob
from flashtier.engine.kv.paged_kv import PagedSequence
from flashtier.engine.core.request_state import RequestStatus
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.sample.row import to_device
from flashtier.kvstore.block_hash import BlockHash

if TYPE_CHECKING:
    from flashtier.engine.core.preemption import SwappedState
    from flashtier.engine.spec.state import SpecState
    from flashtier.engine.tiers.manager import TierLookup


class FinishReason(str, enum.Enum):
    """Why a choice ended (the value is what the API reports)."""

    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # aborted by the caller, or no block for an n > 1 fork


class DurableBytes:
    """Bytes of a request made durable, added from the tier threads as writes complete (locked)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def add(self, n: int) -> None:
        with self._lock:
            self._value += n

    @property
    def value(self) -> int:
        with self._lock:
            return self._value


@dataclass
class Sequence:
    """One choice of a request: its KV state, its generated tokens and its sampler state."""

    index: int
    kv: PagedSequence
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    emitted: int = 0  # tokens already handed out in a RequestOutput
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of its full blocks
    fork_block: int | None = None  # hashes[fork_block:] are on the replayed fork (block_hash.fork_root)
    swapped: SwappedState | None = None  # preemption: private state + block images on the host
    grammar: GrammarState | None = None  # structured output: where this choice is in its grammar
    spec: SpecState | None = None  # speculative decoding: drafter rings and drafts (None: plain decoding)
    tenant: bytes | None = None  # tag of its request's tenant (kvstore/tenant.py): the blocks it caches carry it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take_hashes(self, hashes: list[BlockHash], n: int, fork_block: int | None) -> None:
        """Adopt the first ``n`` of a chain whose blocks from ``fork_block`` on lie on a replayed fork.
        Mutates ``hashes`` and ``fork_block``."""
        self.hashes = list(hashes[:n])
        self.fork_block = fork_block if fork_block is not None and n > fork_block else None


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    namespace: BlockHash | None = None  # prefix-cache namespace (model fingerprint + cache_salt)
    _status: RequestStatus = field(default=RequestStatus.WAITING, repr=False)
    resume_status: RequestStatus | None = None  # the state a preempted request returns to
    status_history: list[RequestStatus] = field(default_factory=list)  # every transition, in order
    seqs: list[Sequence] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens scheduled into the encoder (incl. the cached prefix)
    cached_tokens: int = 0  # prompt tokens whose global KV came from the cache
    hbm_tokens: int = 0
    ssd_tokens: int = 0
    snapshot_tokens: int = 0
    persisted: DurableBytes = field(default_factory=DurableBytes)  # fsynced SSD blocks + Redis snapshots
    hashes: list[BlockHash] = field(default_factory=list)  # the prompt's full-block hashes (tier lookups)
    fork_block: int | None = None  # hashes[fork_block:] follow a replayed fork (approximate blocks)
    hbm_blocks: int = 0  # HBM hits pinned while LOADING
    lookup: concurrent.futures.Future[TierLookup] | None = None  # the pending tier lookup
    decoder_tokens: int = 0  # prompt tokens the decoder ran (its pass over the prompt's last window; exact)
    approximate_replay_tokens: int = 0  # encoder tokens re-fed by a bounded replay from R > window (approximate)
    computed_tokens: int = 0
    resume: ResumeInfo = field(default_factory=ResumeInfo)  # set when the request enters PREFILL
    first_scheduled: float | None = None
    first_token: float | None = None
    finished_at: float | None = None
    _prompt_on_device: torch.Tensor | None = field(default=None, repr=False, init=False)  # penalty_prompt's copy

    @property
    def status(self) -> RequestStatus:
        return self._status

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    def penalty_prompt(self, device: torch.device) -> list[int] | torch.Tensor:
        """The prompt as the sampler's repetition penalty reads it (``SamplerRow.prompt_token_ids``): with that
        penalty on, a device tensor copied once and kept (a list would be copied to the device at every step:
        a 1M-token prompt is ~8 MB and ~30 ms of host conversion per step); otherwise the list, which the
        sampler does not read. Mutates the kept tensor (created on first use, engine thread only)."""
        if self.params.repetition_penalty == 1.0:
            return self.prompt
        if self._prompt_on_device is None or self._prompt_on_device.device != torch.device(device):
            self._prompt_on_device = to_device(self.prompt, torch.long, torch.device(device))
        return self._prompt_on_device

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]
