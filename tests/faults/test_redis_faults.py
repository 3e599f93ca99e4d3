"""The snapshot pool's Redis frozen (SIGSTOP) and killed (SIGKILL) under load: every request completes.

Three clients run conversations against one server (SSD tier + a real redis-server) through these phases:

    redis up            2 turns each (cold, then exact resumes)
    SIGSTOP mid-load    1 turn each: Redis calls time out, the breaker opens, lookups miss
    SIGCONT             turns until the server says Redis is back (snapshot_redis_down = 0), then 1 more
    SIGKILL mid-load    1 turn each: connections refused, lookups miss
    restart (empty)     turns until Redis is back, then 1 more

A missed snapshot makes the next turn a bounded replay (the model's design: an approximate window, so in
float64 its tokens differ from a cold run). So: 100 % of the requests must be answered 200 with
max_tokens tokens; a turn the server reports as ``usage.flashtier.resume.kind`` exact or cold must equal
the cold server's tokens, and a replay turn must equal the oracle's bounded replay from the reported R
(with the conversation's earlier restarts, see conftest.py). Every turn must be right, also the exact
resumes of a conversation that replayed earlier (block provenance, see conftest.py).
"""

from __future__ import annotations

import signal
import time

import pytest

from ..kvstore.redis_server import RedisServer
from .conftest import Conversation, FaultServer, Load, Tally, dump_trace, verify, wrong_turns

CLIENTS = 3


def _wait_redis_back(srv: FaultServer, timeout_s: float = 90) -> float:
    """Until the server's breaker has closed again (it probes Redis after a growing back-off)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if srv.metric("flashtier_snapshot_redis_down") == 0:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"the server did not see Redis back within {timeout_s} s")


@pytest.mark.slow
def test_redis_sigstop_and_sigkill_under_load_every_request_completes(tmp_path, fault_cache, cold, oracle):
    t0 = time.monotonic()
    redis = RedisServer()
    srv = None
    tally = Tally("Redis SIGSTOP then SIGCONT, Redis SIGKILL then restart (empty), mid-load")
    convs = [Conversation(cid, first=220 + 40 * cid, step=40) for cid in range(CLIENTS)]
    observed: dict = {}
    try:
        redis.start()
        srv = FaultServer(fault_cache, tmp_path, "redis", "--kv-dir", str(tmp_path / "kv"), "--redis-url", redis.url)
        srv.start()
        with Load(srv, convs, cold) as load:
            load.set_phase("redis up")
            load.wait_turns(2)

            assert load.wait_in_flight() > 0
            redis.proc.send_signal(signal.SIGSTOP)
            load.set_phase("redis stopped")
            try:
                load.wait_turns(1)
            finally:
                redis.proc.send_signal(signal.SIGCONT)
            load.set_phase("redis continued, breaker open")
            observed["seconds until the server saw Redis back after SIGCONT"] = round(_wait_redis_back(srv), 1)
            load.set_phase("redis back after SIGCONT")
            load.wait_turns(1)

            assert load.wait_in_flight() > 0
            redis.proc.send_signal(signal.SIGKILL)
            redis.proc.wait(timeout=10)
            load.set_phase("redis killed")
            load.wait_turns(1)
            redis.restart()  # same port, empty
            load.set_phase("redis restarted, breaker open")
            observed["seconds until the server saw Redis back after the restart"] = round(_wait_redis_back(srv), 1)
            load.set_phase("redis back after restart")
            load.wait_turns(1)
        turns = load.turns
        assert not load.failure, load.failure
        verify(turns, cold, oracle)
        dump_trace("redis", turns, cold)
        tally.add(turns)
        m = srv.metric_map("flashtier_snapshot_")
        keep = ("redis_op_errors", "redis_op_timeouts", "redis_skipped", "redis_breaker_opens", "lookup_")
        observed.update({k.removeprefix("flashtier_"): v for k, v in m.items() if any(x in k for x in keep) and v})
        pool_lines = [ln for ln in srv.log_text().splitlines() if "flashtier.kvstore.snapshot.redis_pool" in ln]
        down = [ln for ln in pool_lines if "went down" in ln or "unreachable" in ln]
        back = [ln for ln in pool_lines if ln.endswith("is back")]
        observed["log: WARNING 'redis snapshot pool ... went down' lines"] = len(down)
        observed["log: WARNING 'redis snapshot pool ... is back' lines"] = len(back)
        by_phase: dict[str, dict[str, int]] = {}
        for t in turns:
            if t.reply.ok:
                by_phase.setdefault(t.phase, {}).setdefault(t.kind, 0)
                by_phase[t.phase][t.kind] += 1
        observed["kinds by phase"] = by_phase
        tally.observed = observed
        assert tally.completed == tally.sent, (tally.sent, tally.completed, load.failure)
        assert tally.wrong == 0, "\n".join(wrong_turns(turns))
        opens = m.get("flashtier_snapshot_redis_breaker_opens_total", 0)
        assert opens >= 2, m  # SIGSTOP and SIGKILL each opened the breaker ...
        assert len(down) == opens and len(back) == opens, pool_lines  # ... and each said so once, as did recovery
        assert all(" WARNING " in ln for ln in down + back), pool_lines
        assert sum(v for k, v in m.items() if "redis_op_timeouts" in k) > 0, m  # SIGSTOP: calls timed out
        # with Redis answering, the 2 turns of every conversation before the faults resumed exactly
        assert by_phase["redis up"].get("replay", 0) <= CLIENTS, by_phase  # only those in flight at SIGSTOP
    finally:
        if redis.proc is not None and redis.proc.poll() is None:
            redis.proc.send_signal(signal.SIGCONT)
        if srv is not None:
            srv.kill()
        redis.close()
        tally.seconds = round(time.monotonic() - t0, 1)
        tally.report()
