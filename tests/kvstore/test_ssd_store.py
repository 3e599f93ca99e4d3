"""SSDStore and SSDWriter: round trips, segment files, coalesced reads, damaged bytes, torn tails, the
lifetime guarantee under an injectable clock (admission refusals, oldest-first expiry, refresh on hit),
compaction, check_integrity and a model-based random run (concurrent readers and the write-behind queue:
test_ssd_store_writer.py).

Records here are 100 B (44 B header + 56 B payload), segments hold 4 of them, the budget 12."""

import dataclasses
import os
import random
from collections import Counter

import pytest

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.ssd.record import HEADER_BYTES
from flashtier.kvstore.ssd.store import PutResult, SSDStore
from flashtier.kvstore.ssd.writer import SSDWriter

from .ssd_store_support import (  # noqa: F401 - clock and open_store are fixtures
    HOUR, LIFETIME, P, REC, T0, FakeClock, clock, config, flip, key, open_store, payload, put_all, seg_files,
)


# ---- basics ------------------------------------------------------------------------------------------
def test_put_get_round_trip_survives_reopen(open_store):
    s = open_store()
    keys = [key(i) for i in range(10)]
    assert put_all(s, keys) == [PutResult.STORED] * 10
    assert [s.get(k) for k in keys] == [payload(k) for k in keys]
    assert s.get(key(99)) is None
    st = s.stats()
    assert (st.hits, st.misses, st.puts, st.entries, st.bytes, st.live_bytes) == (10, 1, 10, 10, 1000, 1000)
    assert st.bytes_written == 1000 and st.corrupt_records == 0
    s.check_integrity(deep=True)
    s.close()
    s2 = open_store()
    assert s2.get_many(keys) == [payload(k) for k in keys] and len(s2) == 10
    s2.check_integrity(deep=True)


def test_segments_roll_at_segment_bytes_and_restart_starts_a_new_one(open_store):
    s = open_store()
    put_all(s, [key(i) for i in range(9)])
    assert seg_files(s) == ["000000000001.seg", "000000000002.seg", "000000000003.seg"]
    assert [os.path.getsize(s.segment_path(i)) for i in (1, 2, 3)] == [400, 400, 100]
    assert [s.entry(key(i)).segment_id for i in (0, 3, 4, 8)] == [1, 1, 2, 3]
    assert s.entry(key(5)).offset == 100 and s.entry(key(5)).length == P
    s.close()
    s2 = open_store()
    put_all(s2, [key(9)])
    assert s2.entry(key(9)).segment_id == 4  # never append to a segment from an earlier run
    s2.check_integrity()


def test_newest_record_wins_at_run_time_and_after_rebuild(open_store, clock):
    s = open_store()
    k = key(1)
    s.put(k, b"old" * 10)
    clock.advance(1)
    s.put(k, b"new" * 10)
    s.flush()
    assert s.get(k) == b"new" * 10 and len(s) == 1
    st = s.stats()
    assert st.bytes == 2 * (HEADER_BYTES + 30) and st.live_bytes == HEADER_BYTES + 30
    s.close()
    assert open_store().get(k) == b"new" * 10


def test_get_many_coalesces_adjacent_records(open_store):
    s = open_store(segment=12 * REC)
    keys = [key(i) for i in range(8)]
    put_all(s, keys)
    ops = s.stats().read_ops
    assert s.get_many(keys[2:6]) == [payload(k) for k in keys[2:6]]
    assert s.stats().read_ops == ops + 1  # four adjacent records, one pread
    assert s.get_many([keys[5], keys[0], keys[0], key(100), keys[2]]) == [
        payload(keys[5]), payload(keys[0]), payload(keys[0]), None, payload(keys[2])]  # fmt: skip
    assert s.stats().read_ops == ops + 4  # 0, 2 and 5 are not adjacent; the repeated key is read once
    st = s.stats()
    assert (st.hits, st.misses) == (8, 1)


def test_coalesce_gap_reads_across_small_holes(open_store):
    s = open_store(segment=12 * REC, coalesce_gap_bytes=REC)
    keys = [key(i) for i in range(6)]
    put_all(s, keys)
    ops = s.stats().read_ops
    assert s.get_many(keys[::2]) == [payload(k) for k in keys[::2]]
    assert s.stats().read_ops == ops + 1


