"""``AsyncEngine``: the engine loop on its own thread, per-request asyncio queues of ``RequestOutput``.

    asyncio side (server)                         engine thread
    generate() --AddCommand(future)--> commands --> add_request (errors go back through the future)
    abort()    --AbortCommand--------> commands --> abort
    queue.get() <-- call_soon_threadsafe ------- step() outputs
The engine object is touched only by the engine thread. ``stats()`` reads counters without a lock
(a slightly stale snapshot is fine for metrics).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from flashtier.engine.engine import Engine
from flashtier.engine.outputs import EngineStats, RequestOutput
from flashtier.engine.sampling_params import SamplingParams

log = logging.getLogger("flashtier.engine")


@dataclass(frozen=True)
class AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    loop: asyncio.AbstractEventLoop  # the caller's loop: ``added`` is settled there
    added: asyncio.Future  # None when queued, or the add_request exception


@dataclass(frozen=True)
class AbortCommand:
    request_id: str


Command = AddCommand | AbortCommand


@dataclass(frozen=True)
class _Stream:
    loop: asyncio.AbstractEventLoop  # the caller's loop (outputs are put from the engine thread)
    queue: asyncio.Queue  # RequestOutput items, or the exception that killed the engine


class EngineDeadError(RuntimeError):
    """The engine loop failed; the request cannot complete."""


class AsyncEngine:
    """Implements ``EngineClient`` over a synchronous ``Engine``."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: deque[Command] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._accepting = True
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="flashtier-engine", daemon=True)

    # ---- EngineClient ---------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def eos_token_id(self) -> int:
        return self.engine.model.cfg.eos_token_id

    @property
    def vocab_size(self) -> int:
        return self.engine.model.cfg.vocab_size

    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    def is_ready(self) -> bool:
        return self._thread.is_alive() and self._accepting and self._error is None

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, cache_salt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Submit and stream a request's outputs; cancelling the iteration aborts it within one step."""
        if not self._accepting:
            raise RuntimeError("the engine is shutting down")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()
        self._streams[request_id] = _Stream(loop, queue)
        self._send(AddCommand(request_id, list(prompt_token_ids), params, cache_salt, loop, added))
        try:
            await added
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"request {request_id} failed: {item}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._send(AbortCommand(request_id))

    async def abort(self, request_id: str) -> None:
        self._send(AbortCommand(request_id))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting; let in-flight requests finish for up to ``timeout`` s, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self._thread.is_alive():
            await asyncio.sleep(0.02)
        for rid in list(self._streams):
            self._send(AbortCommand(rid))
        await asyncio.sleep(0.05)
        self._stop = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)
        await asyncio.get_running_loop().run_in_executor(None, self.engine.close)  # flush the SSD writer

    # ---- engine thread ---------------------------------------------------------------------------
    def _send(self, command: Command) -> None:
        self._commands.append(command)
        self._wake.set()

    def _apply(self, command: Command) -> None:
        if isinstance(command, AbortCommand):
            self.engine.abort(command.request_id)
            return
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                    cache_salt=command.cache_salt)
        except Exception as exc:  # noqa: BLE001 - handed to the caller, who maps it to a 4xx
            command.loop.call_soon_threadsafe(_settle, command.added, exc)
        else:
            command.loop.call_soon_threadsafe(_settle, command.added, None)

    def _dispatch(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            self._streams.pop(out.request_id, None)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _run(self) -> None:
        while not self._stop:
            while self._commands:
                self._apply(self._commands.popleft())
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug in a step: fail every request rather than hang them
                log.exception("engine step failed; failing all in-flight requests")
                self._error = exc
                for stream in list(self._streams.values()):
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
                self._streams.clear()
                return
            for out in outputs:
                self._dispatch(out)


def _settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
