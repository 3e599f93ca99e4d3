"""CircuitBreaker: stop paying a timeout per call while a remote store is down.

    closed ──failure──▶ open (until now + backoff) ──backoff over: allow() lets ONE probe through──▶ half-open
      ▲                   ▲                                                                        │
      │                   └── the probe fails: open again, backoff doubled (capped at max_s) ◀─────┤
      └──────────────────────── the probe (or any call) succeeds: closed, backoff reset to base_s ◀┘

While open (and while a probe is in flight) ``allow()`` answers SKIP: the caller skips the call and
answers a miss at once. A probe that ends without a verdict (its task was cancelled) is ``release()``d,
so the next call probes instead. Pure state on an injectable clock; not thread-safe (one event loop).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class Permit(enum.Enum):
    """``CircuitBreaker.allow()``'s answer."""

    CALL = "call"  # closed: go ahead
    PROBE = "probe"  # half-open: this call decides whether the breaker closes
    SKIP = "skip"  # open: answer a miss without calling


class CircuitBreaker:
    """Closed / open / half-open with exponential back-off; see the module doc."""

    def __init__(self, *, base_s: float = 1.0, max_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        """ValueError unless 0 < base_s <= max_s."""
        if not 0 < base_s <= max_s:
            raise ValueError(f"CircuitBreaker needs 0 < base_s <= max_s, got {base_s!r}, {max_s!r}")
        self.base_s, self.max_s = float(base_s), float(max_s)
        self._clock = clock
        self.backoff_s = self.base_s  # the next open period
        self.open_until: float | None = None  # None: closed
        self.probing = False  # half-open: one call in flight decides
        self.opens = 0  # closed -> open transitions (monotonic)

    @property
    def is_open(self) -> bool:
        """Open or half-open: the remote store is considered down."""
        return self.open_until is not None

    def allow(self) -> Permit:
        """May a call go out now? Mutates: becomes half-open when the back-off is over (PROBE: the caller
        must report ``failed(probe=True)``, ``succeeded()`` or ``release()``)."""
        if self.open_until is None:
            return Permit.CALL
        if self.probing or self._clock() < self.open_until:
            return Permit.SKIP
        self.probing = True
        return Permit.PROBE

    def succeeded(self) -> bool:
        """A call succeeded: close, reset the back-off. True when this ended an open period."""
        was_open = self.open_until is not None
        self.open_until, self.probing, self.backoff_s = None, False, self.base_s
        return was_open

    def failed(self, *, probe: bool = False) -> bool:
        """A call failed: a closed breaker opens for ``base_s``; a failed probe re-opens it for twice the
        last back-off (at most ``max_s``); a call that went out before the breaker opened changes nothing.
        True when this opened a closed breaker (the store just went down)."""
        opened = self.open_until is None
        if opened:
            self.opens += 1
        elif probe:
            self.backoff_s = min(self.max_s, self.backoff_s * 2)
        else:
            return False
        self.open_until, self.probing = self._clock() + self.backoff_s, False
        return opened

    def release(self) -> None:
        """The probe ended without a verdict (cancelled): the next ``allow()`` probes again."""
        self.probing = False
