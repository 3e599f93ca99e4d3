"""The snapshot pools' fault handling: CircuitBreaker on a fake clock; RedisSnapshotPool's breaker against a
real redis-server frozen with SIGSTOP or killed with SIGKILL (calls skipped at once during the back-off,
one probe after it, recovery), its log lines (once per transition) and per-operation counters; and
points_many on both pools (equal to per-block points(), one deadline, failure = all empty, counted once)."""

import asyncio
import logging
import signal
import time

import pytest

from flashtier.kvstore.block_hash import BlockHash, hash_blocks, namespace_hash
from flashtier.kvstore.circuit_breaker import CircuitBreaker, Permit
from flashtier.kvstore.snapshot.redis_pool import REDIS_OPS, RedisSnapshotPool
from flashtier.kvstore.snapshot.key import SnapshotKey
from flashtier.kvstore.snapshot.pool import EmbeddedSnapshotPool

from .redis_server import RedisServer, free_port

NS = namespace_hash("redis-breaker-test", None)
BLOCKS = hash_blocks(NS, list(range(6 * 8)), 8)
TIMEOUT_S = 0.2
BASE_S = 0.4  # the breaker's first back-off here
FAST_S = TIMEOUT_S / 2  # a skipped call (no I/O, no await) answers well within this
POOL_LOG = "flashtier.kvstore.snapshot.redis_pool"


def key(tail_len=3, block=0, salt=0):
    parent = BLOCKS[block] if block >= 0 else NS
    return SnapshotKey.for_tail(NS, parent, [900 + salt + i for i in range(tail_len)])


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


async def timed(aw):
    t0 = time.monotonic()
    out = await aw
    return out, time.monotonic() - t0


def run_pool(url, body, **kw):
    async def go():
        pool = RedisSnapshotPool(url, timeout_s=TIMEOUT_S, breaker_base_s=kw.pop("base", BASE_S),
                                 breaker_max_s=kw.pop("max_s", 4 * BASE_S), **kw)  # fmt: skip
        try:
            return await body(pool)
        finally:
            await pool.close()

    return asyncio.run(go())


def messages(caplog, needle):
    return [r.getMessage() for r in caplog.records if r.name == POOL_LOG and needle in r.getMessage()]


@pytest.fixture
def own_server():
    with RedisServer() as server:
        yield server


# -- CircuitBreaker ---------------------------------------------------------------------------------------


def test_breaker_backs_off_doubling_to_the_cap_and_resets_on_success():
    clock = FakeClock()
    b = CircuitBreaker(base_s=1.0, max_s=4.0, clock=clock)
    assert b.allow() is Permit.CALL and not b.is_open
    assert b.failed() is True and b.open_until == 101.0 and b.opens == 1
    assert b.failed() is False and b.open_until == 101.0  # a call sent before it opened: no change
    clock.t = 100.999
    assert b.allow() is Permit.SKIP
    periods = []
    for _ in range(4):  # each failed probe doubles the back-off: 2, 4, then capped at 4
        clock.t = b.open_until
        assert b.allow() is Permit.PROBE and b.allow() is Permit.SKIP  # one probe at a time
        assert b.failed(probe=True) is False
        periods.append(b.open_until - clock.t)
    assert periods == [2.0, 4.0, 4.0, 4.0] and b.opens == 1
    clock.t = b.open_until
    assert b.allow() is Permit.PROBE
    assert b.succeeded() is True and not b.is_open and b.backoff_s == 1.0
    assert b.succeeded() is False and b.allow() is Permit.CALL
    assert b.failed() is True and b.open_until == clock.t + 1.0 and b.opens == 2  # reset to the base


def test_breaker_release_lets_the_next_call_probe():
    clock = FakeClock()
    b = CircuitBreaker(base_s=1.0, max_s=30.0, clock=clock)
    b.failed()
    clock.t += 1.0
    assert b.allow() is Permit.PROBE
    b.release()  # the probe was cancelled: no verdict
    assert b.allow() is Permit.PROBE and b.is_open
    with pytest.raises(ValueError):
        CircuitBreaker(base_s=2.0, max_s=1.0)


# -- the Redis pool's breaker --------------------------------------------------------------------------------


