"""Fault-injection harness: real `flashtier serve` processes, a real redis-server, real segment files.

Every answer is checked token for token. The model is the demo `tiny` preset in float64 (`--dtype
float64`), greedy (`temperature: 0`, `ignore_eos`), prompts are token ids (`return_token_ids`), so a
conversation resends exactly its previous prompt + output + new tokens, as an agent harness does.

What "right" means for one turn (``verify``):

- resume kind exact or cold: the tokens of the cold reference server (`--no-prefix-caching
  --no-kv-persist`, one per session) for the same prompt;
- resume kind replay (a cached prefix whose snapshot was missed: the model's bounded replay, an
  approximate window state by design): the oracle's plan (c), ``Plan.resume(R, n, T, W)``, with the
  conversation's earlier encoder restarts if it had any (see below).

The kind is ``usage.flashtier.resume.kind`` (with ``replay_from`` = R) as the server reports it. A
server that does not report it gets a derived kind: no cached token = cold; replayed tokens > W (the
encoder replayed a window besides the decoder's) = replay from R = cached_tokens; otherwise exact,
unless the conversation had an earlier replay (a resume of a replayed snapshot looks exact in the
counters: ``unknown``, length checked only).

The oracle follows a conversation's encoder restarts: a replay from R2 on top of blocks that an earlier
replay from R1 wrote is a cold run to R1, a restart at R1 - W, a restart at R2 - W (``Oracle.replay``).
A turn is ``exposed`` when it resumes exactly after a replay of its conversation, or comes after such a
turn (see below); every turn must be right, exposed or not.

Processes: every server and Redis a test starts is stopped by pid in a ``finally`` (``FaultServer.stop``
/ ``kill``, ``RedisServer.stop``); nothing listens outside 127.0.0.1. Servers run with
OMP_NUM_THREADS=1 so the suite fits two cores. ``FLASHTIER_FAULT_REPORT=path`` appends one JSON line per
scenario (the numbers in docs/reliability.md).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from .conversation import (  # noqa: F401 - the suites import these from here
    Conversation, Tally, Turn, classify, cold_of, dump_trace, record, verify, wrong_turns,
)
from .fault_server import (  # noqa: F401 - the suites import these from here
    BS, MAX_TOKENS, MODEL, REQUEST_TIMEOUT_S, START_TIMEOUT_S, W, FaultServer, Reply, chunk,
)
from .references import ColdReference, Oracle  # noqa: F401


# ---- fixtures -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def fault_cache(tmp_path_factory) -> Path:
    """One cache directory for every server of the suite (the demo checkpoint is written once)."""
    return tmp_path_factory.mktemp("fault-cache")


@pytest.fixture(scope="session")
def cold(fault_cache, tmp_path_factory):
    server = FaultServer(fault_cache, tmp_path_factory.mktemp("cold-logs"), "cold", "--no-prefix-caching",
                         "--no-kv-persist")
    ref = ColdReference(server)
    try:
        server.start()
        yield ref
    finally:
        ref.close()
        server.stop()


@pytest.fixture(scope="session")
def oracle(fault_cache, cold) -> Oracle:
    return Oracle(fault_cache)  # the cold server wrote the demo checkpoint into fault_cache


class Load:
    """Concurrent clients: one thread per conversation, each running its turns back to back against
    ``server`` (its URL is read at every attempt, so a restart on a new port is followed).

    A request without an answer (the server was killed under it) waits for the next server (``restarted``)
    and is sent again; with ``restarts=False`` it ends the run instead, as does any HTTP error status.
    """

    def __init__(self, server: FaultServer, convs: list[Conversation], cold: ColdReference | None,
                 restarts: bool = False, max_tokens: int = MAX_TOKENS) -> None:
        self.server, self.convs, self.cold, self.restarts, self.max_tokens = server, convs, cold, restarts, max_tokens
        self.turns: list[Turn] = []
        self.cond = threading.Condition()
        self.epoch = 0
        self.serving = True
        self.stopped = False
        self.in_flight = 0
        self.phase = "start"
        self.done = {c.cid: 0 for c in convs}  # answered turns in the current phase
        self.failure = ""
        self._threads = [threading.Thread(target=self._client, args=(c,), name=f"client-{c.cid}", daemon=True)
                         for c in convs]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _client(self, conv: Conversation) -> None:
        with httpx.Client() as http:
            while True:
                with self.cond:
                    while not self.serving and not self.stopped:
                        self.cond.wait()
                    if self.stopped:
                        return
                    epoch, url, phase = self.epoch, self.server.url, self.phase
                    self.in_flight += 1
                prompt = conv.prompt
                reply = self.server.post(prompt, self.max_tokens, client=http, url=url)
                with self.cond:
                    self.in_flight -= 1
                    self.turns.append(record(conv, phase, prompt, reply, self.cold, self.max_tokens))
                    if reply.ok:
                        conv.advance(reply.tokens)
                        self.done[conv.cid] += 1
                    elif reply.status is None and self.restarts:
                        while self.epoch == epoch and not self.stopped:
                            self.cond.wait()
                    else:
                        self.failure = self.failure or f"conv {conv.cid}: {reply.status} {reply.body} {reply.error}"
                        self.stopped = True
                    self.cond.notify_all()

    def set_phase(self, name: str) -> None:
        with self.cond:
            self.phase = name
            self.done = dict.fromkeys(self.done, 0)

    def wait_turns(self, k: int, timeout_s: float = 240) -> None:
        """Until every conversation answered ``k`` turns in the current phase (or the run failed)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not self.stopped and min(self.done.values()) < k:
                left = deadline - time.monotonic()
                assert left > 0, f"timed out waiting for {k} turns per conversation: {self.done}"
                self.cond.wait(left)
        assert not self.failure, self.failure

    def wait_in_flight(self, timeout_s: float = 60) -> int:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.in_flight == 0 and not self.stopped and time.monotonic() < deadline:
                self.cond.wait(0.05)
            return self.in_flight

    def hold(self) -> None:
        """New attempts wait (those in flight go on) until ``restarted``."""
        with self.cond:
            self.serving = False

    def restarted(self, phase: str) -> None:
        with self.cond:
            self.epoch += 1
            self.serving = True
            self.phase = phase
            self.done = dict.fromkeys(self.done, 0)
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        for t in self._threads:
            t.join(timeout=REQUEST_TIMEOUT_S)
