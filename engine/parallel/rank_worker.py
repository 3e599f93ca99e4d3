"""The engine-core process: ``rank_main`` builds its ``Engine`` (and, with several ranks, joins the process
group first) and steps it as the driver releases steps.

    start   (world > 1: init_distributed over tcp on 127.0.0.1) -> build the engine -> warm-up (Phase
            "warming up" first) -> seed -> Ready (or Failed) to the driver
    loop    StepInput from the driver: apply its events in order, then engine.step() if anything is
            unfinished; rank 0 sends StepDone (outputs, admission results, stats) back
    stalled (one rank with tiers) every request waits on a tier lookup: rank 0 waits on its pipe and on the
            engine's wake fd; a finished lookup sends Woken, and the driver releases the next step
    end     a StepInput with stop: the engine closed (SSD writer flushed, snapshot pool saved), exit 0;
            the server gone (its end of the pipe closed, or this process re-parented, checked every
            PARENT_POLL_S even mid-step): os._exit at once, as if killed with it, so a server restarted on
            the same --kv-dir finds the SSD tier's lock free (the tier is crash-safe by design);
            an error (a lost peer surfaces as a collective error after the process group's timeout, or at
            once when its socket closes): Failed to the driver, exit 1

One process design for every tensor-parallel size (vLLM's API process <-> engine core <-> workers, with the
worker inside the engine core as vLLM's uni-process executor): with one rank this process is the engine core
and its only worker, and runs the KV tiers (SSD writer, snapshot pool, their I/O threads); with N ranks every
rank runs a whole engine core on its shard (SGLang's SPMD scheduler), tiers off. Every rank sees the same
events before the same step and draws its samples from the same seed, so the schedulers, the sampled tokens
and the KV stay identical on every rank, and the collectives inside the forward keep the ranks in step.

A tenant's deletion drops its blocks from every rank's prefix index between two steps (``DeleteTenantEvent``);
rank 0 then deletes it from the tiers on a thread (file rewrites, Redis) and answers ``TenantDeleted``, so the
step loop never waits on that I/O. Rank 0's pipe is written by the loop and that thread: ``Sender`` locks it.

SIGINT is ignored: a terminal's Ctrl-C reaches the whole process group, and the driver stops its ranks itself
after draining. Log records go to stderr (inherited from the server) in the server's format, tagged with the
rank.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch

from flashtier.engine.client import QueueFullError
from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.factory import build_engine
from flashtier.engine.parallel.executor_messages import (
    AddEvent,
    DeleteTenantEvent,
    EngineInfo,
    Failed,
    Phase,
    Ready,
    StepDone,
    StepInput,
    TenantDeleted,
    TenantDeletionResult,
    Woken,
)
from flashtier.engine.parallel.parallel_config import ParallelConfig
from flashtier.engine.parallel.process_group import init_distributed, shutdown_distributed
from flashtier.engine.parallel.rank_engine import build_rank_engine, rank_device
from flashtier.engine.parallel.wire_params import ParamsDecoder
from flashtier.engine.tiers.manager import TierDeletion
from flashtier.engine.warmup import warm_up
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.ssd.tenant_delete import TenantDeletion
from flashtier.kvstore.tenant import tenant_tag

__all__ = ["RankLoop", "RankSpec", "Sender", "bind_cuda_device", "engine_info", "rank_main"]

log = logging.getLogger("flashtier.engine.parallel")

DEFAULT_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PARENT_POLL_S = 0.1  # how often the engine core checks that the server that spawned it still runs


@dataclass(frozen=True)
class RankSpec:
    """What every rank is started with (pickled to each spawned process)."""

    parallel: ParallelConfig
    engine: EngineConfig
    kv: KVStoreConfig
    port: int  # the process group's rendezvous on 127.0.0.1 (unused with one rank)
    seed: int  # torch.manual_seed on every rank: the same draws for requests without their own seed
    token_map: list[int] | None = None  # the Engram token map (model.set_token_map), as a list
    pg_timeout_s: float = 600.0  # a collective waiting longer raises (a lost or hung peer)
    threads: int = 1  # torch intra-op threads per rank
    tiers: bool = False  # attach the SSD tier / snapshot pool (one rank only: ValueError otherwise)
    log_level: str = "WARNING"  # the rank's root logger level ("trace" = DEBUG)
    log_format: str = DEFAULT_LOG_FORMAT

    def __post_init__(self) -> None:
        if self.tiers and self.parallel.world_size != 1:
            raise ValueError("the KV tiers run with one rank only: their lookups finish on I/O threads at times "
                             "two ranks would not share, so the ranks would schedule differently")


def admission_result(exc: BaseException | None) -> tuple[str, str] | None:
    """What rank 0 reports for an ``add_request``: None (queued) or (kind, message); kind "value",
    "queue_full" or "error" (the driver raises ValueError, QueueFullError or RuntimeError)."""
    if exc is None:
        return None
    kind = "queue_full" if isinstance(exc, QueueFullError) else "value" if isinstance(exc, ValueError) else "error"
    return kind, str(exc)


class Sender:
    """Rank 0's end of the pipe, written by the step loop and the tenant-deletion thread (one lock)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, msg: object) -> None:
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._conn.send_bytes(payload)


