"""Snapshot value format and key names (round trips, every corruption caught), and EmbeddedSnapshotPool:
TTL on a fake clock, LRU eviction under the byte budget in exact order, directory semantics, failure
answers, thread safety with check_integrity after the run."""

import asyncio
import struct
import threading

import crc32c
import pytest

from flashtier.kvstore.block_hash import hash_block, hash_blocks, namespace_hash
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.snapshot.key import (
    HEADER_BYTES,
    Snapshot,
    SnapshotCorrupt,
    SnapshotKey,
    directory_key,
    tail_hash_of,
)
from flashtier.kvstore.snapshot.pool import EmbeddedSnapshotPool, SnapshotStats

NS = namespace_hash("snap-test", None)
BLOCKS = hash_blocks(NS, list(range(4 * 8)), 8)


def key(tail_len=3, block=0, salt=0):
    """A point ``tail_len`` tokens after block ``block`` (``salt`` varies the tail tokens)."""
    return SnapshotKey.for_tail(NS, BLOCKS[block], [100 + salt + i for i in range(tail_len)])


def run(coro):
    return asyncio.run(coro)


class FakeClock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


# -- SnapshotKey --------------------------------------------------------------------------------------------


def test_key_names_share_a_cluster_hash_tag_and_round_trip():
    k = key(5, block=2)
    tag = "{" + NS.hex() + ":" + BLOCKS[2].hex() + "}"
    assert k.redis_key() == f"ft:snap:{tag}:5:{k.tail_hash.hex()}"
    assert k.directory_key() == directory_key(NS, BLOCKS[2]) == f"ft:snapdir:{tag}"
    assert SnapshotKey.parse(k.redis_key()) == k
    assert k.tail_hash == hash_block(BLOCKS[2], [100, 101, 102, 103, 104])


def test_empty_tail_and_root_point():
    at_boundary = SnapshotKey.for_tail(NS, BLOCKS[0], [])
    assert at_boundary.tail_len == 0 and at_boundary.tail_hash == BLOCKS[0]
    before_first_block = SnapshotKey.for_tail(NS, NS, [7, 8])  # no full block yet: the namespace root
    assert before_first_block.block_hash == NS and before_first_block.tail_hash == tail_hash_of(NS, [7, 8])
    assert SnapshotKey.parse(before_first_block.redis_key()) == before_first_block


@pytest.mark.parametrize(
    "text",
    [
        "",
        "ft:snap:",
        "ft:snapdir:{" + NS.hex() + ":" + NS.hex() + "}",
        "ft:snap:{" + NS.hex() + ":" + NS.hex() + "}:3",
        "ft:snap:{" + NS.hex() + ":" + NS.hex() + "}:-3:" + NS.hex(),
        "ft:snap:{" + NS.hex() + ":" + NS.hex() + "}:03:" + NS.hex(),
        "ft:snap:{" + NS.hex() + ":" + NS.hex() + "}:3:" + NS.hex().upper(),
        "ft:snap:{" + NS.hex()[:-2] + ":" + NS.hex() + "}:3:" + NS.hex(),
    ],
    ids=["empty", "prefix", "dir-key", "no-tail-hash", "negative", "leading-zero", "upper-hex", "short-ns"],
)
def test_parse_rejects_non_keys(text):
    with pytest.raises(ValueError):
        SnapshotKey.parse(text)


@pytest.mark.parametrize(
    "args",
    [(NS, NS, -1, NS), (NS, NS, True, NS), (NS, NS, 2**32, NS), (NS, NS, 1.0, NS), (NS, b"x" * 16, 1, NS)],
    ids=["negative", "bool", "too-long", "float", "bytes-hash"],
)
def test_key_validation(args):
    with pytest.raises(ValueError):
        SnapshotKey(*args)


# -- Snapshot value format ------------------------------------------------------------------------------------


def test_encode_layout_is_the_documented_one():
    k = key(3, block=1)
    payload = bytes(range(256)) * 3
    value = Snapshot(k, payload).encode()
    assert HEADER_BYTES == 72 and len(value) == 72 + len(payload)
    head = struct.pack("<4sHH16s16sI16sQ", b"FTSS", 1, 72, NS.digest, BLOCKS[1].digest, 3, k.tail_hash.digest,
                       len(payload))  # fmt: skip
    assert value[:68] == head
    assert value[68:72] == struct.pack("<I", crc32c.crc32c(head + payload))
    assert value[72:] == payload
    assert Snapshot.decode(value, expected=k) == Snapshot(k, payload)
    assert Snapshot(k, payload).nbytes == len(value)


