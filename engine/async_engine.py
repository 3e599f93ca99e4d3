"""``AsyncEngine``: the engine loop on its own thread, per-request asyncio queues of ``RequestOutput``.

    asyncio side (server)                         engine thread
    generate() --AddCommand(future)--> commands --> add_request (errors go back through the future)
    abort()    --AbortCommand--------> commands --> abort
    delete_tenant() --DeleteTenantCommand(future)--> drop_tenant (prefix index); then the tiers on a worker
    queue.get() <-- call_soon_threadsafe ------- step() outputs, one wake-up per loop and step (OutputHandoff)
The engine object is touched only by the engine thread. ``stats()`` reads counters without a lock
(a slightly stale snapshot is fine for metrics). The engine thread sleeps on one event while there is
nothing to do: no request, or a step that ran nothing (``Engine.stalled``: every request waits on a tier
lookup). Commands and finished lookups (``Engine.set_wake``) set it; a step loop that spun instead would
hold the GIL against the lookup's reader threads and multiply the restore's time.

A step's outputs reach the loop in one ``call_soon_threadsafe`` per loop (each is a self-pipe write that
releases the GIL: one per request let the loop start formatting after the first and made the engine thread
wait for the GIL at each of the others). While decode steps wait on the device longer than their host work
takes (CUDA graphs), a step's outputs are handed over once the next step has queued its forward
(``OutputHandoff``): the loop formats them while the device computes instead of competing with the next
step's host work for the GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from flashtier.engine.client import EngineDeadError, TenantDeletionReport, drain_outputs, settle
from flashtier.engine.engine import Engine
from flashtier.engine.output_handoff import OutputHandoff
from flashtier.engine.core.outputs import EngineStats, RequestOutput
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.tiers.manager import TierDeletion
from flashtier.kvstore.ssd.tenant_delete import TenantDeletion
from flashtier.kvstore.tenant import tenant_tag

log = logging.getLogger("flashtier.engine")

IDLE_WAIT_S = 0.05  # longest sleep without a wake-up (a safety net: commands and lookups set the event)


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


@dataclass(frozen=True)
class DeleteTenantCommand:
    """Drop a tenant's cached blocks from the prefix index (``Engine.drop_tenant``) between two steps."""

    tenant: str | None
    loop: asyncio.AbstractEventLoop  # the caller's loop: ``done`` is settled there
    done: asyncio.Future  # (TenantDrop, namespaces), or the exception


Command = AddCommand | AbortCommand | DeleteTenantCommand


@dataclass(frozen=True)
class _Stream:
    loop: asyncio.AbstractEventLoop  # the caller's loop (outputs are put from the engine thread)
    queue: asyncio.Queue  # RequestOutput items, or the exception that killed the engine


class AsyncEngine:
    """Implements ``EngineClient`` over a synchronous ``Engine``."""

    def __init__(self, engine: Engine, *, clock: Callable[[], float] = time.perf_counter):
        """``clock``: what ``OutputHandoff`` times steps with (tests pass a manual one)."""
        self.engine = engine
        self._commands: deque[Command] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._accepting = True
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="flashtier-engine", daemon=True)
        self.idle_wait_s = IDLE_WAIT_S
        engine.set_wake(self._wake.set)
        self._handoff = OutputHandoff(self._deliver, clock)
        engine.set_handoff_hook(self._handoff.point)

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
        # aclosing: a consumer that leaves early closes the inner stream at once (its abort), not at collection
        async with contextlib.aclosing(drain_outputs(queue, request_id,
                                                     lambda: self._send(AbortCommand(request_id)))) as outputs:
            async for item in outputs:
                yield item

    async def abort(self, request_id: str) -> None:
        self._send(AbortCommand(request_id))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def delete_tenant(self, tenant: str | None) -> TenantDeletionReport:
        """See ``EngineClient.delete_tenant``. The prefix-index part runs on the engine thread between two
        steps (``DeleteTenantCommand``: the engine's state has one owner); the SSD rewrite and the snapshot
        pool's deletion then run on a worker thread (``TierManager.delete_tenant``), so neither the event
        loop nor the engine thread waits on file or Redis I/O. The event loop does O(1) work.
        Failure: EngineDeadError when the engine loop has stopped; the tiers' errors are raised."""
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError("the engine loop has stopped")
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._send(DeleteTenantCommand(tenant, loop, done))
        dropped, namespaces = await done
        tiers = self.engine.tiers
        deleted = TierDeletion()
        if tiers is not None:
            deleted = await loop.run_in_executor(None, tiers.delete_tenant, tenant_tag(tenant), namespaces)
        ssd = deleted.ssd or TenantDeletion()
        return TenantDeletionReport(
            tenant_tag=tenant_tag(tenant).hex(), hbm_free_blocks=dropped.free_blocks,
            hbm_in_use_blocks=dropped.in_use_blocks, ssd_queued_discarded=deleted.queued_discarded,
            ssd_records_deleted=ssd.records_deleted, ssd_live_deleted=ssd.live_deleted,
            ssd_bytes_deleted=ssd.bytes_deleted, ssd_unattributed_bytes=ssd.unattributed_bytes,
            ssd_segments_rewritten=ssd.segments_rewritten, ssd_records_kept=ssd.records_kept,
            snapshot_namespaces=len(namespaces) if tiers is not None else 0,
            snapshots_deleted=deleted.snapshots_deleted, seconds=time.monotonic() - started)

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
        if isinstance(command, DeleteTenantCommand):
            try:
                result = self.engine.drop_tenant(command.tenant)
            except Exception as exc:  # noqa: BLE001 - handed to the caller (a 500 there, the engine goes on)
                command.loop.call_soon_threadsafe(settle, command.done, exc)
            else:
                command.loop.call_soon_threadsafe(_settle_value, command.done, result)
            return
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                    cache_salt=command.cache_salt)
        except Exception as exc:  # noqa: BLE001 - handed to the caller, who maps it to a 4xx
            command.loop.call_soon_threadsafe(settle, command.added, exc)
        else:
            command.loop.call_soon_threadsafe(settle, command.added, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Route outputs to their streams' queues: one ``call_soon_threadsafe`` per event loop. Forgets the
        streams of finished requests. A closed loop (its caller is gone) is skipped."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                self._streams.pop(out.request_id, None)
            batches.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # loop closed: nobody is reading these queues
                loop.call_soon_threadsafe(_put_all, items)

    def _run(self) -> None:
        while not self._stop:
            # cleared before the state is read: a command or a finished lookup after this point sets it
            # again, so the waits below can only miss nothing
            self._wake.clear()
            while self._commands:
                self._apply(self._commands.popleft())
            if not self.engine.has_unfinished():
                self._wake.wait(self.idle_wait_s)
                continue
            self._handoff.begin_step()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug in a step: fail every request rather than hang them
                log.exception("engine step failed; failing all in-flight requests")
                self._handoff.flush()  # the last step's outputs come before the error
                self._error = exc
                for stream in list(self._streams.values()):
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
                self._streams.clear()
                return
            stalled = self.engine.stalled
            self._handoff.end_step(outputs, next_step_now=not (stalled or self._stop)
                                   and self.engine.has_unfinished())
            if stalled:  # only a finished lookup or a command can change anything now
                self._wake.wait(self.idle_wait_s)
        self._handoff.flush()


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def _settle_value(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)

