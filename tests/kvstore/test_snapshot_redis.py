"""RedisSnapshotPool against real redis-server processes (tests/kvstore/redis_server.py): stored bytes and
PTTL of both keys, the directory, and every failure a counted miss within the timeout, never an
exception: flushed, stopped (then restarted), paused (slow), corrupt values, maxmemory eviction.
Redis Cluster cannot run here: only its URL parsing and its failure path (a non-cluster server) are tested.
The circuit breaker and points_many have their own file (test_snapshot_redis_breaker.py)."""

import asyncio
import time

import pytest
import redis.utils

from flashtier.kvstore.block_hash import hash_blocks, namespace_hash
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.snapshot.redis_pool import RedisSnapshotPool, snapshot_pool_from_config
from flashtier.kvstore.redis_url import parse_redis_url
from flashtier.kvstore.snapshot.key import HEADER_BYTES, Snapshot, SnapshotKey
from flashtier.kvstore.snapshot.pool import EmbeddedSnapshotPool

from .redis_server import RedisServer, free_port

NS = namespace_hash("redis-snap-test", "tenant-a")
BLOCKS = hash_blocks(NS, list(range(4 * 8)), 8)
TTL_S = 300.0
TIMEOUT_S = 0.2
BOUND_S = TIMEOUT_S + 0.3  # a failed call must return within the timeout plus scheduling slack
BREAKER_S = 0.3  # the breaker's first back-off here (1 s in production)


def key(tail_len=3, block=0, salt=0):
    return SnapshotKey.for_tail(NS, BLOCKS[block], [500 + salt + i for i in range(tail_len)])


@pytest.fixture(scope="module")
def shared_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def server(shared_server):
    admin = shared_server.client()
    admin.flushall()
    admin.close()
    return shared_server


@pytest.fixture
def own_server():
    """A server this test may stop, restart or reconfigure."""
    with RedisServer("--maxmemory-policy", "volatile-lru") as server:
        yield server


def with_pool(url, body, **kw):
    """Run ``body(pool)`` on a fresh event loop with a fresh pool, closing it afterwards."""

    async def go():
        kw.setdefault("breaker_base_s", BREAKER_S)
        pool = RedisSnapshotPool(url, ttl_s=kw.pop("ttl_s", TTL_S), timeout_s=TIMEOUT_S, **kw)
        try:
            return await body(pool)
        finally:
            await pool.close()

    return asyncio.run(go())


async def timed(aw):
    t0 = time.monotonic()
    out = await aw
    return out, time.monotonic() - t0


def test_round_trip_stores_header_and_payload_with_ttl_on_both_keys(server):
    k, payload = key(5, block=1), bytes(range(256)) * 40
    admin = server.client()

    async def body(pool):
        assert await pool.put(k, payload)
        assert await pool.get(k) == payload
        return pool.stats()

    st = with_pool(server.url, body)
    assert admin.get(k.redis_key()) == Snapshot(k, payload).encode()
    assert 0 < admin.pttl(k.redis_key()) <= TTL_S * 1000
    assert 0 < admin.pttl(k.directory_key()) <= TTL_S * 1000
    assert admin.hgetall(k.directory_key()) == {b"5": k.tail_hash.hex().encode()}
    n = HEADER_BYTES + len(payload)
    assert (st.puts, st.hits, st.bytes_written, st.bytes_read, st.redis_errors) == (1, 1, n, n, 0)
    assert redis.utils.HIREDIS_AVAILABLE  # redis-py picks the hiredis parser when it is importable


def test_short_ttl_is_set_in_milliseconds(server):
    admin = server.client()
    with_pool(server.url, lambda pool: pool.put(key(), b"x"), ttl_s=1.5)
    assert 1000 < admin.pttl(key().redis_key()) <= 1500
    assert 1000 < admin.pttl(key().directory_key()) <= 1500


def test_directory_lists_points_and_a_put_refreshes_its_ttl(server):
    admin = server.client()
    old, new = key(3), key(3, salt=9)

    async def body(pool):
        for k in (key(1), old, key(6), key(2, block=2)):
            assert await pool.put(k, b"p")
        first = await pool.points(NS, BLOCKS[0])
        admin.pexpire(old.directory_key(), 50)
        assert await pool.put(new, b"n")  # same tail_len, other tokens: takes the field over
        second = await pool.points(NS, BLOCKS[0])
        return first, second, await pool.points(NS, BLOCKS[3]), await pool.get(old)

    first, second, empty, old_value = with_pool(server.url, body)
    assert first == {1: key(1).tail_hash.hex(), 3: old.tail_hash.hex(), 6: key(6).tail_hash.hex()}
    assert list(first) == [1, 3, 6]
    assert second == {**first, 3: new.tail_hash.hex()}
    assert admin.pttl(old.directory_key()) > 1000  # refreshed by the put
    assert empty == {} and old_value == b"p"  # the old point is still stored, only undiscoverable