def test_frozen_redis_is_paid_for_once_then_skipped_until_a_probe_succeeds(own_server, caplog):
    caplog.set_level(logging.INFO, logger=POOL_LOG)

    async def body(pool):
        assert await pool.put(key(), b"v")
        own_server.proc.send_signal(signal.SIGSTOP)
        try:
            first = await timed(pool.get(key()))  # pays the timeout; opens the breaker
            skipped = [await timed(pool.get(key())), await timed(pool.put(key(4), b"w")),
                       await timed(pool.points(NS, BLOCKS[0])),
                       await timed(pool.points_many(NS, BLOCKS[:3]))]  # fmt: skip
            during = pool.stats()
            await asyncio.sleep(BASE_S)
            probe = await timed(pool.get(key()))  # still frozen: the probe times out, back-off doubles
            after_probe = pool.stats()
            still = await timed(pool.get(key()))
            await asyncio.sleep(BASE_S)  # half of the doubled back-off
            still_skipped = await timed(pool.get(key()))
        finally:
            own_server.proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(BASE_S + 0.05)
        return first, skipped, during, probe, after_probe, still, still_skipped, await pool.get(key()), pool.stats()

    first, skipped, during, probe, after_probe, still, still_skipped, value, end = run_pool(own_server.url, body)
    assert first[0] is None and TIMEOUT_S * 0.9 < first[1] < TIMEOUT_S + 0.3
    assert [r for r, _ in skipped] == [None, False, {}, [{}, {}, {}]]
    assert all(dt < FAST_S for _, dt in skipped), skipped
    assert (during.timeouts, during.redis_errors, during.errors, during.put_failures) == (1, 1, 2, 1)
    assert during.redis_down == 1
    assert {op: n for op, n in during.skipped_by_op.items() if n} == {"get": 1, "put": 1, "points": 1, "points_many": 1}
    assert probe[0] is None and probe[1] >= TIMEOUT_S * 0.9  # the probe went out and paid the timeout
    assert after_probe.timeouts_by_op["get"] == 2 and after_probe.breaker_opens == 1
    assert still[1] < FAST_S and still_skipped[1] < FAST_S  # back-off is now 2 x BASE_S
    assert value == b"v"
    assert (end.redis_down, end.breaker_opens, end.hits, end.skipped_by_op["get"]) == (0, 1, 1, 3)
    assert len(messages(caplog, "went down")) == 1 and len(messages(caplog, "is back")) == 1
    assert [r.levelname for r in caplog.records if r.name == POOL_LOG] == ["WARNING", "WARNING"]


def test_killed_redis_then_restarted_recovers_after_the_backoff(own_server, caplog):
    caplog.set_level(logging.INFO, logger=POOL_LOG)

    async def body(pool):
        assert await pool.put(key(), b"v")
        own_server.proc.send_signal(signal.SIGKILL)
        own_server.proc.wait(5)
        down = [await timed(pool.put(key(), b"w")) for _ in range(5)]
        own_server.restart()  # empty, same port
        early = await timed(pool.get(key()))  # the back-off is not over: skipped though Redis is back
        await asyncio.sleep(pool.breaker.open_until - time.monotonic() + 0.01)
        return down, early, await pool.put(key(), b"again"), await pool.get(key()), pool.stats()

    down, early, stored, value, st = run_pool(own_server.url, body, base=3.0, max_s=6.0)  # restart takes a while
    assert [r for r, _ in down] == [False] * 5 and all(dt < TIMEOUT_S + 0.3 for _, dt in down)
    assert early == (None, early[1]) and early[1] < FAST_S
    assert stored and value == b"again"
    assert (st.errors_by_op["put"], st.skipped_by_op["put"], st.skipped_by_op["get"], st.put_failures) == (1, 4, 1, 5)
    assert (st.redis_errors, st.timeouts, st.errors, st.hits, st.redis_down) == (1, 0, 1, 1, 0)
    assert len(messages(caplog, "went down")) == 1 and len(messages(caplog, "is back")) == 1


def test_unreachable_at_start_is_said_once(caplog):
    caplog.set_level(logging.INFO, logger=POOL_LOG)

    async def body(pool):
        out = [await pool.get(key()) for _ in range(3)]
        await asyncio.sleep(0.15)
        out.append(await pool.get(key()))  # a failed probe: still down, nothing new to say
        return out, pool.stats()

    out, st = run_pool(f"redis://127.0.0.1:{free_port()}", body, base=0.1)
    assert out == [None] * 4
    assert (st.errors_by_op["get"], st.skipped_by_op["get"], st.errors, st.breaker_opens) == (2, 2, 4, 1)
    assert len(messages(caplog, "is unreachable")) == 1 and not messages(caplog, "is back")


