"""SIGKILL of a real server under load, three times: a failing process costs a cache miss and a retry,
never a wrong answer.

Three clients run multi-turn conversations concurrently against one server (SSD tier in --kv-dir, snapshot
pool in a real redis-server). At a random moment while requests are in flight the server is SIGKILLed
and a new one starts on the same --kv-dir and Redis. Requests cut off by the kill have no answer (a reset
or a refused connection) and are sent again to the new server. Every answered turn must equal the cold
server's tokens (or, if it resumed by bounded replay, the oracle's plan (c)); the first turn of every
conversation after a restart must resume from the tiers (cached tokens > 0, some of them from the SSD).

A restart can make a turn a bounded replay even with Redis up (the new server's first Redis call can
exceed the 0.25 s timeout on a loaded machine: a counted miss). Every turn must be right, also the
exact resumes of a conversation that replayed earlier (block provenance, see conftest.py).
"""

from __future__ import annotations

import random
import time

import pytest

from ..kvstore.redis_server import RedisServer
from .conftest import Conversation, FaultServer, Load, Tally, dump_trace, verify, wrong_turns

KILLS = 3
CLIENTS = 3


@pytest.mark.slow
def test_sigkill_under_load_then_restart_answers_equal_cold(tmp_path, fault_cache, cold, oracle):
    t0 = time.monotonic()
    rng = random.Random(20261201)
    redis = RedisServer()
    srv = None
    tally = Tally("server SIGKILL under load (x3), restart on the same --kv-dir and Redis")
    convs = [Conversation(cid, first=200 + 40 * cid, step=48) for cid in range(CLIENTS)]
    kill_in_flight = []
    try:
        redis.start()
        srv = FaultServer(fault_cache, tmp_path, "sigkill", "--kv-dir", str(tmp_path / "kv"), "--redis-url", redis.url)
        srv.start()
        scans = []  # what each restarted server's start-up scan found
        with Load(srv, convs, cold, restarts=True) as load:
            load.set_phase("before kill 1")
            for k in range(1, KILLS + 1):
                load.wait_turns(1)
                time.sleep(rng.uniform(0.0, 1.2))
                assert load.wait_in_flight() > 0
                load.hold()
                with load.cond:
                    kill_in_flight.append(load.in_flight)
                srv.kill()
                srv.start()
                scans.append(srv.metric_map("flashtier_ssd_"))
                load.restarted(f"after kill {k}")
            load.wait_turns(1)
        turns = load.turns
        assert not load.failure, load.failure
        verify(turns, cold, oracle)
        dump_trace("sigkill", turns, cold)
        tally.add(turns)
        # the first answer of every conversation after each restart came from the tiers
        for k in range(1, KILLS + 1):
            for c in convs:
                first = next(t for t in turns if t.cid == c.cid and t.phase == f"after kill {k}" and t.reply.ok)
                usage = first.reply.usage
                assert usage["prompt_tokens_details"]["cached_tokens"] > 0, (k, c.cid, usage)
                assert usage["flashtier"]["cached_tokens_by_tier"]["hbm"] == 0, (k, c.cid, usage)
                assert usage["flashtier"]["cached_tokens_by_tier"]["ssd"] > 0, (k, c.cid, usage)
        tally.observed = {
            "kills": KILLS, "requests in flight at the kills": sum(kill_in_flight),
            "ssd_torn_bytes at restarts": [s.get("flashtier_ssd_torn_bytes_total") for s in scans],
            "ssd_corrupt_records at restarts": [s.get("flashtier_ssd_corrupt_records_total") for s in scans],
            "ssd_entries at restarts": [s.get("flashtier_ssd_entries") for s in scans],
            "ssd_hits, last server": srv.metric("flashtier_ssd_hits_total"),
        }
        assert tally.no_answer > 0  # the kills really cut requests off
        assert tally.server_errors == 0 and tally.http_errors == 0
        assert tally.wrong == 0, "\n".join(wrong_turns(turns))
    finally:
        if srv is not None:
            srv.kill()
        redis.close()
        tally.seconds = round(time.monotonic() - t0, 1)
        tally.report()