# ---- damaged bytes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("at", [HEADER_BYTES, HEADER_BYTES + 20, REC - 1])
def test_flipped_payload_byte_is_a_counted_miss_never_served(open_store, at):
    s = open_store()
    keys = [key(i) for i in range(3)]
    put_all(s, keys)
    flip(s, keys[1], at)
    assert s.get_many(keys) == [payload(keys[0]), None, payload(keys[2])]
    st = s.stats()
    assert st.corrupt_records == 1 and st.misses == 1 and keys[1] not in s  # index entry dropped
    assert s.get(keys[1]) is None and s.stats().corrupt_records == 1  # now a plain miss
    s.check_integrity(deep=True)
    s.close()
    s2 = open_store()  # the header is intact: the scan indexes it again, the read rejects it again
    assert keys[1] in s2 and s2.get(keys[1]) is None and s2.stats().corrupt_records == 1
    assert s2.get(keys[2]) == payload(keys[2])


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("at", range(0, HEADER_BYTES, 3))
def test_flipped_header_byte_is_counted_by_the_scan_and_others_survive(open_store, at, which):
    s = open_store()
    keys = [key(i) for i in range(3)]
    put_all(s, keys)
    flip(s, keys[which], at)
    assert s.get(keys[which]) is None and s.stats().corrupt_records == 1  # detected on read, too
    s.close()
    s2 = open_store()
    st = s2.stats()
    assert st.corrupt_records == 1 and st.torn_bytes == 0  # resynchronised on the next magic
    assert keys[which] not in s2
    assert [s2.get(k) for k in keys if k != keys[which]] == [payload(k) for k in keys if k != keys[which]]
    s2.check_integrity(deep=True)


def test_torn_tail_is_ignored_at_every_cut(open_store, tmp_path):
    s = open_store()
    keys = [key(i) for i in range(3)]
    put_all(s, keys)
    s.close()
    path = s.segment_path(1)
    image = path.read_bytes()
    for cut in range(2 * REC + 1, 3 * REC):
        path.write_bytes(image[:cut])
        s2 = open_store()
        st = s2.stats()
        assert (st.entries, st.torn_bytes, st.corrupt_records) == (2, cut - 2 * REC, 0), cut
        assert s2.get_many(keys) == [payload(keys[0]), payload(keys[1]), None]
        s2.check_integrity(deep=True)
        s2.close()
        for extra in seg_files(s2)[1:]:
            os.unlink(s2.segment_path(int(extra[:12])))
    path.write_bytes(image[: 2 * REC] + bytes(300))  # zero fill past the end (delayed allocation)
    s3 = open_store()
    assert s3.stats().torn_bytes == 300 and s3.stats().corrupt_records == 0
    assert put_all(s3, [key(9)]) == [PutResult.STORED] and s3.get(key(9)) == payload(key(9))
    s3.check_integrity(deep=True)


def test_garbage_between_records_is_skipped(open_store):
    s = open_store(segment=12 * REC)
    keys = [key(i) for i in range(3)]
    put_all(s, keys)
    s.close()
    path = s.segment_path(1)
    image = path.read_bytes()
    path.write_bytes(image[:REC] + b"FTKV garbage that is not a record" + image[REC:])
    s2 = open_store()
    assert s2.stats().corrupt_records == 1 and s2.get_many(keys) == [payload(k) for k in keys]
    s2.check_integrity(deep=True)


# ---- lifetime, admission control, expiry, refresh -----------------------------------------------------
def test_full_budget_of_young_records_refuses_writes_and_serving_goes_on(open_store, clock):
    s = open_store()
    keys = [key(i) for i in range(12)]
    assert put_all(s, keys) == [PutResult.STORED] * 12
    clock.advance(LIFETIME - 1)  # every record is still inside its lifetime
    assert s.put(key(100), payload(key(100))) is PutResult.REFUSED  # a result, not an exception
    assert s.stats().admission_refusals == 1
    assert s.get_many(keys) == [payload(k) for k in keys]  # nothing young was evicted
    w = SSDWriter(s)
    assert w.submit(key(101), payload(key(101))).result(5) is PutResult.REFUSED
    w.close()
    st = s.stats()
    assert st.admission_refusals == 2 and st.expirations == 0 and st.entries == 12 and st.bytes == 1200
    assert st.young_bytes == 1200 and st.oldest_entry_age_s == LIFETIME - 1
    clock.advance(1)  # now the first segment's records are past their lifetime
    assert s.put(key(100), payload(key(100))) is PutResult.STORED
    assert s.stats().expirations == 4 and s.get(keys[0]) is None and s.get(keys[4]) == payload(keys[4])
    s.check_integrity(deep=True)


