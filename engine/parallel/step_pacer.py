"""``StepPacer``: which engine step the ranks may run next, and the events that apply before it.

Every rank runs its own ``Engine`` and must see the same events (add / abort) before the same step. The
driver therefore releases steps one at a time: release s carries every event submitted since release
s - 1, and a rank runs step s only after it has received release s. A step is released when there is
something to do (new events, or rank 0 reported unfinished work after its last step), and at most
``lookahead`` released steps are waiting for rank 0's report, so the ranks never wait on the driver's
round trip while the driver never runs ahead of what it has heard back.

A rank that is stalled (every request waits on a tier lookup, one rank only) reports no unfinished work, so
no step is released for it until it says a lookup finished (``wake``) or new events arrive: the pipes do not
spin while the lookup's reader threads work.

Thread-safe: the event loop submits, the sender thread takes releases, the monitor thread reports steps.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from flashtier.engine.parallel.executor_messages import StepInput

__all__ = ["StepPacer"]


class StepPacer:
    def __init__(self, lookahead: int = 2, clock: Callable[[], float] = time.monotonic) -> None:
        """``lookahead``: most released steps not yet reported (ValueError below 1)."""
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        self.lookahead = lookahead
        self._clock = clock
        self._cond = threading.Condition()
        self._pending: list[Any] = []
        self._next_step = 0
        self._in_flight: deque[int] = deque()
        self._head_since: float | None = None  # when the oldest released step became the one waited on
        self._unfinished = False
        self._stop = False  # a stop is requested: released with the next step, after which nothing is
        self._closed = False

    def submit(self, event: Any) -> None:
        """Queue ``event`` for the next release (ignored once closed)."""
        with self._cond:
            if not self._closed:
                self._pending.append(event)
                self._cond.notify_all()

    def request_stop(self) -> None:
        """The next release carries ``stop=True`` (after the pending events); nothing is released after it."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def close(self) -> None:
        """Release nothing more; wakes ``next_input`` callers, which return None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def next_input(self, timeout: float | None = None) -> StepInput | None:
        """Block until a step can be released and return it (mutates the pacer: the events move into it);
        None when closed, or when ``timeout`` seconds pass first."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while not self._closed and not self._can_release():
                left = None if deadline is None else deadline - self._clock()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            if self._closed:
                return None
            step = StepInput(self._next_step, tuple(self._pending), stop=self._stop)
            self._pending.clear()
            self._next_step += 1
            if not self._in_flight:
                self._head_since = self._clock()
            self._in_flight.append(step.step)
            if step.stop:
                self._closed = True
            return step

    def wake(self) -> None:
        """Rank 0 was stalled and may run now (a tier lookup finished): release a step."""
        with self._cond:
            self._unfinished = True
            self._cond.notify_all()

    def done(self, step: int, unfinished: bool) -> None:
        """Rank 0 reported ``step``; ``unfinished``: it has work a step can advance now (False while it is
        stalled on tier lookups: ``wake`` follows). RuntimeError when it is not the oldest released step
        (reports come in order)."""
        with self._cond:
            if not self._in_flight or self._in_flight[0] != step:
                raise RuntimeError(f"rank 0 reported step {step}, but the oldest step in flight is "
                                   f"{self._in_flight[0] if self._in_flight else None}")
            self._in_flight.popleft()
            self._head_since = self._clock() if self._in_flight else None
            self._unfinished = unfinished
            self._cond.notify_all()

    def waited_s(self) -> float:
        """How long the oldest released step has been waited on (0 when none is in flight)."""
        with self._cond:
            return 0.0 if self._head_since is None else self._clock() - self._head_since

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._in_flight)

    def _can_release(self) -> bool:
        if len(self._in_flight) >= self.lookahead:
            return False
        return bool(self._pending) or self._stop or self._unfinished
