"""The engine as the server sees it: ``EngineClient``, an async protocol (``EngineCoreClient`` in
engine/parallel/executor.py implements it: the engine core in its own process).

The server never touches scheduler or model objects: it submits token ids with ``SamplingParams``,
iterates ``RequestOutput`` deltas, aborts, and reads stats. A test double may implement this protocol
with tokens chosen by the test, to drive output the random demo model would never produce (tool calls,
reasoning); everything around it stays real.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
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

    async def delete_tenant(self, tenant: str | None) -> TenantDeletionReport:
        """Delete tenant ``tenant`` (kvstore/tenant.py: a shared-mode cache_salt, a key's tenant hex, None
        for the default tenant) from the HBM prefix cache, the SSD tier and the snapshot pool.

        Requests running meanwhile finish normally. ``TenantDeletionUnsupported`` where the engine cannot
        (the server answers 501); ``EngineDeadError`` when the engine loop is gone; OSError / the snapshot
        pool's error when a tier failed (what was deleted before stays deleted; a retry finishes).
        """
        ...


@dataclass(frozen=True)
class TenantDeletionReport:
    """What ``EngineClient.delete_tenant`` removed, per tier (the admin route answers it as JSON)."""

    tenant_tag: str  # hex of the tenant's 16-byte tag (kvstore/tenant.py)
    hbm_free_blocks: int  # cached free blocks dropped from the prefix index
    hbm_in_use_blocks: int  # blocks running requests hold: unhashed now, free space once they finish
    ssd_queued_discarded: int  # write-through blocks dropped from the writer's queue
    ssd_records_deleted: int  # records of the tenant removed from the segment files (live and superseded)
    ssd_live_deleted: int  # of which the index served
    ssd_bytes_deleted: int
    ssd_unattributed_bytes: int  # bytes no tenant can be proven to own, dropped with them
    ssd_segments_rewritten: int
    ssd_records_kept: int  # other tenants' records copied out of rewritten segments
    snapshot_namespaces: int  # namespace roots searched in the snapshot pool
    snapshots_deleted: int
    seconds: float


class TenantDeletionUnsupported(RuntimeError):
    """This engine cannot delete a tenant while running (the server answers 501)."""


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


def settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    """Resolve ``fut`` with None, or with ``exc`` raised, unless it is already done (the caller gave up).
    On the future's loop (``call_soon_threadsafe`` from an engine thread)."""
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
