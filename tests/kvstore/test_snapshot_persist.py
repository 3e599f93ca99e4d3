"""The embedded snapshot pool's file across a clean restart (kvstore/snapshot/persist.py): round trip, TTLs
kept as wall-clock expiry, a damaged or truncated file costs misses (logged once, counted), never a failed
start; the file is consumed at load, so a later crash never brings back a stale copy. No sleeps: both
clocks are injected."""

import asyncio
import logging
import os

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.snapshot.key import SnapshotKey
from flashtier.kvstore.snapshot.persist import FILE_NAME, load_pool, save_pool
from flashtier.kvstore.snapshot.pool import EmbeddedSnapshotPool


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _key(i: int) -> SnapshotKey:
    return SnapshotKey.for_tail(BlockHash(bytes([1]) * 16), BlockHash(bytes([i]) * 16), [i, i + 1])


def _pool(mono: Clock, ttl: float = 300.0) -> EmbeddedSnapshotPool:
    return EmbeddedSnapshotPool(ttl_s=ttl, budget_bytes=1 << 20, clock=mono)


def _filled(mono: Clock) -> EmbeddedSnapshotPool:
    """Three snapshots put 0 s, 100 s and 200 s into the run (TTL 300 s)."""
    pool = _pool(mono)
    for i in range(3):
        assert asyncio.run(pool.put(_key(i), f"payload {i}".encode() * 50))
        mono.t += 100
    return pool


def test_a_clean_restart_keeps_every_live_snapshot_with_the_ttl_it_had_left(tmp_path):
    mono = Clock(1000.0)
    old = _filled(mono)  # now 1300: snapshot 0 was put 300 s ago (expired), 1 has 100 s left, 2 has 200 s
    assert save_pool(old, str(tmp_path), wall_clock=Clock(50_000.0)) == 2
    new_mono = Clock(7.0)  # a new process: another monotonic origin
    new = _pool(new_mono)
    res = load_pool(new, str(tmp_path), wall_clock=Clock(50_030.0))  # 30 s down
    assert (res.loaded, res.expired, res.corrupt) == (2, 0, 0)
    assert not os.path.exists(tmp_path / FILE_NAME)  # consumed: a crash later finds no stale copy
    assert asyncio.run(new.get(_key(1))) == b"payload 1" * 50
    assert asyncio.run(new.points(_key(2).namespace, _key(2).block_hash)) == {2: _key(2).tail_hash.hex()}
    new_mono.t += 69  # 100 - 30 = 70 s left for snapshot 1: there after 69 s, gone at 70
    assert asyncio.run(new.get(_key(1))) is not None
    new_mono.t += 1
    assert asyncio.run(new.get(_key(1))) is None and asyncio.run(new.get(_key(2))) is not None
    new.check_integrity()


def test_snapshots_that_expired_while_the_server_was_down_are_not_loaded(tmp_path):
    save_pool(_filled(Clock(0.0)), str(tmp_path), wall_clock=Clock(1000.0))
    new = _pool(Clock(0.0))
    res = load_pool(new, str(tmp_path), wall_clock=Clock(1150.0))  # 150 s down: 1 (100 s left) expired
    assert (res.loaded, res.expired) == (1, 1) and len(new) == 1


def test_no_file_is_an_empty_pool(tmp_path):
    res = load_pool(_pool(Clock(0.0)), str(tmp_path))
    assert (res.loaded, res.corrupt) == (0, 0)


def test_a_truncated_or_damaged_file_costs_misses_not_the_start(tmp_path, caplog):
    save_pool(_filled(Clock(0.0)), str(tmp_path), wall_clock=Clock(0.0))
    path = tmp_path / FILE_NAME
    whole = path.read_bytes()
    cases = {
        "truncated mid-record": (whole[:-10], 1),  # the first record survives
        "payload byte flipped": (whole[:-5] + bytes([whole[-5] ^ 0xFF]) + whole[-4:], 1),
        "record header flipped": (whole[:8] + bytes([whole[8] ^ 0x01]) + whole[9:], 0),
        "not a snapshot file": (b"garbage", 0),
        "empty": (b"", 0),
    }
    for name, (data, loaded) in cases.items():
        path.write_bytes(data)
        pool = _pool(Clock(0.0))
        with caplog.at_level(logging.WARNING, logger="flashtier.kvstore.snapshot.persist"):
            caplog.clear()
            res = load_pool(pool, str(tmp_path), wall_clock=Clock(0.0))
        assert (res.loaded, res.corrupt) == (loaded, 1), name
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1, name
        assert not path.exists(), name
        pool.check_integrity()
    assert len(whole) > 200


def test_a_save_replaces_the_file_atomically(tmp_path):
    pool = _filled(Clock(0.0))
    save_pool(pool, str(tmp_path), wall_clock=Clock(0.0))
    save_pool(pool, str(tmp_path), wall_clock=Clock(0.0))
    assert sorted(os.listdir(tmp_path)) == [FILE_NAME]  # no temporary file left behind