def test_delete_removes_the_directory_field_only_if_it_names_the_key(server):
    admin = server.client()
    old, new = key(3), key(3, salt=9)

    async def body(pool):
        for k in (old, new, key(4)):
            await pool.put(k, b"v")
        assert await pool.delete(old) and not await pool.delete(old)
        after_old = await pool.points(NS, BLOCKS[0])
        assert await pool.delete(new)
        return after_old, await pool.points(NS, BLOCKS[0])

    after_old, after_new = with_pool(server.url, body)
    assert after_old == {3: new.tail_hash.hex(), 4: key(4).tail_hash.hex()}
    assert after_new == {4: key(4).tail_hash.hex()}
    assert not admin.exists(old.redis_key(), new.redis_key())


def test_malformed_directory_fields_are_skipped(server):
    admin = server.client()
    admin.hset(key().directory_key(), mapping={"7": key(7).tail_hash.hex(), "x": "y", "2": "zz", "-1": "0" * 32})
    points = with_pool(server.url, lambda pool: pool.points(NS, BLOCKS[0]))
    assert points == {7: key(7).tail_hash.hex()}


def test_flushed_redis_is_a_counted_miss(server):
    admin = server.client()

    async def body(pool):
        assert await pool.put(key(), b"v")
        admin.flushall()
        return await pool.get(key()), await pool.points(NS, BLOCKS[0]), pool.stats()

    value, points, st = with_pool(server.url, body)
    assert value is None and points == {}
    assert (st.misses, st.errors, st.redis_errors) == (1, 0, 0)


def test_stopped_redis_fails_fast_and_counted_then_recovers(own_server):
    async def body(pool):
        assert await pool.put(key(), b"v")
        own_server.stop()
        results = [await timed(pool.put(key(), b"w")), await timed(pool.get(key())),
                   await timed(pool.points(NS, BLOCKS[0])), await timed(pool.delete(key()))]  # fmt: skip
        down = pool.stats()
        own_server.restart()  # an empty server on the same port
        await asyncio.sleep(BREAKER_S + 0.05)  # the back-off is over: the next call probes
        assert await pool.get(key()) is None  # reconnects: a plain miss now
        assert await pool.put(key(), b"back")
        return results, down, await pool.get(key()), pool.stats()

    results, down, value, up = with_pool(own_server.url, body)
    assert [r for r, _ in results] == [False, None, {}, False]
    assert all(dt < BOUND_S for _, dt in results), results
    assert (down.put_failures, down.errors, down.redis_errors, down.redis_down) == (1, 1, 1, 1)
    assert down.errors_by_op["put"] == 1  # the failed call; the three after it were not sent
    assert (down.skipped_by_op["get"], down.skipped_by_op["points"], down.skipped_by_op["delete"]) == (1, 1, 1)
    assert value == b"back"
    assert (up.misses, up.hits, up.puts, up.redis_errors, up.redis_down, up.breaker_opens) == (1, 1, 2, 1, 0, 1)


def test_slow_redis_is_a_miss_within_the_timeout(server):
    admin = server.client()

    async def body(pool):
        assert await pool.put(key(), b"v")
        admin.execute_command("CLIENT", "PAUSE", "800", "ALL")  # every client waits (UNPAUSE too)
        try:
            slow = [await timed(pool.get(key())), await timed(pool.put(key(4), b"w"))]
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
        await asyncio.sleep(BREAKER_S + 0.05)
        return slow, await pool.get(key()), pool.stats()

    slow, value, st = with_pool(server.url, body)
    assert [r for r, _ in slow] == [None, False]
    assert slow[0][1] < BOUND_S and slow[1][1] < 0.05, slow  # the put was skipped: Redis had just timed out
    assert value == b"v"  # the timed-out connection was dropped; a fresh one answers the probe
    assert (st.errors, st.put_failures, st.timeouts, st.redis_errors, st.hits) == (1, 1, 1, 1, 1)
    assert (st.timeouts_by_op["get"], st.errors_by_op["get"], st.skipped_by_op["put"]) == (1, 0, 1)


