"""``EngineCoreClient``: the ``EngineClient`` of the engine core, in its own process for every TP size.

    API process (event loop)       driver threads                        engine-core processes (rank_worker.py)
    generate() --AddEvent--> StepPacer --sender: StepInput, pickled once--> every rank: events, engine.step()
    abort()    --AbortEvent-->   |                                            |
    delete_tenant() --DeleteTenantEvent-->                                    |
    queue.get() <-- call_soon_threadsafe <-- monitor: StepDone, Woken, ------ rank 0
                                             TenantDeleted; sentinels, step timeout -> unhealthy

One design for every tensor-parallel size, as vLLM v1's API process <-> engine core <-> workers: the API
process (HTTP, tokenising, detokenising, tool and reasoning parsing) never runs the model. With one rank the
engine core runs in one child process with its only worker inside it (vLLM's uni-process executor) and the KV
tiers beside it, so a server is two processes. With N ranks every rank runs a whole ``Engine`` on its shard
and only the engine inputs are broadcast (SGLang's SPMD scheduler): every TP rank holds the same KV (the
latent, compressor, indexer and rings are replicated); given the same inputs before the same step
(``StepPacer``) and the same sampling seed, the schedulers and the sampled tokens agree, and rank 0's outputs
are everyone's. The event loop only files events and hands out outputs: pickling, pipe I/O and unpickling
happen on the two driver threads, and the model's host work never competes with the API for a GIL.

Failure: a rank that exits (its process sentinel), reports a failure, cannot be written to, or a step that
takes longer than ``step_timeout_s`` turns the client unhealthy: ``is_ready()`` is False (``/health``
503), every in-flight request fails with ``EngineDeadError`` (the server answers 503), new requests are
refused, and the remaining ranks are terminated. ``shutdown`` drains, stops the ranks and reaps them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import pickle
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch

from flashtier.engine.client import EngineDeadError, QueueFullError, TenantDeletionReport, drain_outputs, settle
from flashtier.engine.config import EngineConfig
from flashtier.engine.core.outputs import EngineStats, RequestOutput
from flashtier.engine.parallel.executor_messages import (AbortEvent, AddEvent, DeleteTenantEvent, EngineInfo, Failed,
                                                       StepDone, StepInput, TenantDeleted, Woken)
from flashtier.engine.parallel.parallel_config import ParallelConfig
from flashtier.engine.parallel.rank_processes import RankProcesses
from flashtier.engine.parallel.rank_worker import DEFAULT_LOG_FORMAT, RankSpec
from flashtier.engine.parallel.step_pacer import StepPacer
from flashtier.engine.parallel.wire_params import ParamsEncoder
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.tenant import tenant_tag

__all__ = ["EngineCoreClient", "start_engine_core"]

log = logging.getLogger("flashtier.engine.parallel")

STEP_TIMEOUT_S = 900.0  # a first step may compile kernels; a lost peer surfaces sooner (pg timeout, exit)
MONITOR_TICK_S = 0.25
# A rank killed mid-collective: its peers' collectives fail as its socket closes, which can be before its exit
# is collected; a peer's failure report waits this long for another rank's exit, to name the cause.
PEER_EXIT_GRACE_S = 3.0


@dataclass(frozen=True)
class _Stream:
    loop: asyncio.AbstractEventLoop  # the caller's loop: outputs are put there from the monitor thread
    queue: asyncio.Queue  # RequestOutput items, or the exception that ended the engine
    added: asyncio.Future  # None once rank 0 queued the request, or the exception add_request raised


class EngineCoreClient:
    """Implements ``EngineClient`` over ``spec.parallel.world_size`` engine-core processes. Build with
    ``start_engine_core`` (or construct, then ``start()``)."""

    def __init__(self, spec: RankSpec, *, step_timeout_s: float = STEP_TIMEOUT_S, lookahead: int = 2,
                 phase: Callable[[str], None] | None = None, ranks: RankProcesses | None = None) -> None:
        """``phase``: hears rank 0's start-up phases ("warming up"), on the thread that calls ``start``.
        ``ranks``: what runs the ranks (default: ``RankProcesses(spec)``; a test passes an object with the
        same interface that steps an engine of its own on a thread, to look inside it)."""
        self.spec = spec
        self._phase = phase
        self._deletions: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._next_token = 0
        self.step_timeout_s = step_timeout_s
        self.ranks = ranks if ranks is not None else RankProcesses(spec)
        self.pacer = StepPacer(lookahead)
        self._streams: dict[str, _Stream] = {}
        self._info: EngineInfo | None = None
        self._stats = EngineStats()
        self._accepting = False
        self._stopping = False
        self._error: str | None = None
        self._lock = threading.Lock()  # the first failure wins
        self._sender = threading.Thread(target=self._send_loop, name="flashtier-tp-sender", daemon=True)
        self._monitor = threading.Thread(target=self._monitor_loop, name="flashtier-tp-monitor", daemon=True)

    # ---- EngineClient ---------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self._ready_info().max_model_len

    @property
    def eos_token_id(self) -> int:
        return self._ready_info().eos_token_id

    @property
    def vocab_size(self) -> int:
        return self._ready_info().vocab_size

    @property
    def worker_pids(self) -> list[int | None]:
        return self.ranks.pids

    @property
    def error(self) -> str | None:
        """Why the engine is unavailable (None while healthy)."""
        return self._error

    def is_ready(self) -> bool:
        return self._info is not None and self._accepting and self._error is None

    def start(self, timeout_s: float | None = None) -> "EngineCoreClient":
        """Spawn the ranks and wait until each has built its engine (blocking). RankStartError otherwise."""
        ready = self.ranks.start(timeout_s, self._phase)
        self._info, self._stats = ready[0].info, ready[0].stats
        self._accepting = True
        self._sender.start()
        self._monitor.start()
        p = self.spec.parallel
        if p.world_size == 1:
            log.info("engine core: pid %d", ready[0].pid)
        else:
            log.info("parallel engine: %d ranks (tensor parallel %d, expert parallel %s), pids %s, rendezvous "
                     "127.0.0.1:%d", p.world_size, p.tensor_parallel_size, "on" if p.expert_parallel else "off",
                     [r.pid for r in ready], self.spec.port)
        if self._info.warmup_s is not None:
            log.info("warm-up: %.1f s", self._info.warmup_s)
        return self

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, cache_salt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Submit and stream a request's outputs (``prompt_token_ids`` must not change after the call: it is
        pickled later, on the sender thread). Cancelling the iteration aborts it."""
        if self._error is not None:
            raise EngineDeadError(f"the engine is unavailable: {self._error}")
        if not self._accepting:
            raise RuntimeError("the engine is shutting down")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), loop.create_future())
        self._streams[request_id] = stream
        self.pacer.submit(AddEvent(request_id, prompt_token_ids, params, cache_salt))
        if self._error is not None:  # failed between the check and the registration: nobody else settles it
            self._streams.pop(request_id, None)
            raise EngineDeadError(f"the engine is unavailable: {self._error}")
        try:
            await stream.added
        except BaseException:
            self._streams.pop(request_id, None)
            self.pacer.submit(AbortEvent(request_id))  # cancelled before admission: it may still be queued
            raise
        # aclosing: a consumer that leaves early closes the inner stream at once (its abort), not at collection
        async with contextlib.aclosing(drain_outputs(stream.queue, request_id,
                                                     lambda: self._abandon(request_id))) as outputs:
            async for item in outputs:
                yield item

    def _abandon(self, request_id: str) -> None:
        """The caller left a request's stream before its end: forget the stream and abort the request."""
        self._streams.pop(request_id, None)
        self.pacer.submit(AbortEvent(request_id))

    async def abort(self, request_id: str) -> None:
        self.pacer.submit(AbortEvent(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    async def delete_tenant(self, tenant: str | None) -> TenantDeletionReport:
        """See ``EngineClient.delete_tenant``. Every rank drops the tenant from its prefix index before the same
        step (``DeleteTenantEvent``: the engine's state has one owner per rank); rank 0 then deletes it from the
        tiers on its own thread and answers. The event loop does O(1) work and waits.
        Failure: EngineDeadError when the engine is unavailable; OSError for an SSD failure, RuntimeError for
        another tier error (the message names it)."""
        if self._error is not None:
            raise EngineDeadError(f"the engine is unavailable: {self._error}")
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:
            token = self._next_token
            self._next_token += 1
            self._deletions[token] = (loop, done)
        self.pacer.submit(DeleteTenantEvent(token, tenant))
        if self._error is not None:  # failed meanwhile: _fail may have run before the registration
            self._deletions.pop(token, None)
            raise EngineDeadError(f"the engine is unavailable: {self._error}")
        r = await done
        return TenantDeletionReport(
            tenant_tag=tenant_tag(tenant).hex(), hbm_free_blocks=r.hbm_free_blocks,
            hbm_in_use_blocks=r.hbm_in_use_blocks, ssd_queued_discarded=r.ssd_queued_discarded,
            ssd_records_deleted=r.ssd_records_deleted, ssd_live_deleted=r.ssd_live_deleted,
            ssd_bytes_deleted=r.ssd_bytes_deleted, ssd_unattributed_bytes=r.ssd_unattributed_bytes,
            ssd_segments_rewritten=r.ssd_segments_rewritten, ssd_records_kept=r.ssd_records_kept,
            snapshot_namespaces=r.snapshot_namespaces, snapshots_deleted=r.snapshots_deleted,
            seconds=time.monotonic() - started)

    def engine_summary(self) -> str:
        """The start-up summary's engine line."""
        i, p = self._ready_info(), self.spec.parallel
        size = i.num_blocks * i.block_bytes
        if p.world_size == 1:
            return (f"engine: device {i.device}, dtype {i.dtype}, HBM pool {i.num_blocks:,} blocks of "
                    f"{i.block_size} tokens x {i.block_bytes:,} B = {size / (1 << 30):.2f} GiB (engine core pid "
                    f"{self.ranks.pids[0]})")
        return (f"engine: {p.world_size} ranks (tensor parallel {p.tensor_parallel_size}, expert parallel "
                f"{'on' if p.expert_parallel else 'off'}), rank 0 on {i.device}, dtype {i.dtype}, HBM pool per "
                f"rank {i.num_blocks:,} blocks of {i.block_size} tokens x {i.block_bytes:,} B = "
                f"{size / (1 << 30):.2f} GiB")

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting; let in-flight requests finish for up to ``timeout`` s, abort the rest, stop the ranks
        (terminated when they do not exit within 10 s) and reap them."""
        self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        while self._streams and self._error is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for rid in list(self._streams):
            self.pacer.submit(AbortEvent(rid))
        deadline = time.monotonic() + 2.0  # one step delivers the aborted requests' final outputs
        while self._streams and self._error is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._stopping = True
        self.pacer.request_stop()
        await loop.run_in_executor(None, self._reap, 10.0)
        self._fail_streams(EngineDeadError("the engine stopped"))

    # ---- driver threads -------------------------------------------------------------------------
    def _ready_info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("the parallel engine is not started")
        return self._info

    def _send_loop(self) -> None:
        encoder = ParamsEncoder()
        try:
            while True:
                step = self.pacer.next_input()
                if step is None:
                    return
                events = tuple(dataclasses.replace(e, params=encoder.encode(e.params)) if isinstance(e, AddEvent)
                               else e for e in step.events)
                payload = pickle.dumps(StepInput(step.step, events, step.stop), protocol=pickle.HIGHEST_PROTOCOL)
                for rank, conn in enumerate(self.ranks.conns):
                    try:
                        conn.send_bytes(payload)
                    except (OSError, ValueError) as exc:
                        self._fail(f"rank {rank} cannot be reached ({type(exc).__name__}: {exc})")
                        return
                if step.stop:
                    return
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave requests hanging
            log.exception("the parallel engine's sender failed")
            self._fail(f"the driver's sender failed: {exc}")

    def _monitor_loop(self) -> None:
        conns = dict(enumerate(self.ranks.conns))
        sentinels = dict(enumerate(self.ranks.sentinels))
        try:
            while sentinels:  # until every rank process has exited
                fired = set(wait([*conns.values(), *sentinels.values()], MONITOR_TICK_S))
                for rank, conn in list(conns.items()):
                    if conn in fired:
                        try:
                            msg = conn.recv()
                        except (EOFError, OSError):
                            del conns[rank]  # its process is gone: the sentinel says how
                            continue
                        self._handle(rank, msg)
                for rank, sentinel in list(sentinels.items()):
                    if sentinel in fired:
                        del sentinels[rank]
                        if not self._stopping:
                            self._fail(f"rank {rank} {self.ranks.describe_exit(rank)}")
                if not self._stopping and self.pacer.waited_s() > self.step_timeout_s:
                    self._fail(f"a step took longer than {self.step_timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave requests hanging
            log.exception("the parallel engine's monitor failed")
            self._fail(f"the driver's monitor failed: {exc}")
        finally:
            self.pacer.close()

    def _handle(self, rank: int, msg: object) -> None:
        if isinstance(msg, StepDone):
            self._deliver(msg)
        elif isinstance(msg, Woken):
            self.pacer.wake()
        elif isinstance(msg, TenantDeleted):
            self._answer_deletion(msg)
        elif isinstance(msg, Failed):
            gone = self._exited_peer(rank)
            if gone is not None:  # a peer's death surfaced here first as a collective error
                self._fail(f"rank {gone} {self.ranks.describe_exit(gone)}")
                return  # after another failure this is usually its echo (a lost peer): quieter
            log.log(logging.ERROR if self._error is None else logging.DEBUG, "rank %d failed:\n%s", rank, msg.detail)
            self._fail(f"rank {rank} failed: {msg.error}")
        else:
            self._fail(f"rank {rank} sent an unexpected {type(msg).__name__}")

    def _exited_peer(self, rank: int) -> int | None:
        """A rank other than ``rank`` whose process has exited, waiting up to ``PEER_EXIT_GRACE_S`` for one (a
        failure report with every peer alive is its own rank's failure, and costs that wait; monitor thread)."""
        peers = {sentinel: r for r, sentinel in enumerate(self.ranks.sentinels) if r != rank}
        fired = wait(list(peers), PEER_EXIT_GRACE_S) if peers else []
        return peers[fired[0]] if fired else None

    def _deliver(self, done: StepDone) -> None:
        for rid, result in done.admitted:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if result is not None:
                self._streams.pop(rid, None)
            _post(stream.loop, settle, stream.added, _admission_error(result))
        for out in done.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                self._streams.pop(out.request_id, None)
            _post(stream.loop, stream.queue.put_nowait, out)
        self._stats = done.stats
        self.pacer.done(done.step, done.unfinished and not done.stalled)

    def _answer_deletion(self, msg: TenantDeleted) -> None:
        with self._lock:
            waiter = self._deletions.pop(msg.token, None)
        if waiter is None:
            return
        loop, fut = waiter
        if msg.error is None:
            _post(loop, _settle_value, fut, msg.result)
        else:
            kind, text = msg.error
            _post(loop, settle, fut, OSError(text) if kind in _OS_ERRORS else RuntimeError(f"{kind}: {text}"))

    def _fail(self, reason: str) -> None:
        """Turn unhealthy (once): fail every request, stop releasing steps, terminate the ranks."""
        with self._lock:
            if self._error is not None:
                return
            self._error = reason
        log.error("parallel engine unavailable: %s; failing %d in-flight request(s)", reason, len(self._streams))
        self.pacer.close()
        self._fail_streams(EngineDeadError(reason))
        self.ranks.terminate()

    def _fail_streams(self, exc: BaseException) -> None:
        for rid in list(self._streams):
            stream = self._streams.pop(rid, None)
            if stream is not None:
                _post(stream.loop, _fail_stream, stream, exc)
        with self._lock:
            deletions, self._deletions = self._deletions, {}
        for loop, fut in deletions.values():
            _post(loop, settle, fut, exc)

    def _reap(self, timeout_s: float) -> None:
        self.ranks.stop(timeout_s)
        self.pacer.close()
        for thread in (self._sender, self._monitor):
            if thread.is_alive():
                thread.join(5.0)
        self.ranks.close_pipes()


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """``fn(*args)`` on ``loop`` (from a driver thread); dropped when that loop is closed (its caller is gone)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _admission_error(result: tuple[str, str] | None) -> BaseException | None:
    if result is None:
        return None
    kind, message = result
    return ValueError(message) if kind == "value" else QueueFullError(message) if kind == "queue_full" else (
        RuntimeError(message))


_OS_ERRORS = {"OSError", "IOError", "FileNotFoundError", "PermissionError", "TimeoutError", "BlockingIOError"}


def _settle_value(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail_stream(stream: _Stream, exc: BaseException) -> None:
    settle(stream.added, exc)
    stream.queue.put_nowait(exc)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine_core(
    parallel: ParallelConfig,
    config: EngineConfig,
    kv: KVStoreConfig,
    token_map: torch.Tensor | None = None,
    *,
    seed: int | None = None,
    tiers: bool = False,
    threads: int | None = None,
    log_level: str = "warning",
    log_format: str = DEFAULT_LOG_FORMAT,
    pg_timeout_s: float = 600.0,
    start_timeout_s: float | None = None,
    **client_kwargs,
) -> EngineCoreClient:
    """Spawn the engine-core process(es) of ``parallel`` (blocking until every engine is built and warmed up)
    and return the started client.

    ``seed``: the sampling seed of every rank (None: one random seed shared by all). ``tiers``: the SSD tier and
    snapshot pool (one rank only). ``threads``: torch intra-op threads per rank (None: this process's count
    with one rank, 1 per rank with several). ``client_kwargs``: ``EngineCoreClient``'s (``phase``,
    ``step_timeout_s``). ValueError for what the engine core does not run (data parallelism; speculative
    decoding or tiers with several ranks); RankStartError when a rank fails to start.
    """
    if parallel.data_parallel_size != 1:
        raise ValueError(f"--data-parallel-size {parallel.data_parallel_size}: data parallel serving is not "
                         "supported; use --tensor-parallel-size")
    if config.speculative_tokens and parallel.world_size > 1:
        raise ValueError("speculative decoding cannot run with --tensor-parallel-size > 1: the DSpark drafter "
                         "reads the whole vocabulary head")
    if threads is None:
        threads = torch.get_num_threads() if parallel.world_size == 1 else 1
    spec = RankSpec(parallel, config, kv, free_port() if parallel.world_size > 1 else 0,
                    secrets.randbits(63) if seed is None else seed,
                    None if token_map is None else token_map.tolist(), pg_timeout_s=pg_timeout_s, threads=threads,
                    tiers=tiers, log_level=log_level, log_format=log_format)
    return EngineCoreClient(spec, **client_kwargs).start(start_timeout_s)