def test_expired_segments_are_evicted_oldest_first(open_store, clock):
    s = open_store()
    groups = [[key(10 * g + i) for i in range(4)] for g in range(3)]  # one segment each, an hour apart
    for g in groups:
        put_all(s, g)
        clock.advance(HOUR)
    clock.t = T0 + 73.5 * HOUR  # groups 0 and 1 expired (73.5 h, 72.5 h), group 2 young (71.5 h)
    assert s.stats().oldest_entry_age_s == 73.5 * HOUR
    new = [key(100 + i) for i in range(5)]
    assert put_all(s, new[:1]) == [PutResult.STORED]
    assert all(k not in s for k in groups[0]) and all(s.get(k) == payload(k) for k in groups[1] + groups[2])
    assert s.stats().expirations == 4
    assert put_all(s, new[1:4]) == [PutResult.STORED] * 3  # fits: 1200 B again
    assert all(k in s for k in groups[1])
    assert put_all(s, new[4:]) == [PutResult.STORED]  # the next oldest goes
    assert all(k not in s for k in groups[1]) and all(s.get(k) == payload(k) for k in groups[2] + new)
    assert s.stats().expirations == 8 and s.stats().admission_refusals == 0
    s.check_integrity(deep=True)


def test_lifetime_counts_from_the_last_write(open_store, clock):
    s = open_store()
    k = key(0)
    put_all(s, [k, key(1), key(2), key(3)])
    clock.advance(10 * HOUR)
    put_all(s, [k])  # rewritten: its lifetime restarts
    clock.t = T0 + 80 * HOUR
    put_all(s, [key(100 + i) for i in range(8)])  # pressure: the first segment (expired) goes
    assert s.stats().expirations == 3 and s.get(k) == payload(k)
    s.check_integrity(deep=True)


def test_refresh_on_hit_extends_a_hot_entry(open_store, clock):
    s = open_store()
    hot, cold = key(0), key(1)
    put_all(s, [hot, cold, key(2), key(3)])
    clock.advance(12 * HOUR)
    assert s.get(hot) == payload(hot)
    s.maintain()
    assert s.stats().refreshes == 0  # younger than the refresh age: nothing to do
    clock.advance(13 * HOUR)  # 25 h old
    assert s.get(hot) == payload(hot)
    s.maintain()
    st = s.stats()
    assert st.refreshes == 1 and s.entry(hot).created_at == T0 + 25 * HOUR and s.entry(cold).created_at == T0
    clock.t = T0 + 73 * HOUR
    put_all(s, [key(100 + i) for i in range(8)])  # pressure evicts the old segment
    assert s.get(cold) is None and s.get(hot) == payload(hot)
    assert s.stats().expirations == 3  # cold, 2, 3 (hot's old record was already dead)
    s.check_integrity(deep=True)


def test_compaction_under_pressure_keeps_young_records(open_store, clock):
    s = open_store()
    old, young = [key(0), key(1)], [key(2), key(3)]
    put_all(s, old)
    clock.advance(50 * HOUR)
    put_all(s, young)  # segment 1 = [old, old, young, young]
    filler = [key(10 + i) for i in range(8)]
    put_all(s, filler)
    clock.t = T0 + 73 * HOUR  # old: 73 h, the rest: 23 h
    assert put_all(s, [key(100)]) == [PutResult.STORED]
    st = s.stats()
    assert st.compactions == 1 and st.expirations == 2 and st.compacted_bytes == 2 * REC
    assert all(k not in s for k in old) and all(s.get(k) == payload(k) for k in young + filler + [key(100)])
    assert s.entry(young[0]).created_at == T0 + 50 * HOUR  # a copy keeps its created_at
    assert "000000000001.seg" not in seg_files(s)
    s.check_integrity(deep=True)
    s.close()
    s2 = open_store()  # the copies are what the rebuild finds
    assert all(s2.get(k) == payload(k) for k in young + filler) and s2.stats().entries == 11


def test_maintain_compacts_mostly_dead_segments_and_deletes_dead_ones(open_store, clock):
    s = open_store(budget=20 * REC)
    keys = [key(i) for i in range(8)]
    put_all(s, keys)
    clock.advance(1)
    put_all(s, keys[:3])  # segment 1 is now 3/4 dead
    put_all(s, keys[4:])  # segment 2 is now all dead
    before = s.stats()
    s.maintain()
    st = s.stats()
    assert st.compactions == before.compactions + 1 and st.compacted_bytes == REC  # keys[3] copied
    assert st.expirations == 0 and st.bytes == 8 * REC and st.live_bytes == 8 * REC
    assert "000000000001.seg" not in seg_files(s) and "000000000002.seg" not in seg_files(s)
    assert s.get_many(keys) == [payload(k) for k in keys]
    s.check_integrity(deep=True)


