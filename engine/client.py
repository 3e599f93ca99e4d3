"""The engine as the server sees it: ``EngineClient``, an async protocol (``AsyncEngine`` implements it).

The server never touches scheduler or model objects: it submits token ids with ``SamplingParams``,
iterates ``RequestOutput`` deltas, aborts, and reads stats. A test double may implement this protocol
with tokens chosen by the test, to drive output the random demo model would never produce (tool calls,
reasoning); everything around it stays real.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from flashtier.engine.core.outputs import EngineStats, RequestOutput
from flashtier.engine.sample.params import SamplingParams


class EngineClient(Protocol):
    @property
    def max_model_len(self) -> int: ...

    @property
    def eos_token_id(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """Width of the logits (token ids are below it); grammars are compiled for it."""
        ...

    def is_ready(self) -> bool: ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request; yields its outputs until one with ``finished=True``.

        Raises ``QueueFullError`` when the waiting queue is at its bound (the server answers 429) and
        ``ValueError`` for a request the engine cannot take (prompt + max_tokens over the context).
        Cancelling the iteration (client gone) aborts the request within one engine step.
        """
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting, finish or abort in-flight requests within ``timeout``, stop the loop."""
        ...


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full; retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; the request cannot complete."""


async def drain_outputs(queue: asyncio.Queue, request_id: str, abandon: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """Yield a request's outputs from ``queue`` (filled from the engine's side) until the finished one.

    An exception put on the queue (the engine died) raises ``EngineDeadError``. Leaving the iteration before
    the finished output (the consumer stopped, was cancelled, or the engine died) calls ``abandon`` once: the
    engine implementation aborts the request there. Shared by every ``EngineClient`` implementation.
    """
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
            abandon()