def bind_cuda_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device. Plain ``cuda`` (one rank's ``--device cuda``) means the
    current device, already bound: ``torch.cuda.set_device`` refuses a device without an index. Mutates the
    process's current CUDA device; raises what torch raises for an index it does not have."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def _start(rank: int, spec: RankSpec, sender: Sender) -> tuple[Engine, float | None]:
    """Build the rank's engine (collective with several ranks) and warm it up. Returns it and the warm-up time."""
    world = spec.parallel.world_size
    token_map = None if spec.token_map is None else torch.tensor(spec.token_map, dtype=torch.int64)
    if world == 1:  # the engine core is the only worker: the single-process build, tiers included
        bind_cuda_device(torch.device(spec.engine.device))
        engine = build_engine(spec.engine, spec.kv, token_map, tiers=spec.tiers)
    else:
        device = rank_device(spec.engine.device, rank)
        bind_cuda_device(device)
        groups = init_distributed(spec.parallel, rank, device=device, init_method=f"tcp://127.0.0.1:{spec.port}",
                                  timeout_s=spec.pg_timeout_s)
        engine = build_rank_engine(spec.engine, spec.kv, groups, device, token_map)
    warmup_s = None
    if spec.engine.warmup:  # every rank runs the same throwaway steps: the collectives stay matched
        if rank == 0:
            sender.send(Phase("warming up"))
        warmup_s = warm_up(engine).total_s
    torch.manual_seed(spec.seed)  # after the build and warm-up: equal generator states whatever they drew
    return engine, warmup_s


def engine_info(engine: Engine, spec: RankSpec, warmup_s: float | None) -> EngineInfo:
    cfg = engine.model.cfg
    return EngineInfo(engine.max_model_len, cfg.eos_token_id, cfg.vocab_size, str(engine.model.device),
                      engine.config.dtype, engine.pool.num_blocks, engine.layout.block_size,
                      engine.layout.block_bytes, spec.parallel.world_size, engine.tiers is not None, warmup_s)


class RankLoop:
    """One rank's step loop. Owns the engine (this thread is its only user, the deletion thread touches only
    the tiers)."""

    def __init__(self, rank: int, engine: Engine, conn: Connection, sender: Sender) -> None:
        self.rank = rank
        self.engine = engine
        self.conn = conn
        self.sender = sender
        self.decoder = ParamsDecoder()
        self._wake_r: int | None = None
        if rank == 0 and engine.tiers is not None:  # lookups finish on I/O threads: a byte on a pipe wakes us
            self._wake_r, wake_w = os.pipe()
            os.set_blocking(wake_w, False)
            engine.set_wake(lambda: _poke(wake_w))

    def run(self) -> bool:
        """Step until a stop (True) or until the driver is gone (False)."""
        stalled = False
        while True:
            if stalled and self._wake_r is not None:
                fired = wait([self.conn, self._wake_r])
                if self._wake_r in fired:
                    os.read(self._wake_r, 4096)
                    stalled = False  # one Woken per stall; the next step says whether it still is
                    self.sender.send(Woken())
                if self.conn not in fired:
                    continue
            try:
                msg: StepInput = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                return False  # the driver is gone
            done = self.run_step(msg)
            stalled = done.stalled
            if self.rank == 0:
                self.sender.send(done)
            if msg.stop:
                return True

    def run_step(self, msg: StepInput) -> StepDone:
        engine = self.engine
        t0 = time.perf_counter()
        admitted = []
        for event in msg.events:
            if isinstance(event, AddEvent):
                try:
                    engine.add_request(event.request_id, event.prompt_token_ids, self.decoder.decode(event.params),
                                       cache_salt=event.cache_salt)
                except Exception as exc:  # noqa: BLE001 - every rank rejects alike; rank 0 reports it to the caller
                    admitted.append((event.request_id, admission_result(exc)))
                else:
                    admitted.append((event.request_id, None))
            elif isinstance(event, DeleteTenantEvent):
                self.delete_tenant(event)
            else:
                engine.abort(event.request_id)
        outputs = engine.step() if not msg.stop and engine.has_unfinished() else []
        stalled = bool(outputs == [] and engine.stalled and engine.tiers is not None and engine.has_unfinished())
        return StepDone(msg.step, tuple(outputs), tuple(admitted), engine.stats(), engine.has_unfinished(),
                        time.perf_counter() - t0, stalled)

    def delete_tenant(self, event: DeleteTenantEvent) -> None:
        """Drop the tenant from this rank's prefix index now; rank 0 deletes it from the tiers on a thread and
        answers. Failure: the error goes back to the caller in ``TenantDeleted``; the engine goes on."""
        try:
            dropped, namespaces = self.engine.drop_tenant(event.tenant)
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            if self.rank == 0:
                self.sender.send(TenantDeleted(event.token, None, (type(exc).__name__, str(exc))))
            return
        if self.rank != 0:
            return
        tiers = self.engine.tiers

        def tiers_part() -> None:
            try:
                deleted = (tiers.delete_tenant(tenant_tag(event.tenant), namespaces) if tiers is not None
                           else TierDeletion())
            except Exception as exc:  # noqa: BLE001 - handed to the caller (a 500 there; what went stays gone)
                self.sender.send(TenantDeleted(event.token, None, (type(exc).__name__, str(exc))))
                return
            ssd = deleted.ssd or TenantDeletion()
            self.sender.send(TenantDeleted(event.token, TenantDeletionResult(
                hbm_free_blocks=dropped.free_blocks, hbm_in_use_blocks=dropped.in_use_blocks,
                ssd_queued_discarded=deleted.queued_discarded, ssd_records_deleted=ssd.records_deleted,
                ssd_live_deleted=ssd.live_deleted, ssd_bytes_deleted=ssd.bytes_deleted,
                ssd_unattributed_bytes=ssd.unattributed_bytes, ssd_segments_rewritten=ssd.segments_rewritten,
                ssd_records_kept=ssd.records_kept, snapshot_namespaces=len(namespaces) if tiers is not None else 0,
                snapshots_deleted=deleted.snapshots_deleted)))

        threading.Thread(target=tiers_part, name="flashtier-tenant-delete", daemon=True).start()


def _poke(fd: int) -> None:
    try:
        os.write(fd, b"\x01")
    except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
        pass


def _fail(conn: Connection, rank: int, exc: BaseException) -> None:
    detail = traceback.format_exc()
    line = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    try:
        conn.send(Failed(rank, line, detail))
    except (OSError, ValueError):
        pass  # the driver is gone; the exit code tells it anyway


def _configure_logging(rank: int, spec: RankSpec) -> None:
    handler = logging.StreamHandler()
    fmt = spec.log_format.replace("%(message)s", f"[rank {rank}] %(message)s") if spec.parallel.world_size > 1 \
        else spec.log_format
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel("DEBUG" if spec.log_level == "trace" else spec.log_level.upper())


def _exit_with_parent(parent: int) -> None:
    """A daemon thread: end this process at once when the server that spawned it is gone (SIGKILL included:
    a step may run for seconds before the pipe's EOF is read)."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(0)


def rank_main(rank: int, spec: RankSpec, conn: Connection) -> None:
    """Entry of the spawned rank process. Exits 0 on a stop, at once on a lost server, 1 after reporting a
    failure."""
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="flashtier-parent-watch",
                     daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo binds to loopback, whatever the host name resolves to
    _configure_logging(rank, spec)
    torch.set_num_threads(spec.threads)
    torch.set_grad_enabled(False)
    sender = Sender(conn)
    engine = None
    try:
        engine, warmup_s = _start(rank, spec, sender)
        sender.send(Ready(rank, os.getpid(), engine_info(engine, spec, warmup_s), engine.stats()))
        if not RankLoop(rank, engine, conn, sender).run():
            os._exit(0)  # the server is gone: no graceful close (see the module docstring)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, then the process exits 1
        _fail(conn, rank, exc)
        raise SystemExit(1) from None
    finally:
        if engine is not None:
            try:
                engine.close()  # flushes the SSD writer, saves the embedded snapshot pool
            except Exception:  # noqa: BLE001 - exiting anyway; the tiers say what they lost
                log.exception("closing the engine failed")
        shutdown_distributed()
