"""``AsyncEngine``: the engine loop on its own thread, per-request asyncio queues of ``RequestOutput``.

    asyncio side (server)                         engine thread
    generate() --("add", future)--> commands --> add_request (errors go back through the future)
    abort()    --("abort")--------> commands --> abort
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

from .engine import Engine
from .outputs import EngineStats, RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger("flashtier.engine")


class EngineDeadError(RuntimeError):
    """The engine loop failed; the request cannot complete."""


class AsyncEngine:
    """Implements ``EngineClient`` over a synchronous ``Engine``."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: deque[tuple] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
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
        self._streams[request_id] = (loop, queue)
        self._send(("add", request_id, list(prompt_token_ids), params, cache_salt, loop, added))
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
                self._send(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting; let in-flight requests finish for up to ``timeout`` s, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self._thread.is_alive():
            await asyncio.sleep(0.02)
        for rid in list(self._streams):
            self._send(("abort", rid))
        await asyncio.sleep(0.05)
        self._stop = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)
        await asyncio.get_running_loop().run_in_executor(None, self.engine.close)  # flush the SSD writer

    # ---- engine thread ---------------------------------------------------------------------------
    def _send(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake.set()

    def _apply(self, command: tuple) -> None:
        if command[0] == "add":
            _, rid, prompt, params, salt, loop, fut = command
            try:
                self.engine.add_request(rid, prompt, params, cache_salt=salt)
            except Exception as exc:  # noqa: BLE001 - handed to the caller, who maps it to a 4xx
                loop.call_soon_threadsafe(_settle, fut, exc)
            else:
                loop.call_soon_threadsafe(_settle, fut, None)
        elif command[0] == "abort":
            self.engine.abort(command[1])

    def _dispatch(self, out: RequestOutput) -> None:
        entry = self._streams.get(out.request_id)
        if entry is None:
            return
        loop, queue = entry
        if out.finished:
            self._streams.pop(out.request_id, None)
        loop.call_soon_threadsafe(queue.put_nowait, out)

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
                for loop, queue in list(self._streams.values()):
                    loop.call_soon_threadsafe(queue.put_nowait, exc)
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