def test_empty_payload_round_trips():
    k = key(0)
    assert Snapshot.decode(Snapshot(k, b"").encode()).payload == b""


def test_every_flipped_byte_is_caught():
    k = key(2)
    value = Snapshot(k, b"payload-bytes" * 5).encode()
    for i in range(len(value)):
        bad = bytearray(value)
        bad[i] ^= 0x40
        with pytest.raises(SnapshotCorrupt):
            Snapshot.decode(bytes(bad), expected=k)


def test_truncated_extended_foreign_and_garbage_values_are_corrupt():
    k = key(2)
    value = Snapshot(k, b"x" * 100).encode()
    for bad in (value[:-1], value + b"\0", value[:HEADER_BYTES - 1], b"", b"garbage"):
        with pytest.raises(SnapshotCorrupt):
            Snapshot.decode(bad)
    with pytest.raises(SnapshotCorrupt, match="belongs to"):
        Snapshot.decode(value, expected=key(2, salt=1))  # a valid value stored under another key
    future = bytearray(value)
    future[4:6] = struct.pack("<H", 2)
    with pytest.raises(SnapshotCorrupt, match="version"):
        Snapshot.decode(bytes(future))
    assert issubclass(SnapshotCorrupt, ValueError)


# -- EmbeddedSnapshotPool ---------------------------------------------------------------------------------------


def pool_for(n_entries, payload_len=100, ttl_s=300.0):
    clock = FakeClock()
    return EmbeddedSnapshotPool(ttl_s, n_entries * (HEADER_BYTES + payload_len), clock), clock


def test_round_trip_and_stats():
    pool, _ = pool_for(4)
    k, payload = key(), b"p" * 100

    async def go():
        assert await pool.put(k, payload)
        assert await pool.get(k) == payload
        assert await pool.get(key(4)) is None
        return pool.stats()

    st = run(go())
    assert st == SnapshotStats(puts=1, hits=1, misses=1, bytes_written=172, bytes_read=172)
    assert st.lookups == 2 and pool.bytes_used == 172 and len(pool) == 1
    pool.check_integrity()


def test_ttl_expires_on_the_clock_and_get_does_not_extend_it():
    pool, clock = pool_for(4, ttl_s=300.0)
    k = key()

    async def go():
        assert await pool.put(k, b"a" * 100)
        clock.t += 299.0
        assert await pool.get(k) == b"a" * 100  # a hit, but no TTL refresh
        assert await pool.points(NS, BLOCKS[0]) == {3: k.tail_hash.hex()}
        clock.t += 1.0
        assert await pool.get(k) is None
        assert await pool.points(NS, BLOCKS[0]) == {}

    run(go())
    st = pool.stats()
    assert (st.hits, st.misses, st.expirations, pool.bytes_used) == (1, 1, 1, 0)
    pool.check_integrity()


def test_put_restarts_the_ttl_and_sweeps_expired_entries():
    pool, clock = pool_for(4)
    a, b = key(1), key(2)

    async def go():
        await pool.put(a, b"a" * 100)  # t=1000, would expire at 1300
        clock.t += 200
        await pool.put(b, b"b" * 100)  # t=1200, expires at 1500
        clock.t += 50
        await pool.put(a, b"A" * 100)  # t=1250, rewritten: expires at 1550
        clock.t += 260  # t=1510
        assert await pool.get(a) == b"A" * 100
        await pool.put(key(3), b"c" * 100)  # the sweep at put drops b
        assert len(pool) == 2 and await pool.get(b) is None

    run(go())
    assert pool.stats().expirations == 1 and pool.stats().misses == 1
    pool.check_integrity()


def test_budget_evicts_least_recently_used_first():
    pool, _ = pool_for(3)
    a, b, c, d, e = (key(i) for i in range(1, 6))

    async def go():
        for k in (a, b, c):
            assert await pool.put(k, b"x" * 100)
        assert await pool.get(a)  # order by recency now: b, c, a
        assert await pool.put(d, b"x" * 100)  # evicts b
        assert [await pool.get(k) is not None for k in (a, b, c, d)] == [True, False, True, True]
        assert await pool.put(e, b"x" * 40)  # recency a, c, d: a goes
        assert await pool.get(a) is None
        assert await pool.put(e, b"x" * 101)  # rewrite grows e past the budget: c goes, d stays
        assert [await pool.get(k) is not None for k in (c, d, e)] == [False, True, True]
        return await pool.points(NS, BLOCKS[0])

    points = run(go())
    assert points == {4: d.tail_hash.hex(), 5: e.tail_hash.hex()}  # evicted entries leave the directory
    assert pool.stats().evictions == 3 and pool.bytes_used == 172 + 173
    pool.check_integrity()


