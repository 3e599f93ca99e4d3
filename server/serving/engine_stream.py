"""One engine request as a route sees it: ``EngineStream`` submits it, waits a moment for admission
errors (so a full queue is a 429 even for ``stream=true``), and on close aborts it unless it finished.
Closing happens on every exit path: client disconnect, stop string, error, normal end. ``interrupt``
(the drain timeout, drain.py) ends the iteration with a given ``APIError`` at its next await on the engine.

    engine.generate ──RequestOutput──▶ EngineStream ──▶ merge_outputs ──StreamOutput──▶ the output loop
       (token ids)                  (abort on close)   (several streams: a completions batch)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from flashtier.engine.client import EngineClient, QueueFullError
from flashtier.engine.core.outputs import RequestOutput
from flashtier.engine.sample.params import SamplingParams
from flashtier.server.http.errors import APIError, BadRequest, ServiceUnavailable, queue_full_error
from flashtier.server.serving.state import engine_ready

__all__ = ["EngineStream", "StreamOutput", "engine_error", "merge_outputs"]

logger = logging.getLogger(__name__)

# How long a new request may take to show an admission error (queue full, too long) before the
# response starts; errors after it are sent as an SSE error event.
FIRST_OUTPUT_GRACE_S = 0.1


@dataclass(frozen=True, slots=True)
class StreamOutput:
    """An output of one of several engine streams: ``index`` is the stream's position."""

    index: int
    output: RequestOutput


def engine_error(exc: BaseException, engine: EngineClient | None = None) -> APIError | None:
    """The client-facing error of an exception the engine raised, or None (a bug: 500).

    Anything else raised while the engine reports itself not ready (shutting down, dead) is a 503.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return queue_full_error(exc)
    if isinstance(exc, ValueError):
        return BadRequest(str(exc))
    if engine is not None and isinstance(exc, Exception) and not engine_ready(engine):
        return ServiceUnavailable("the engine stopped or is shutting down; retry later")
    return None


class EngineStream:
    """One engine request; iterate ``outputs()`` and always ``close()`` (aborts if unfinished).

    Errors the engine raises (``QueueFullError``, ``ValueError``) come out as ``APIError``.
    """

    def __init__(self, engine: EngineClient, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, cache_salt: str | None = None) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.cache_salt = cache_salt
        self.finished = False
        self.aborted = False
        self._gen: AsyncIterator[RequestOutput] | None = None
        self._first: asyncio.Future[RequestOutput] | None = None
        self._closed = False
        self._stop: APIError | None = None  # set by interrupt(): outputs() raises it
        self._waiter: asyncio.Task | None = None  # the task awaiting the engine's next output, while it does
        self._cancelled_waiter = False  # interrupt() cancelled _waiter: its CancelledError is the interrupt

    async def start(self, grace_s: float = FIRST_OUTPUT_GRACE_S) -> None:
        """Submit, and wait up to `grace_s` for the first output so that admission errors surface now."""
        self._gen = self.engine.generate(self.request_id, self.prompt_token_ids, self.params,
                                         cache_salt=self.cache_salt)
        self._first = asyncio.ensure_future(self._gen.__anext__())
        await asyncio.wait({self._first}, timeout=grace_s)
        if self._first.done() and not self._first.cancelled() and self._first.exception() is not None:
            exc = self._first.exception()
            self._first = None
            self.finished = True  # never admitted: nothing to abort
            if isinstance(exc, StopAsyncIteration):
                raise APIError(500, "the engine ended the request without output")
            raise engine_error(exc, self.engine) or exc  # type: ignore[misc]

    def interrupt(self, reason: APIError) -> None:
        """End the iteration with `reason`: ``outputs()`` raises it at once if it is awaiting the engine (its task
        is cancelled; the cancellation becomes `reason`), else before its next await. The engine request stays
        unfinished, so ``close`` aborts it. No effect on a finished or closed stream, or after a first call."""
        if self.finished or self._closed or self._stop is not None:
            return
        self._stop = reason
        if self._waiter is not None:
            self._cancelled_waiter = True
            self._waiter.cancel(msg="interrupted")

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        if self._gen is None:
            await self.start(grace_s=0.0)
        assert self._gen is not None
        while not self.finished:
            if self._stop is not None:
                raise self._stop
            # the await below is the only place interrupt() cancels: the task is suspended there and nowhere else
            self._waiter = asyncio.current_task()
            try:
                if self._first is not None:
                    first, self._first = self._first, None
                    out = await first
                else:
                    out = await self._gen.__anext__()
            except StopAsyncIteration:
                self.finished = True
                return
            except asyncio.CancelledError:
                if not self._cancelled_waiter:
                    raise
                self._cancelled_waiter = False
                task = asyncio.current_task()
                if task is not None and task.uncancel() > 0:
                    raise  # cancelled by someone else as well (the client went away): that cancellation wins
                assert self._stop is not None
                raise self._stop from None
            except Exception as exc:
                self.finished = True  # the engine dropped the request itself
                error = engine_error(exc, self.engine)
                if error is None:
                    raise
                raise error from exc
            finally:
                self._waiter = None
            if out.finished:
                self.finished = True
            yield out

    async def close(self) -> None:
        """Abort the engine request unless it finished, and release the generator. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._first is not None and not self._first.done():
            self._first.cancel()
            with contextlib.suppress(BaseException):
                await self._first
        if not self.finished and self._gen is not None:
            self.aborted = True
            try:
                await asyncio.shield(self.engine.abort(self.request_id))
            except Exception:
                logger.exception("abort of %s failed", self.request_id)
        if self._gen is not None:
            with contextlib.suppress(Exception):
                await self._gen.aclose()  # type: ignore[attr-defined]


async def merge_outputs(streams: Sequence[EngineStream]) -> AsyncIterator[StreamOutput]:
    """Outputs of several engine requests as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0].outputs():
            yield StreamOutput(0, out)
        return
    iters = [s.outputs() for s in streams]
    pending: dict[asyncio.Future[RequestOutput], int] = {
        asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iters)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(iters[i].__anext__())] = i
                yield StreamOutput(i, out)
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
