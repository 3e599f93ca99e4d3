"""``RankProcesses``: the spawned rank processes of a parallel engine and the driver's end of their pipes.

One process per rank, started with multiprocessing's "spawn" context (a fresh interpreter: CUDA cannot
live in a forked child, and the server's threads must not be copied), each with one duplex pipe to the
driver. ``start`` waits until every rank has built its engine; ``stop`` reaps them, terminating those that
do not exit in time. The driver watches ``sentinels`` to notice a rank that exits at any moment.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
from multiprocessing.connection import Connection, wait

from collections.abc import Callable

from flashtier.engine.parallel.executor_messages import Failed, Phase, Ready
from flashtier.engine.parallel.rank_worker import RankSpec, rank_main

__all__ = ["RankProcesses", "RankStartError"]

log = logging.getLogger("flashtier.engine.parallel")


class RankStartError(RuntimeError):
    """A rank failed, exited or timed out before its engine was ready (every rank is stopped by then)."""


class RankProcesses:
    def __init__(self, spec: RankSpec) -> None:
        ctx = mp.get_context("spawn")
        self.spec = spec
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        self._rank_ends: list[Connection] = []  # closed here once the children hold them
        for rank in range(spec.parallel.world_size):
            driver_end, rank_end = ctx.Pipe(duplex=True)
            self.conns.append(driver_end)
            self.procs.append(ctx.Process(target=rank_main, args=(rank, spec, rank_end),
                                          name=f"flashtier-rank{rank}", daemon=True))
            self._rank_ends.append(rank_end)

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.procs]

    @property
    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.procs]

    def start(self, timeout_s: float | None = None, on_phase: Callable[[str], None] | None = None) -> list[Ready]:
        """Start every rank and wait for its ``Ready``; ``on_phase`` hears rank 0's start-up phases ("warming
        up"). RankStartError naming the first rank that reports a failure, exits, or is not ready within
        ``timeout_s`` (None: no limit); the ranks are stopped then."""
        for p in self.procs:
            p.start()
        for end in self._rank_ends:  # the children hold their own copies now
            end.close()
        ready: dict[int, Ready] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while len(ready) < len(self.procs):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                waiting = [r for r in range(len(self.procs)) if r not in ready]
                fired = wait([self.conns[r] for r in waiting] + [self.procs[r].sentinel for r in waiting], left)
                if not fired:
                    raise RankStartError(f"ranks {waiting} were not ready within {timeout_s:g} s")
                for r in waiting:
                    if self.conns[r].poll():
                        msg = self._expect_ready(r)
                        if isinstance(msg, Phase):
                            if on_phase is not None:
                                on_phase(msg.text)
                        else:
                            ready[r] = msg
                    elif not self.procs[r].is_alive():
                        raise RankStartError(f"rank {r} {self.describe_exit(r)} before its engine was ready")
        except BaseException:
            self.stop(0.0)
            self.close_pipes()
            raise
        return [ready[r] for r in range(len(self.procs))]

    def _expect_ready(self, rank: int) -> Ready | Phase:
        try:
            msg = self.conns[rank].recv()
        except (EOFError, OSError):
            raise RankStartError(f"rank {rank} {self.describe_exit(rank)} before its engine was ready") from None
        if isinstance(msg, Failed):
            log.error("rank %d failed to start:\n%s", rank, msg.detail)
            raise RankStartError(f"rank {rank} failed to start: {msg.error}")
        if not isinstance(msg, (Ready, Phase)):
            raise RankStartError(f"rank {rank} sent {type(msg).__name__} before Ready")
        return msg

    def describe_exit(self, rank: int) -> str:
        """How rank ``rank``'s process ended, for a log line: "(pid 12) exited with signal SIGKILL"."""
        p = self.procs[rank]
        p.join(0.5)  # the sentinel fires before the exit code is collected
        code = p.exitcode
        if code is None:
            return f"(pid {p.pid}) is still running"
        if code < 0:
            try:
                how = f"signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"signal {-code}"
        else:
            how = f"status {code}"
        return f"(pid {p.pid}) exited with {how}"

    def terminate(self) -> None:
        """SIGTERM to every rank still running (returns at once; ``stop`` reaps them)."""
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                p.terminate()

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the ranks to exit, SIGTERM the rest, SIGKILL what survives 5 s more,
        and reap all. Idempotent."""
        deadline = time.monotonic() + timeout_s
        started = [p for p in self.procs if p.pid is not None]
        for p in started:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in started:
            if p.is_alive():
                p.terminate()
        for p in started:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)

    def close_pipes(self) -> None:
        """Close the driver's ends (after ``stop`` and once no thread reads or writes them)."""
        for conn in self.conns:
            conn.close()
