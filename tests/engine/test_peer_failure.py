"""Which rank the engine-core client blames when a rank reports a failed collective (engine/parallel/executor.py).

A rank killed mid-collective makes its peers' collectives fail as its socket closes, which can be before its
own exit is collected: the survivor's ``Failed`` report may reach the client first. The client then waits up
to ``PEER_EXIT_GRACE_S`` for another rank's exit and names that rank. Driven here without processes: two
fake ranks whose "sentinels" are pipes, closed when the test says the rank exited.

Claims: the exited peer is named, whether it exited before the report or during the grace; a report with every
peer alive names its own rank once the grace has passed (the CI failure this fixes named the survivor).
"""

from __future__ import annotations

import os
import threading

import pytest

from flashtier.engine.config import EngineConfig
from flashtier.engine.parallel import ParallelConfig, executor
from flashtier.engine.parallel.executor import EngineCoreClient
from flashtier.engine.parallel.executor_messages import Failed
from flashtier.engine.parallel.rank_worker import RankSpec
from flashtier.kvstore.config import KVStoreConfig


class PipeRanks:
    """``RankProcesses``' interface for two ranks that are only their sentinels (read ends of pipes)."""

    def __init__(self) -> None:
        self._pipes = [os.pipe() for _ in range(2)]
        self.conns: list = []
        self.pids = [None, None]
        self.exited: set[int] = set()
        self.terminated = False

    @property
    def sentinels(self) -> list[int]:
        return [r for r, _ in self._pipes]

    def exit(self, rank: int) -> None:
        self.exited.add(rank)
        os.close(self._pipes[rank][1])  # the sentinel turns readable (EOF), as a process sentinel does

    def describe_exit(self, rank: int) -> str:
        return "(pid 1) exited with signal SIGKILL" if rank in self.exited else "(pid 1) is still running"

    def terminate(self) -> None:
        self.terminated = True

    def close(self) -> None:
        for r, w in self._pipes:
            os.close(r)
        for rank, (_, w) in enumerate(self._pipes):
            if rank not in self.exited:
                os.close(w)


@pytest.fixture
def client(monkeypatch):
    monkeypatch.setattr(executor, "PEER_EXIT_GRACE_S", 60.0)  # returns as soon as a sentinel fires
    ranks = PipeRanks()
    spec = RankSpec(ParallelConfig(tensor_parallel_size=2), EngineConfig(), KVStoreConfig(), 0, 0)
    yield EngineCoreClient(spec, ranks=ranks), ranks
    ranks.close()


def test_a_peer_that_exited_before_the_report_is_named(client):
    c, ranks = client
    ranks.exit(1)
    c._handle(0, Failed(0, "RuntimeError: Connection closed by peer"))
    assert c.error == "rank 1 (pid 1) exited with signal SIGKILL" and ranks.terminated


def test_a_peer_that_exits_during_the_grace_is_named(client):
    c, ranks = client
    timer = threading.Timer(0.3, ranks.exit, args=(1,))  # the killed rank's exit is collected after the report
    timer.start()
    try:
        c._handle(0, Failed(0, "RuntimeError: Connection closed by peer"))
    finally:
        timer.join()
    assert c.error == "rank 1 (pid 1) exited with signal SIGKILL"


def test_a_report_with_every_peer_alive_names_its_own_rank(client, monkeypatch):
    monkeypatch.setattr(executor, "PEER_EXIT_GRACE_S", 0.05)
    c, ranks = client
    c._handle(1, Failed(1, "torch.OutOfMemoryError: CUDA out of memory"))
    assert c.error == "rank 1 failed: torch.OutOfMemoryError: CUDA out of memory" and ranks.terminated
