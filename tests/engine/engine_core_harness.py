"""``ThreadRank``: ``RankProcesses``' interface over an engine this test built, stepped on a thread here.

The engine-core client (engine/parallel/executor.py) drives it exactly as it drives a spawned engine-core
process — the same pipe messages, the same ``RankLoop`` — while the test keeps the ``Engine`` object and can
look inside it (its pool, its tiers) or give it a ``TierManager`` of its own. The sentinel is the read end of
an os.pipe whose write end closes when the loop's thread ends, as a process sentinel fires when it exits.

    client = in_process_engine_core(engine)      # started; await client.shutdown() at the end
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.parallel import ParallelConfig
from flashtier.engine.parallel.executor import EngineCoreClient
from flashtier.engine.parallel.executor_messages import Ready
from flashtier.engine.parallel.rank_worker import RankLoop, RankSpec, Sender, engine_info
from flashtier.kvstore.config import KVStoreConfig


class ThreadRank:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        driver_end, self._rank_end = multiprocessing.Pipe(duplex=True)
        self.conns = [driver_end]
        self._sentinel_r, self._sentinel_w = os.pipe()
        self._spec = RankSpec(ParallelConfig(), EngineConfig(), KVStoreConfig(), 0, 0)
        self.thread = threading.Thread(target=self._main, name="engine-core-thread", daemon=True)

    @property
    def pids(self) -> list[int | None]:
        return [os.getpid()]

    @property
    def sentinels(self) -> list[int]:
        return [self._sentinel_r]

    def start(self, timeout_s: float | None = None, on_phase: Callable[[str], None] | None = None) -> list[Ready]:
        self.thread.start()
        msg = self.conns[0].recv()
        assert isinstance(msg, Ready), msg
        return [msg]

    def _main(self) -> None:
        sender = Sender(self._rank_end)
        try:
            sender.send(Ready(0, os.getpid(), engine_info(self.engine, self._spec, None), self.engine.stats()))
            RankLoop(0, self.engine, self._rank_end, sender).run()
        finally:
            self.engine.close()  # as the engine-core process does on its way out: the tiers flushed
            self._rank_end.close()
            os.close(self._sentinel_w)  # the sentinel fires: the "process" is gone

    def describe_exit(self, rank: int) -> str:
        return "(the test's engine thread) ended"

    def terminate(self) -> None:
        self._rank_end.close()  # its loop reads EOF and ends

    def stop(self, timeout_s: float) -> None:
        self.thread.join(max(timeout_s, 5.0))

    def close_pipes(self) -> None:
        self.conns[0].close()


def in_process_engine_core(engine: Engine, **kwargs) -> EngineCoreClient:
    """A started engine-core client over ``engine``, stepped on a thread of this process."""
    rank = ThreadRank(engine)
    return EngineCoreClient(rank._spec, ranks=rank, **kwargs).start()