def test_too_big_and_closed_pools_refuse_without_raising():
    pool, _ = pool_for(2)

    async def go():
        assert not await pool.put(key(), b"x" * (2 * 172 - HEADER_BYTES + 1))
        assert await pool.put(key(), b"x" * (2 * 172 - HEADER_BYTES))  # exactly the budget fits
        await pool.close()
        assert not await pool.put(key(), b"x")
        assert await pool.get(key()) is None
        assert await pool.points(NS, BLOCKS[0]) == {}
        assert not await pool.delete(key())

    run(go())
    st = pool.stats()
    assert (st.puts, st.put_failures, st.errors) == (1, 2, 1)


def test_directory_lists_tail_lengths_and_follows_overwrites_and_deletes():
    pool, _ = pool_for(10)
    old, new, other = key(3), key(3, salt=7), key(5)

    async def go():
        for k in (old, other):
            await pool.put(k, b"o" * 10)
        await pool.put(key(2, block=1), b"z")  # another block's directory
        assert await pool.points(NS, BLOCKS[0]) == {3: old.tail_hash.hex(), 5: other.tail_hash.hex()}
        await pool.put(new, b"n" * 10)  # same tail_len, other tokens: takes the field over
        assert await pool.points(NS, BLOCKS[0]) == {3: new.tail_hash.hex(), 5: other.tail_hash.hex()}
        assert await pool.get(old) == b"o" * 10  # still stored, only undiscoverable
        assert await pool.delete(old) and not await pool.delete(old)
        assert (await pool.points(NS, BLOCKS[0]))[3] == new.tail_hash.hex()  # not old's field to remove
        assert await pool.delete(new)
        assert await pool.points(NS, BLOCKS[0]) == {5: other.tail_hash.hex()}
        assert await pool.points(NS, BLOCKS[2]) == {}
        assert await pool.points(namespace_hash("other-model"), BLOCKS[0]) == {}

    run(go())
    pool.check_integrity()


def test_bad_arguments_raise_value_error():
    pool, _ = pool_for(2)
    with pytest.raises(ValueError, match="payload"):
        run(pool.put(key(), "text"))
    with pytest.raises(ValueError, match="SnapshotKey"):
        run(pool.get(key().redis_key()))
    with pytest.raises(ValueError, match="BlockHash"):
        run(pool.points(NS, BLOCKS[0].hex()))
    with pytest.raises(ValueError):
        EmbeddedSnapshotPool(0, 100)
    with pytest.raises(ValueError):
        EmbeddedSnapshotPool(1, 0)


def test_mutable_buffers_are_copied():
    pool, _ = pool_for(2)
    buf = bytearray(b"a" * 100)
    run(pool.put(key(), buf))
    buf[:] = b"b" * 100
    assert run(pool.get(key())) == b"a" * 100


def test_from_config():
    pool = EmbeddedSnapshotPool.from_config(KVStoreConfig(snapshot_ttl_s=12.0, snapshot_budget_bytes=1 << 20))
    assert (pool.ttl_s, pool.budget_bytes) == (12.0, 1 << 20)


def test_threads_and_event_loops_share_one_pool():
    pool, clock = pool_for(20, payload_len=64)
    errors = []

    def worker(w):
        async def go():
            for i in range(300):
                k = key(1 + i % 7, block=w % 4, salt=w)
                if i % 3:
                    await pool.put(k, bytes([w]) * 64)
                else:
                    got = await pool.get(k)
                    assert got is None or got == bytes([w]) * 64
                if i % 50 == 0:
                    await pool.points(NS, BLOCKS[w % 4])
                    clock.t += 40

        try:
            asyncio.run(go())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    pool.check_integrity()
    st = pool.stats()
    assert st.puts == 6 * 200 and st.lookups == 6 * 100 and st.evictions > 0
    assert pool.bytes_used <= pool.budget_bytes

