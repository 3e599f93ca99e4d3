"""The shutdown drain: the server's in-flight generations, and what SIGTERM (or SIGINT) does to them.

    SIGTERM ─▶ DrainingServer.handle_exit ─┬─▶ Drain.begin(D): "draining: N request(s) in flight, up to D s"
                                           │     new generation requests (and /health): 503 shutting_down
                                           │     in-flight ones keep running ─▶ they finish: nothing more to do
                                           │     D passes ─▶ Drain.expire: ONE line, then every generation still
                                           │       running is interrupted: its engine iteration is cancelled and
                                           │       the loop answers ShuttingDown in its API's shape (a JSON 503;
                                           │       a stream's error event, then the stream's own end)
                                           └─▶ uvicorn: stops listening, waits up to D + UVICORN_MARGIN_S for the
                                                 connections (so the app, not uvicorn's cancellation, ends them)
               lifespan shutdown ─▶ engine.shutdown(0) ─▶ exit status 0

``Generation.start`` adds a generation to the ``Drain`` (``ShuttingDown`` once the drain timeout passed),
``Generation.close`` removes it. Interrupting works with any ``EngineClient``: it cancels the task awaiting
the engine's next output (``EngineStream.interrupt``), which turns the cancellation into the reason.
Everything here runs on the event loop; the signal handler only schedules ``begin`` there.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from types import FrameType
from typing import Protocol

import uvicorn

from flashtier.server.http.errors import APIError, ShuttingDown

__all__ = ["UVICORN_MARGIN_S", "Drain", "DrainingServer", "Interruptible"]

logger = logging.getLogger(__name__)

# uvicorn's graceful timeout is the drain's plus this: at D the app ends every request in its API's shape, and
# those answers (an error event, a JSON 503) must reach the client before uvicorn cancels what is left
UVICORN_MARGIN_S = 2.0


class Interruptible(Protocol):
    """What the drain holds: a running generation (generation.py's ``Generation``)."""

    request_id: str

    def interrupt(self, reason: APIError) -> None:
        """End at the next await on the engine with `reason` (rendered in the request's API shape)."""
        ...


class Drain:
    """The in-flight generations of one app and its drain state (``ServerState.drain``); event loop only."""

    def __init__(self) -> None:
        self._running: dict[int, Interruptible] = {}  # by id(): a Generation (a dataclass) is not hashable
        self.draining = False  # set by begin(): new generation requests are refused
        self.expired = False  # set by expire(): the drain timeout passed
        self.timeout_s = 0.0
        self._began = 0.0
        self._timer: asyncio.TimerHandle | None = None

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def add(self, gen: Interruptible) -> None:
        """Track `gen` until ``discard``. ``ShuttingDown`` once the drain timeout passed (a request that got
        past the admission check before the drain began but reaches the engine only now)."""
        if self.expired:
            raise ShuttingDown()
        self._running[id(gen)] = gen

    def discard(self, gen: Interruptible) -> None:
        """Stop tracking `gen` (idempotent); the last one to finish within the drain says so."""
        if self._running.pop(id(gen), None) is not None and self.draining and not self.expired and not self._running:
            logger.info("drained: every request finished within %.1f s", time.monotonic() - self._began)

    def begin(self, timeout_s: float) -> bool:
        """Start draining (on the loop): log the one "draining" line, refuse new generation requests from now,
        and interrupt what still runs after `timeout_s`. False (nothing changes) when already draining."""
        if self.draining:
            return False
        self.draining = True
        self.timeout_s = timeout_s
        self._began = time.monotonic()
        logger.info("draining: %d request(s) in flight, up to %.1f s", len(self._running), timeout_s)
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self.expire)
        return True

    def expire(self) -> int:
        """The drain timeout passed: interrupt every generation still running with ``ShuttingDown`` (one log
        line for all of them). Returns how many were interrupted; later ``add`` calls raise."""
        self.expired = True
        self._timer = None
        running = list(self._running.values())
        if running:
            logger.warning("drain timeout (%.1f s) passed: ending %d request(s) still in flight with 503 "
                           "shutting_down", self.timeout_s, len(running))
        for gen in running:
            gen.interrupt(ShuttingDown(f"the server is shutting down: the request did not finish within the "
                                       f"{self.timeout_s:g} s drain timeout; retry on another replica or later"))
        return len(running)

    def close(self) -> None:
        """Cancel the pending deadline (the lifespan's shutdown, once uvicorn stopped waiting)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose SIGTERM / SIGINT also starts ``drain`` at once (uvicorn itself waits for the
    connections up to ``Config.timeout_graceful_shutdown``: pass D + ``UVICORN_MARGIN_S``). A second SIGINT
    forces the exit, as in uvicorn. Unlike uvicorn, the signal is not raised again after the graceful exit:
    the process ends with status 0 instead of being killed by its own SIGTERM."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_timeout_s = drain_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop serve() runs on: where begin is scheduled

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()  # before the handlers are installed (super().serve does)
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Runs in signal context: set uvicorn's flags and schedule ``Drain.begin`` on the loop (nothing
        that takes a lock or logs here)."""
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            return
        self.should_exit = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.drain.begin, self.drain_timeout_s)
