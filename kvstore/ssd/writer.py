"""SSDWriter: write-behind for the SSD tier, so the engine thread never touches a file.

The engine calls ``submit(key, payload)`` as soon as a global-KV block is full; that only appends to an
in-memory queue and returns a ``concurrent.futures.Future``. One worker thread drains the queue in
batches::

    queue ──▶ [put, put, ..., put] ──▶ one store.flush() (fsync) ──▶ resolve the batch's futures
                                                                 └──▶ store.maintain() every interval

A future resolves to PutResult.STORED only after the fsync that covers its record returned, so a
STORED future means "durable". REFUSED (admission control) and FAILED (I/O) resolve the same way;
none of them raises. Memory is bounded: when the queued payloads exceed ``max_pending_bytes`` a new
submit resolves at once to DROPPED (counted) instead of blocking the engine; a dropped block is a
future miss. asyncio callers ``await writer.put(...)`` (``asyncio.wrap_future`` over the same queue).

Time here is only scheduling (the maintenance interval, waits): monotonic, not the store's clock.
Thread-safety: submit/flush/close/stats from any thread; ``_cond`` guards the queue and the stats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TypeVar

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.ssd.store import PutResult, SSDStore
from flashtier.kvstore.tenant import DEFAULT_TENANT_TAG, TAG_BYTES

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class WriterStats:
    """Counters of the write-behind queue (monotonic) and its current depth (gauges)."""

    submitted: int = 0
    stored: int = 0  # futures resolved STORED (durable)
    refused: int = 0  # admission refusals passed through from the store
    failed: int = 0  # I/O errors (put or fsync)
    dropped: int = 0  # refused at submit because the queue was over max_pending_bytes
    cancelled: int = 0  # futures cancelled while queued: not written
    batches: int = 0  # flushes (one fsync round each)
    pending_records: int = 0  # gauge
    pending_bytes: int = 0  # gauge: payload bytes queued, not yet written


@dataclass(slots=True)
class _Put:
    key: BlockHash
    payload: bytes
    future: Future[PutResult]
    tenant: bytes = DEFAULT_TENANT_TAG


@dataclass(slots=True)
class _Barrier:
    future: Future[bool]  # resolves to the flush's success once every earlier put is durable


class SSDWriter:
    """One worker thread that batches store.put calls and makes each batch durable with one flush."""

    def __init__(self, store: SSDStore, *, max_batch_records: int = 64, max_batch_bytes: int = 16 << 20,
                 max_pending_bytes: int = 256 << 20, maintain_interval_s: float = 1.0) -> None:  # fmt: skip
        """Start the worker. ValueError for non-positive bounds."""
        if min(max_batch_records, max_batch_bytes, max_pending_bytes) <= 0 or not maintain_interval_s > 0:
            raise ValueError("SSDWriter bounds and maintain_interval_s must be positive")
        self.store = store
        self._max_records, self._max_bytes = max_batch_records, max_batch_bytes
        self._max_pending = max_pending_bytes
        self._interval = maintain_interval_s
        self._queue: deque[_Put | _Barrier] = deque()
        self._cond = threading.Condition()
        self._stats = WriterStats()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="flashtier-ssd-writer", daemon=True)
        self._thread.start()

    # ---- engine side (never blocks on I/O) ---------------------------------------------------------
    def submit(self, key: BlockHash, payload: bytes | bytearray | memoryview,
               tenant: bytes = DEFAULT_TENANT_TAG) -> Future[PutResult]:
        """Queue one block of tenant ``tenant`` (a tag, kvstore/tenant.py); the future resolves after the
        record is durable (or refused/failed/dropped).

        Copies ``payload`` unless it is ``bytes`` (the caller may reuse its buffer). ValueError for a key,
        payload or tenant the store would reject; RuntimeError after close().
        """
        self.store.validate_record(key, payload)
        if not isinstance(tenant, bytes) or len(tenant) != TAG_BYTES:
            raise ValueError(f"a tenant is a {TAG_BYTES}-byte tag, got {tenant!r}")
        data = payload if isinstance(payload, bytes) else bytes(payload)
        future: Future[PutResult] = Future()
        with self._cond:
            if self._closing:
                raise RuntimeError("SSDWriter is closed")
            self._stats.submitted += 1
            if self._stats.pending_bytes + len(data) > self._max_pending:
                self._stats.dropped += 1
                future.set_result(PutResult.DROPPED)
                return future
            self._queue.append(_Put(key, data, future, tenant))
            self._stats.pending_records += 1
            self._stats.pending_bytes += len(data)
            self._cond.notify()
        return future

    async def put(self, key: BlockHash, payload: bytes | bytearray | memoryview) -> PutResult:
        """``submit`` for asyncio callers: awaits durability without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(key, payload))

    def discard_tenant(self, tenant: bytes) -> int:
        """Drop the queued, not yet written blocks of ``tenant``; their futures resolve to DROPPED. Returns
        how many. Mutates the queue and the pending gauges (``dropped`` counts them). Never blocks on I/O."""
        with self._cond:
            kept: deque[_Put | _Barrier] = deque()
            gone: list[_Put] = []
            for item in self._queue:
                (gone if isinstance(item, _Put) and item.tenant == tenant else kept).append(item)
            self._queue = kept
            for item in gone:
                self._stats.pending_records -= 1
                self._stats.pending_bytes -= len(item.payload)
                self._stats.dropped += 1
        for item in gone:
            if item.future.set_running_or_notify_cancel():
                item.future.set_result(PutResult.DROPPED)
        return len(gone)

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every block submitted before this call is durable (or refused/failed).

        Returns False on timeout or when the covering fsync failed. RuntimeError after close().
        """
        future: Future[bool] = Future()
        with self._cond:
            if self._closing:
                raise RuntimeError("SSDWriter is closed")
            self._queue.append(_Barrier(future))
            self._cond.notify()
        try:
            return future.result(timeout)
        except FutureTimeout:
            return False

    def close(self, timeout: float | None = None) -> None:
        """Write and flush everything queued, then stop the worker (the store stays open). Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)

    def stats(self) -> WriterStats:
        with self._cond:
            return dataclasses.replace(self._stats)

    # ---- worker ------------------------------------------------------------------------------------
    def _run(self) -> None:
        next_maintain = time.monotonic() + self._interval
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    wait = next_maintain - time.monotonic()
                    if wait <= 0 or not self._cond.wait(wait):
                        break
                batch = self._take_batch()
                stop = self._closing and not self._queue
            if batch:
                self._write(batch)
            if time.monotonic() >= next_maintain and not stop:
                self._guarded(self.store.maintain)
                next_maintain = time.monotonic() + self._interval
            if stop:
                return

    def _take_batch(self) -> list[_Put | _Barrier]:
        """Pop up to the batch bounds from the queue (``_cond`` held); mutates the pending gauges.

        A put whose future was cancelled while queued (e.g. its asyncio task was cancelled) is dropped
        here, unwritten; the others move to "running", so they can no longer be cancelled.
        """
        batch: list[_Put | _Barrier] = []
        nbytes = 0
        while self._queue and len(batch) < self._max_records and nbytes < self._max_bytes:
            item = self._queue.popleft()
            if isinstance(item, _Put):
                self._stats.pending_records -= 1
                self._stats.pending_bytes -= len(item.payload)
                if not item.future.set_running_or_notify_cancel():
                    self._stats.cancelled += 1
                    continue
                nbytes += len(item.payload)
            batch.append(item)
        return batch

    def _write(self, batch: list[_Put | _Barrier]) -> None:
        """put each record, one flush, then resolve: STORED only if the flush succeeded."""
        results: list[tuple[_Put, PutResult]] = []
        for item in batch:
            if isinstance(item, _Put):
                try:
                    results.append((item, self.store.put(item.key, item.payload, item.tenant)))
                except Exception as exc:  # a closed store or a bug: fail this future, keep serving
                    item.future.set_exception(exc)
        durable = self._guarded(self.store.flush) is True
        counts = {PutResult.STORED: 0, PutResult.REFUSED: 0, PutResult.FAILED: 0}
        for item, result in results:
            if result is PutResult.STORED and not durable:
                result = PutResult.FAILED
            counts[result] += 1
            item.future.set_result(result)
        with self._cond:
            self._stats.batches += 1
            self._stats.stored += counts[PutResult.STORED]
            self._stats.refused += counts[PutResult.REFUSED]
            self._stats.failed += counts[PutResult.FAILED]
        for item in batch:
            if isinstance(item, _Barrier):
                item.future.set_result(durable)

    @staticmethod
    def _guarded(fn: Callable[[], T]) -> T | None:
        """``fn()``, or None after logging an unexpected exception (the worker must survive it)."""
        try:
            return fn()
        except Exception:
            log.exception("SSD writer: %s failed", getattr(fn, "__name__", fn))
            return None