def test_an_error_reply_is_counted_but_does_not_open_the_breaker(own_server, caplog):
    caplog.set_level(logging.INFO, logger=POOL_LOG)
    admin = own_server.client()
    admin.hset(key(5).redis_key(), "not", "a string")  # GET of it: WRONGTYPE

    async def body(pool):
        bad = [await pool.get(key(5)), await pool.get(key(5))]
        assert await pool.put(key(6), b"fine")
        return bad, await pool.get(key(6)), pool.stats()

    bad, value, st = run_pool(own_server.url, body)
    assert bad == [None, None] and value == b"fine"
    assert (st.errors_by_op["get"], st.redis_errors, st.breaker_opens, sum(st.skipped_by_op.values())) == (2, 2, 0, 0)
    assert len(messages(caplog, "refused get")) == 1 and not messages(caplog, "went down")


# -- points_many -----------------------------------------------------------------------------------------------


KEYS = [key(1), key(3), key(3, block=1), key(6, block=1, salt=4), key(2, block=-1), key(7, block=4)]
PROBED = [NS, BLOCKS[0], BLOCKS[1], BLOCKS[2], BLOCKS[4], BLOCKS[1]]  # the root, a duplicate, an empty one


async def fill_and_compare(pool):
    for k in KEYS:
        assert await pool.put(k, b"p")
    many = await pool.points_many(NS, PROBED)
    one_by_one = [await pool.points(NS, h) for h in PROBED]
    return many, one_by_one


def test_points_many_equals_points_on_redis(own_server):
    admin = own_server.client()
    admin.set(SnapshotKey.for_tail(NS, BLOCKS[3], [1]).directory_key(), b"a string, not a hash")

    async def body(pool):
        many, one_by_one = await fill_and_compare(pool)
        before = pool.stats()
        mixed = await pool.points_many(NS, [BLOCKS[3], BLOCKS[0]])  # WRONGTYPE for the first key only
        return many, one_by_one, before, mixed, await pool.points_many(NS, []), pool.stats()

    many, one_by_one, before, mixed, empty, st = run_pool(own_server.url, body)
    assert many == one_by_one
    assert many[0] == {2: key(2, block=-1).tail_hash.hex()} and many[3] == {} and many[5] == many[2]
    assert many[2] == {3: key(3, block=1).tail_hash.hex(), 6: key(6, block=1, salt=4).tail_hash.hex()}
    assert before.redis_errors == 0
    assert mixed == [{}, many[1]] and empty == []
    assert (st.errors_by_op["points_many"], st.redis_errors, st.breaker_opens) == (1, 1, 0)


def test_points_many_is_one_deadline_not_one_per_block(own_server):
    hashes = hash_blocks(NS, list(range(64 * 8)), 8)

    async def body(pool):
        await pool.put(key(), b"v")
        own_server.proc.send_signal(signal.SIGSTOP)
        try:
            return await timed(pool.points_many(NS, hashes)), pool.stats()
        finally:
            own_server.proc.send_signal(signal.SIGCONT)

    (result, dt), st = run_pool(own_server.url, body)
    assert result == [{}] * 64 and dt < TIMEOUT_S + 0.3
    assert (st.timeouts_by_op["points_many"], st.redis_errors) == (1, 1)  # counted once for 64 directories


def test_points_many_on_the_embedded_pool():
    pool = EmbeddedSnapshotPool(ttl_s=60, budget_bytes=1 << 20)

    async def body():
        many, one_by_one = await fill_and_compare(pool)
        with pytest.raises(ValueError):
            await pool.points_many(NS, [BLOCKS[0], "not a hash"])
        with pytest.raises(ValueError):
            await pool.points_many(NS, BlockHash(b"\0" * 16))
        await pool.close()
        return many, one_by_one, await pool.points_many(NS, PROBED[:2])

    many, one_by_one, closed = asyncio.run(body())
    assert many == one_by_one
    assert many[2] == {3: key(3, block=1).tail_hash.hex(), 6: key(6, block=1, salt=4).tail_hash.hex()}
    assert closed == [{}, {}]
    assert pool.stats().errors_by_op == {}  # no Redis, no per-operation series


def test_every_operation_has_a_counter_from_the_start():
    async def body():
        pool = RedisSnapshotPool(f"redis://127.0.0.1:{free_port()}")
        st = pool.stats()
        await pool.close()
        return st

    st = asyncio.run(body())
    for counts in (st.errors_by_op, st.timeouts_by_op, st.skipped_by_op):
        assert counts == dict.fromkeys(REDIS_OPS, 0)
