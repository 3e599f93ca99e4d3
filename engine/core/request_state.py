"""A request's lifecycle: the status enum, the allowed transitions, and the one function that moves it.

    WAITING ──admit──────────────────────────▶ PREFILL ──prompt fed──▶ REPLAY ──first token──▶ DECODE
       │                                          ▲                     │                       │
       └──tier lookup──▶ LOADING ──lookup applied─┘                     │                       │
                                                                        ▼                       ▼
    PREFILL / REPLAY / DECODE ──preempt──▶ PREEMPTED ──swap in──▶ the state it left     FINISHED
    every state but FINISHED ──abort──▶ FINISHED                                   (last choice done)

Only ``transition`` writes ``Request.status``; it raises ``InvalidTransition`` for anything else, so
a scheduling bug stops the step instead of silently corrupting a request. A preempted request can
only return to the state it was preempted in (``Request.resume_status``).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flashtier.engine.core.request import Request


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds nothing
    LOADING = "loading"  # waiting on a tier lookup (SSD blocks, a snapshot); never blocks a step
    PREFILL = "prefill"  # encoder over the prompt, chunked
    REPLAY = "replay"  # decoder bounded replay over the last `window` prompt tokens -> first token
    DECODE = "decode"
    PREEMPTED = "preempted"  # private state swapped to the host, blocks freed; resumes exactly
    FINISHED = "finished"


_S = RequestStatus
ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING: frozenset({_S.LOADING, _S.PREFILL, _S.FINISHED}),
    _S.LOADING: frozenset({_S.PREFILL, _S.FINISHED}),
    _S.PREFILL: frozenset({_S.REPLAY, _S.PREEMPTED, _S.FINISHED}),
    _S.REPLAY: frozenset({_S.DECODE, _S.PREEMPTED, _S.FINISHED}),
    _S.DECODE: frozenset({_S.PREEMPTED, _S.FINISHED}),
    _S.PREEMPTED: frozenset({_S.PREFILL, _S.REPLAY, _S.DECODE, _S.FINISHED}),
    _S.FINISHED: frozenset(),
}
RUNNING = frozenset({_S.PREFILL, _S.REPLAY, _S.DECODE})  # states that hold blocks and get scheduled


class InvalidTransition(RuntimeError):
    """A transition the state machine does not allow (a scheduler bug)."""


def transition(req: Request, to: RequestStatus) -> None:
    """Move ``req`` to ``to``.

    Mutates: ``req._status``, ``req.resume_status`` (set on preemption, cleared on swap-in) and
    ``req.status_history``. Failure: ``InvalidTransition``; nothing is changed.
    """
    now = req.status
    if to not in ALLOWED[now]:
        raise InvalidTransition(f"request {req.request_id}: {now.value} -> {to.value} is not allowed")
    if now is _S.PREEMPTED and to is not _S.FINISHED and to is not req.resume_status:
        raise InvalidTransition(
            f"request {req.request_id}: preempted in {req.resume_status.value}, cannot resume in {to.value}"
        )
    if to is _S.PREEMPTED:
        req.resume_status = now
    elif now is _S.PREEMPTED:
        req.resume_status = None
    req._status = to
    req.status_history.append(to)
