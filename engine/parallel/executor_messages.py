"""What crosses the pipes between the driver (the API process) and the engine-core (rank) processes.

    driver -> every rank   StepInput(step, events, stop)    the engine inputs that apply before step ``step``
    rank 0 -> driver       StepDone(step, outputs, admitted, stats, unfinished, stalled)
                           Woken()                           a tier lookup finished while rank 0 was stalled
                           TenantDeleted(token, report | error)   a DeleteTenantEvent's result, once the tiers
                                                             are done (sent from rank 0's deletion thread)
                           Phase(text)                       start-up progress ("warming up"), before Ready
    every rank -> driver   Ready(rank, info) once at start-up, or Failed(rank, error) when it cannot go on

Events are the only inputs of an ``Engine``: every rank applies the same events in the same order before
the same step, so its scheduler, sampler (same seeds) and KV stay identical to every other rank's.
Everything here pickles with the standard library; a request's compiled grammar travels as xgrammar's
JSON (``wire_params.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashtier.engine.core.outputs import EngineStats, RequestOutput
from flashtier.engine.parallel.wire_params import WireParams
from flashtier.engine.sample.params import SamplingParams


@dataclass(frozen=True)
class AddEvent:
    request_id: str
    prompt_token_ids: list[int]
    params: WireParams | SamplingParams  # SamplingParams until the driver's sender thread encodes it
    cache_salt: str | None


@dataclass(frozen=True)
class AbortEvent:
    request_id: str


@dataclass(frozen=True)
class DeleteTenantEvent:
    """Drop ``tenant``'s blocks from every rank's prefix index before the step; rank 0 then deletes it from the
    tiers on a thread and answers ``TenantDeleted(token)``."""

    token: int  # matches the answer to the caller
    tenant: str | None


Event = AddEvent | AbortEvent | DeleteTenantEvent


@dataclass(frozen=True)
class StepInput:
    """Apply ``events`` in order, then run one engine step if anything is unfinished; ``stop``: leave the loop
    (after the events)."""

    step: int
    events: tuple[Event, ...] = ()
    stop: bool = False


@dataclass(frozen=True)
class EngineInfo:
    """What the server reads from the engine once (``EngineClient`` properties, the start-up summary)."""

    max_model_len: int
    eos_token_id: int
    vocab_size: int
    device: str
    dtype: str
    num_blocks: int
    block_size: int
    block_bytes: int
    world_size: int = 1
    tiers: bool = False  # the SSD tier and snapshot pool run (one rank only)
    warmup_s: float | None = None  # how long the warm-up took (None: not run)


@dataclass(frozen=True)
class Phase:
    """Start-up progress of rank 0 ("warming up"), shown by /health until Ready."""

    text: str


@dataclass(frozen=True)
class Woken:
    """Rank 0 was stalled (every request waiting on a tier lookup) and a lookup finished: release a step."""


@dataclass(frozen=True)
class TenantDeletionResult:
    """What a tenant's deletion removed per tier (the fields of ``engine.client.TenantDeletionReport``,
    less the tenant tag and the time, which the driver adds)."""

    hbm_free_blocks: int
    hbm_in_use_blocks: int
    ssd_queued_discarded: int
    ssd_records_deleted: int
    ssd_live_deleted: int
    ssd_bytes_deleted: int
    ssd_unattributed_bytes: int
    ssd_segments_rewritten: int
    ssd_records_kept: int
    snapshot_namespaces: int
    snapshots_deleted: int


@dataclass(frozen=True)
class TenantDeleted:
    """The answer to ``DeleteTenantEvent(token)``: ``result``, or ``error`` = (exception type name, message)."""

    token: int
    result: TenantDeletionResult | None
    error: tuple[str, str] | None = None


@dataclass(frozen=True)
class Ready:
    rank: int
    pid: int
    info: EngineInfo
    stats: EngineStats


@dataclass(frozen=True)
class Failed:
    """A rank that cannot go on: ``error`` is the last line of its traceback, ``detail`` the whole of it."""

    rank: int
    error: str
    detail: str = ""


@dataclass(frozen=True)
class StepDone:
    """Rank 0's result of step ``step``. ``admitted``: per AddEvent of the step, in order, (request id, None)
    when queued, else (request id, (kind, message)) for what ``add_request`` raised (kind "value": ValueError,
    "queue_full": QueueFullError, "error": anything else; exceptions themselves may not unpickle).
    ``unfinished``: the engine still has work after the step."""

    step: int
    outputs: tuple[RequestOutput, ...]
    admitted: tuple[tuple[str, tuple[str, str] | None], ...]
    stats: EngineStats
    unfinished: bool
    seconds: float = 0.0  # wall time of the step on rank 0 (events + forward + postprocess)
    stalled: bool = False  # nothing ran: every request waits on a tier lookup (``Woken`` follows when one ends)
