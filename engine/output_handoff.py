"""``OutputHandoff``: when the engine thread hands a step's outputs to the event loop(s) that format them.

The engine thread and the event loop share one GIL and both release it often: the engine at every tensor op
or kernel launch, the loop at every socket write. A thread that wants the GIL back while the other runs
Python waits up to the switch interval (5 ms), so while the loop formats a step (detokenizing, one SSE chunk
and one write per stream) the engine's host work barely moves, and the other way round: formatting step N
during step N+1's host work (scheduling, inputs, launches) adds the formatting to the inter-token latency.

A plain decode step on an asynchronous device (CUDA graphs) is short host work, then a long wait for the
device with the GIL released. Outputs of step N handed over once step N+1's forward is queued
(``Engine.set_handoff_hook``, ``queued=True``) are formatted while the device computes, and the host work of
every step runs alone:

    engine:  | host N+1 | hand over N | waits on the device (GIL free)  | host N+2 | hand over N+1 | ...
    loop:                 | formats N, writes its chunks |

That delays the outputs by the next step's host work, so it is done only while the last plain decode step
waited at least as long after queueing as its host work took before; otherwise (the CPU, where the forward
is host work; eager launches bound by the host) a step's outputs go at its end. A step with prefill or
replay work hands over before its forward (``queued=False``: eager, long host work) and leaves the decision
as it was. A step after which none starts at once (nothing unfinished, the engine stalled, a stop) hands
over at its end.

Owned by the engine thread: every method runs there. ``deliver`` gets each step's outputs once, in step
order, and must not raise.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flashtier.engine.core.outputs import RequestOutput

__all__ = ["OutputHandoff"]


class OutputHandoff:
    """Holds a step's outputs until the next step's hand-off point, or hands them over at its end."""

    def __init__(self, deliver: Callable[[list[RequestOutput]], None],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._deliver = deliver
        self._clock = clock
        self._held: list[RequestOutput] = []
        self._started = 0.0
        self._queued_at: float | None = None  # when this step's plain decode forward was queued
        self.defer = False  # hold a step's outputs until the next step's hand-off point
        self.handoffs = 0  # calls of ``deliver``

    def begin_step(self) -> None:
        """Right before ``Engine.step()``."""
        self._started = self._clock()
        self._queued_at = None

    def point(self, queued: bool) -> None:
        """``Engine``'s hand-off hook: hand over what the last step left held. ``queued``: a plain decode
        forward is queued (the time splits this step into host work and device wait)."""
        if queued:
            self._queued_at = self._clock()
        self.flush()

    def end_step(self, outputs: list[RequestOutput], *, next_step_now: bool) -> None:
        """After ``Engine.step()`` returned `outputs`. ``next_step_now``: another step starts right away
        (False: the thread is about to sleep or stop, so nothing is held)."""
        if self._queued_at is not None:
            self.defer = self._clock() - self._queued_at >= self._queued_at - self._started
        self._held.extend(outputs)  # after anything an earlier step left held: step order
        if not (self.defer and next_step_now):
            self.flush()

    def flush(self) -> None:
        """Hand over everything held, in one ``deliver`` call."""
        if self._held:
            held, self._held = self._held, []
            self.handoffs += 1
            self._deliver(held)