def test_corrupt_values_are_counted_misses_and_dropped(server):
    admin = server.client()
    a, b, c = key(1), key(2), key(3)

    async def body(pool):
        for k in (a, b, c):
            await pool.put(k, b"payload" * 10)
        admin.set(a.redis_key(), b"garbage")
        admin.set(b.redis_key(), admin.get(c.redis_key()))  # a valid value, but of another key
        admin.setrange(c.redis_key(), HEADER_BYTES + 3, b"X")  # one payload byte changed
        return [await pool.get(k) for k in (a, b, c)], pool.stats()

    values, st = with_pool(server.url, body)
    assert values == [None, None, None]
    assert (st.corrupt, st.hits, st.misses, st.errors, st.redis_errors) == (3, 0, 0, 0, 0)
    assert not admin.exists(a.redis_key(), b.redis_key(), c.redis_key())


def test_maxmemory_eviction_is_a_miss_not_an_error(own_server):
    admin = own_server.client()
    admin.config_set("maxmemory", str(admin.info("memory")["used_memory"] + 3 * 1024 * 1024))
    payload = b"e" * 200_000
    first = key(1)

    async def body(pool):
        assert await pool.put(first, payload)
        puts = 1
        while admin.exists(first.redis_key()) and puts < 200:
            assert await pool.put(key(1 + puts % 7, block=puts % 4, salt=puts), payload)
            puts += 1
        return puts, await pool.get(first), pool.stats()

    puts, value, st = with_pool(own_server.url, body)
    assert admin.info("stats")["evicted_keys"] > 0 and puts < 200
    assert value is None
    assert (st.misses, st.errors, st.put_failures, st.redis_errors) == (1, 0, 0, 0)


@pytest.mark.parametrize(
    ("url", "target", "cluster"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0", False),
        ("rediss://user:pw@cache.internal:6380", "rediss://user:pw@cache.internal:6380", False),
        ("unix:///run/redis.sock", "unix:///run/redis.sock", False),
        ("redis+cluster://10.0.0.5:7000", "redis://10.0.0.5:7000", True),
        ("rediss+cluster://node-a:7000/0", "rediss://node-a:7000/0", True),
    ],
)
def test_parse_redis_url(url, target, cluster):
    parsed = parse_redis_url(url)
    assert (parsed.url, parsed.cluster) == (target, cluster)


@pytest.mark.parametrize(
    "url",
    ["", "http://127.0.0.1:6379", "127.0.0.1:6379", "redis://", "redis://host:notaport", "redis://host:6379/x",
     "redis+cluster://host:7000/3", "unix://"],  # fmt: skip
)
def test_parse_redis_url_rejects(url):
    with pytest.raises(ValueError, match="redis_url"):
        parse_redis_url(url)


def test_cluster_url_builds_a_cluster_client_that_fails_as_a_counted_miss(server):
    """No cluster here: a cluster client pointed at a plain server fails to initialise, a counted miss."""
    url = server.url.replace("redis://", "redis+cluster://").removesuffix("/0")

    async def body(pool):
        assert pool.is_cluster
        return await timed(pool.get(key())), await timed(pool.put(key(), b"v")), pool.stats()

    (value, dt_get), (ok, dt_put), st = with_pool(url, body)
    assert value is None and ok is False and dt_get < BOUND_S and dt_put < BOUND_S
    assert (st.errors, st.put_failures, st.redis_errors, st.skipped_by_op["put"]) == (1, 1, 1, 1)


def test_unreachable_port_is_a_counted_miss():
    async def body(pool):
        return await timed(pool.get(key())), pool.stats()

    (value, dt), st = with_pool(f"redis://127.0.0.1:{free_port()}", body)
    assert value is None and dt < BOUND_S and (st.errors, st.redis_errors) == (1, 1)


def test_pool_from_config_picks_redis_or_embedded():
    assert isinstance(snapshot_pool_from_config(KVStoreConfig()), EmbeddedSnapshotPool)
    pool = snapshot_pool_from_config(KVStoreConfig(redis_url="redis+cluster://127.0.0.1:7000", snapshot_ttl_s=60,
                                                   redis_timeout_s=0.1))  # fmt: skip
    assert isinstance(pool, RedisSnapshotPool) and pool.is_cluster
    assert (pool.ttl_ms, pool.timeout_s) == (60_000, 0.1)
    asyncio.run(pool.close())
    with pytest.raises(ValueError, match="redis_url"):
        RedisSnapshotPool.from_config(KVStoreConfig())