def test_random_run_never_loses_a_young_record(tmp_path):
    """Model check: puts, rewrites, reads, maintain and restarts under a random clock. After every step,
    every key written within its lifetime reads back exactly, and a refusal means young records really
    fill the budget (more than pressure_compact_ratio of it)."""
    for seed in range(3):
        rng = random.Random(seed)
        clock = FakeClock()
        root = tmp_path / str(seed)
        cfg = KVStoreConfig(ssd_dir=str(root), ssd_budget_bytes=30 * REC, ssd_segment_bytes=5 * REC)
        s = SSDStore(cfg, clock=clock)
        last_write: dict[BlockHash, tuple[float, int]] = {}  # key -> (time, payload size) of its last put
        totals: Counter[str] = Counter()  # counters summed over restarts
        for step in range(300):
            clock.advance(rng.choice([0, 0, 60, HOUR, 3 * HOUR, 20 * HOUR]))
            op = rng.random()
            if op < 0.6:
                k = key(rng.randrange(60))
                n = rng.choice([P, P, 10, 150])
                r = s.put(k, payload(k, n))
                if r is PutResult.STORED:
                    last_write[k] = (clock.t, n)
                else:
                    assert r is PutResult.REFUSED
                    st = s.stats()
                    assert st.young_bytes > 0.9 * (cfg.ssd_budget_bytes - HEADER_BYTES - n), (seed, step, st)
            elif op < 0.8:
                ks = [key(rng.randrange(60)) for _ in range(5)]
                for k, got in zip(ks, s.get_many(ks)):
                    assert got is None or got == payload(k, len(got))
            elif op < 0.9:
                s.maintain()
            else:
                totals.update(dataclasses.asdict(s.stats()))
                s.close()
                s = SSDStore(cfg, clock=clock)
            s.check_integrity()
            young = [(k, n) for k, (t, n) in last_write.items() if clock.t - t < LIFETIME]
            assert s.get_many([k for k, _ in young]) == [payload(k, n) for k, n in young], (seed, step)
        totals.update(dataclasses.asdict(s.stats()))
        assert totals["corrupt_records"] == 0 and totals["torn_bytes"] == 0
        assert totals["admission_refusals"] and totals["expirations"] and totals["compactions"], totals
        s.check_integrity(deep=True)
        s.close()


# ---- integrity checker, errors, locking --------------------------------------------------------------
def test_check_integrity_catches_inconsistencies(open_store):
    s = open_store()
    keys = [key(i) for i in range(6)]
    put_all(s, keys)
    s.check_integrity(deep=True)
    s._meta.bytes += 1
    with pytest.raises(RuntimeError, match="byte count"):
        s.check_integrity()
    s._meta.bytes -= 1
    flip(s, keys[2], 10)  # a header byte: only the deep check reads headers
    s.check_integrity()
    with pytest.raises(RuntimeError, match="checksum"):
        s.check_integrity(deep=True)
    os.truncate(s.segment_path(2), 50)
    with pytest.raises(RuntimeError, match="file has 50 B"):
        s.check_integrity()


def test_bad_arguments_raise_value_error(tmp_path, open_store):
    with pytest.raises(ValueError, match="disabled"):
        SSDStore(KVStoreConfig())
    with pytest.raises(ValueError, match="compact_live_ratio"):
        SSDStore(config(tmp_path), compact_live_ratio=1.0)
    s = open_store()
    with pytest.raises(ValueError, match="BlockHash"):
        s.put(b"\x00" * 16, b"x")
    with pytest.raises(ValueError, match="bytes-like"):
        s.put(key(0), "text")
    with pytest.raises(ValueError, match="does not fit a segment"):
        s.put(key(0), bytes(4 * REC))
    with pytest.raises(ValueError, match="BlockHash"):
        s.get_many([key(0), "nope"])
    assert s.stats().puts == 0


def test_one_store_per_directory_and_closed_store(open_store):
    s = open_store()
    with pytest.raises(RuntimeError, match="in use"):
        open_store()
    s.close()
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        s.get(key(0))
    with pytest.raises(RuntimeError, match="closed"):
        s.put(key(0), b"x")
    open_store().check_integrity()
