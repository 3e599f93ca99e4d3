"""What crosses the pipes between the driver (the server process) and the rank processes.

    driver -> every rank   StepInput(step, events, stop)    the engine inputs that apply before step ``step``
    rank 0 -> driver       StepDone(step, outputs, admitted, stats, unfinished)
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


Event = AddEvent | AbortEvent


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
