"""The rank process: ``rank_main`` joins the process group, builds its ``Engine`` and steps it in lockstep.

    start   init_distributed (tcp on 127.0.0.1) -> build_rank_engine -> seed -> Ready (or Failed) to the driver
    loop    StepInput from the driver: apply its events in order, then engine.step() if anything is
            unfinished; rank 0 sends StepDone (outputs, admission results, stats) back
    end     a StepInput with stop, or the driver's end of the pipe closing (the server is gone): exit 0;
            an error (a lost peer surfaces as a collective error after the process group's timeout, or at
            once when its socket closes): Failed to the driver, exit 1

Every rank sees the same events before the same step and draws its samples from the same seed, so the
schedulers, the sampled tokens and the KV stay identical on every rank, and the collectives inside the
forward keep the ranks in step. SIGINT is ignored: a terminal's Ctrl-C reaches the whole process group,
and the driver stops its ranks itself after draining.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from flashtier.engine.client import QueueFullError
from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.parallel.executor_messages import (
    AddEvent,
    EngineInfo,
    Failed,
    Ready,
    StepDone,
    StepInput,
)
from flashtier.engine.parallel.parallel_config import ParallelConfig
from flashtier.engine.parallel.process_group import init_distributed, shutdown_distributed
from flashtier.engine.parallel.rank_engine import build_rank_engine, rank_device
from flashtier.engine.parallel.wire_params import ParamsDecoder
from flashtier.kvstore.config import KVStoreConfig

__all__ = ["RankSpec", "rank_main"]


@dataclass(frozen=True)
class RankSpec:
    """What every rank is started with (pickled to each spawned process)."""

    parallel: ParallelConfig
    engine: EngineConfig
    kv: KVStoreConfig
    port: int  # the process group's rendezvous on 127.0.0.1
    seed: int  # torch.manual_seed on every rank: the same draws for requests without their own seed
    token_map: list[int] | None = None  # the Engram token map (model.set_token_map), as a list
    pg_timeout_s: float = 600.0  # a collective waiting longer raises (a lost or hung peer)
    threads: int = 1  # torch intra-op threads per rank


def admission_result(exc: BaseException | None) -> tuple[str, str] | None:
    """What rank 0 reports for an ``add_request``: None (queued) or (kind, message); kind "value",
    "queue_full" or "error" (the driver raises ValueError, QueueFullError or RuntimeError)."""
    if exc is None:
        return None
    kind = "queue_full" if isinstance(exc, QueueFullError) else "value" if isinstance(exc, ValueError) else "error"
    return kind, str(exc)


def _start(rank: int, spec: RankSpec) -> Engine:
    device = rank_device(spec.engine.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = init_distributed(spec.parallel, rank, device=device, init_method=f"tcp://127.0.0.1:{spec.port}",
                              timeout_s=spec.pg_timeout_s)
    token_map = None if spec.token_map is None else torch.tensor(spec.token_map, dtype=torch.int64)
    engine = build_rank_engine(spec.engine, spec.kv, groups, device, token_map)
    torch.manual_seed(spec.seed)  # after the build: equal generator states whatever the build drew
    return engine


def _info(engine: Engine) -> EngineInfo:
    cfg = engine.model.cfg
    return EngineInfo(engine.max_model_len, cfg.eos_token_id, cfg.vocab_size, str(engine.model.device),
                      engine.config.dtype, engine.pool.num_blocks, engine.layout.block_size,
                      engine.layout.block_bytes)


def _run_step(engine: Engine, msg: StepInput, decoder: ParamsDecoder) -> StepDone:
    t0 = time.perf_counter()
    admitted = []
    for event in msg.events:
        if not isinstance(event, AddEvent):
            engine.abort(event.request_id)
            continue
        try:
            engine.add_request(event.request_id, event.prompt_token_ids, decoder.decode(event.params),
                               cache_salt=event.cache_salt)
        except Exception as exc:  # noqa: BLE001 - every rank rejects alike; rank 0 reports it to the caller
            admitted.append((event.request_id, admission_result(exc)))
        else:
            admitted.append((event.request_id, None))
    outputs = engine.step() if not msg.stop and engine.has_unfinished() else []
    return StepDone(msg.step, tuple(outputs), tuple(admitted), engine.stats(), engine.has_unfinished(),
                    time.perf_counter() - t0)


def _loop(rank: int, engine: Engine, conn: Connection) -> None:
    decoder = ParamsDecoder()
    while True:
        try:
            msg: StepInput = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the driver is gone
        done = _run_step(engine, msg, decoder)
        if rank == 0:
            conn.send_bytes(pickle.dumps(done, protocol=pickle.HIGHEST_PROTOCOL))
        if msg.stop:
            return


def _fail(conn: Connection, rank: int, exc: BaseException) -> None:
    detail = traceback.format_exc()
    line = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    try:
        conn.send(Failed(rank, line, detail))
    except (OSError, ValueError):
        pass  # the driver is gone; the exit code tells it anyway


def rank_main(rank: int, spec: RankSpec, conn: Connection) -> None:
    """Entry of the spawned rank process. Exits 0 on a stop or a lost driver, 1 after reporting a failure."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo binds to loopback, whatever the host name resolves to
    torch.set_num_threads(spec.threads)
    torch.set_grad_enabled(False)
    try:
        engine = _start(rank, spec)
        conn.send(Ready(rank, os.getpid(), _info(engine), engine.stats()))
        _loop(rank, engine, conn)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, then the process exits 1
        _fail(conn, rank, exc)
        raise SystemExit(1) from None
    finally:
        shutdown_distributed()
