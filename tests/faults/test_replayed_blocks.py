"""A turn reported as an exact resume must equal a cold run, even after the conversation went through a
bounded replay and back (found by test_redis_faults.py; this is its shortest deterministic form).

One conversation, one server (SSD tier + a real redis-server), sequential turns:

    T1  300 tokens                  cold
    T2  T1 + out + 48               exact (T1's generation-end snapshot at 303)
        -- Redis SIGSTOPped --
    T3  T2 + out + 48               the lookup times out: bounded replay from R = 352; the blocks it fills
                                    ([320, 400) onward) hold an approximate state: hashed on the replayed fork
        -- SIGCONT, the breaker's back-off passes --
    T4  T3 + out + 48               exact: T2's snapshot at 355 is found, [355, n) is recomputed exactly and
                                    its blocks registered under the exact chain (T3's stay on the fork)
    T5  T4 + out + 48               exact: T4's snapshot at 459 over T4's exact blocks [0, 448)

Before block provenance (kvstore/block_hash.fork_root) T3's approximate blocks were registered under the
exact chain, T4 could not replace them, and T5 resumed "exactly" over them: tokens differed from a cold run.
"""

from __future__ import annotations

import signal
import time

import pytest

from ..kvstore.redis_server import RedisServer
from .conftest import Conversation, FaultServer, Tally, Turn, dump_trace, record, verify, wrong_turns


@pytest.mark.slow
def test_exact_resume_after_a_replayed_turn_equals_cold(tmp_path, fault_cache, cold, oracle):
    t0 = time.monotonic()
    redis = RedisServer()
    srv = None
    tally = Tally("exact resume after a replayed turn (Redis SIGSTOP for one turn)")
    conv = Conversation(0, first=300, step=48)
    turns: list[Turn] = []

    def turn(phase: str) -> Turn:
        prompt = conv.prompt
        t = record(conv, phase, prompt, srv.complete(prompt), cold)
        turns.append(t)
        conv.advance(t.reply.tokens)
        return t

    try:
        redis.start()
        srv = FaultServer(fault_cache, tmp_path, "replayed", "--kv-dir", str(tmp_path / "kv"), "--redis-url", redis.url)
        srv.start()
        srv.warm()
        assert turn("T1").kind == "cold"
        assert turn("T2").kind == "exact"
        redis.proc.send_signal(signal.SIGSTOP)
        try:
            t3 = turn("T3")
        finally:
            redis.proc.send_signal(signal.SIGCONT)
        assert t3.kind == "replay" and t3.replay_from == 352, t3.reply.usage
        time.sleep(2.5)  # the breaker's first back-off (1 s) passes: T4's lookup probes Redis and finds it
        t4 = turn("T4")
        assert t4.kind == "exact" and t4.reply.usage["prompt_tokens_details"]["cached_tokens"] == 355, t4.reply.usage
        t5 = turn("T5")
        assert t5.kind == "exact", t5.reply.usage
        verify(turns, cold, oracle)
        dump_trace("replayed", turns, cold)
        tally.add(turns)
        tally.observed = {"kinds": [t.kind for t in turns], "wrong": [t.phase for t in turns if t.wrong]}
        assert not any(t.wrong for t in turns[:4]), "\n".join(wrong_turns(turns))
        assert not t5.wrong, "\n".join(wrong_turns(turns))
    finally:
        if redis.proc is not None and redis.proc.poll() is None:
            redis.proc.send_signal(signal.SIGCONT)
        if srv is not None:
            srv.kill()
        redis.close()
        tally.seconds = round(time.monotonic() - t0, 1)
        tally.report()
