"""SSDStore and SSDWriter: round trips, segment files, coalesced reads, damaged bytes, torn tails, the
lifetime guarantee under an injectable clock (admission refusals, oldest-first expiry, refresh on hit),
compaction, check_integrity, a model-based random run, concurrent readers, and the write-behind queue.

Records here are 100 B (44 B header + 56 B payload), segments hold 4 of them, the budget 12."""

import asyncio
import dataclasses
import os
import random
import shutil
import threading
import time
from collections import Counter

import pytest
import xxhash

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.ssd_record import HEADER_BYTES
from flashtier.kvstore.ssd_store import PutResult, SSDStore
from flashtier.kvstore.ssd_writer import SSDWriter

HOUR = 3600.0
LIFETIME = 72 * HOUR
P = 56  # payload bytes
REC = HEADER_BYTES + P  # 100 B per record
T0 = 1_000_000.0


class FakeClock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def key(i: int) -> BlockHash:
    return BlockHash(xxhash.xxh3_128_digest(i.to_bytes(8, "little")))


def payload(k: BlockHash, n: int = P) -> bytes:
    """Key-derived bytes: any payload served for ``k`` can be checked against this."""
    return (xxhash.xxh3_128_digest(k.digest + b"payload") * (n // 16 + 1))[:n]


def config(tmp_path, *, budget=12 * REC, segment=4 * REC) -> KVStoreConfig:
    return KVStoreConfig(ssd_dir=str(tmp_path / "ssd"), ssd_budget_bytes=budget, ssd_segment_bytes=segment)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def open_store(tmp_path, clock):
    stores = []

    def _open(**kw):
        cfg_kw = {k: kw.pop(k) for k in ("budget", "segment") if k in kw}
        store = SSDStore(config(tmp_path, **cfg_kw), clock=kw.pop("clock", clock), **kw)
        stores.append(store)
        return store

    yield _open
    for s in stores:
        s.close()


def put_all(store, keys):
    results = [store.put(k, payload(k)) for k in keys]
    assert store.flush()
    return results


def seg_files(store):
    return sorted(n for n in os.listdir(store.segment_path(0).parent) if n.endswith(".seg"))


def flip(store, k: BlockHash, at: int) -> None:
    """Flip one byte ``at`` bytes into ``k``'s record, behind the store's back."""
    e = store.entry(k)
    with open(store.segment_path(e.segment_id), "r+b") as f:
        f.seek(e.offset + at)
        b = f.read(1)
        f.seek(e.offset + at)
        f.write(bytes([b[0] ^ 0x5A]))


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


def test_concurrent_readers_during_writes_and_compaction(tmp_path):
    """Readers never see a wrong payload while the writer appends, compacts and deletes segments."""
    s = SSDStore(KVStoreConfig(ssd_dir=str(tmp_path / "c"), ssd_budget_bytes=40 * REC, ssd_segment_bytes=4 * REC))
    w = SSDWriter(s, maintain_interval_s=0.005)
    stop, errors = threading.Event(), []

    def reader(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            ks = [key(rng.randrange(30)) for _ in range(6)]
            for k, got in zip(ks, s.get_many(ks)):
                if got is not None and got != payload(k):
                    errors.append(k)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    rng = random.Random(7)
    try:
        for _ in range(600):
            k = key(rng.randrange(30))
            w.submit(k, payload(k))
        assert w.flush(120)  # ~500 fsyncs: seconds on a loaded machine
        time.sleep(0.05)
    finally:  # the readers must stop even when an assertion fails, or the test process never exits
        stop.set()
        for t in threads:
            t.join()
        w.close()
    assert not errors
    st = s.stats()
    assert st.evicted_segments > 0 and st.corrupt_records == 0 and st.admission_refusals == 0
    assert s.get_many([key(i) for i in range(30)]) == [payload(key(i)) for i in range(30)]
    s.check_integrity(deep=True)
    s.close()


# ---- write-behind ------------------------------------------------------------------------------------
class GatedStore:
    """Wraps put/flush of a real store: logs the order of events and can hold the worker in put()."""

    def __init__(self, store):
        self.store, self.log, self.gate, self.entered = store, [], threading.Event(), threading.Event()
        self.real_put, self.real_flush = store.put, store.flush
        store.put, store.flush = self.put, self.flush

    def put(self, k, p):
        self.entered.set()
        self.gate.wait(10)
        r = self.real_put(k, p)
        self.log.append(("put", k))
        return r

    def flush(self):
        ok = self.real_flush()
        self.log.append(("flush", None))
        return ok


def test_writer_batches_and_acknowledges_only_after_fsync(open_store):
    s = open_store(budget=100 * REC, segment=50 * REC)
    g = GatedStore(s)
    w = SSDWriter(s, max_batch_records=64)
    keys = [key(i) for i in range(40)]
    t = time.perf_counter()
    futures = [w.submit(k, payload(k)) for k in keys]
    assert time.perf_counter() - t < 0.5 and not any(f.done() for f in futures)  # submit did no I/O
    for k, f in zip(keys, futures):
        f.add_done_callback(lambda _f, k=k: g.log.append(("done", k)))
    g.gate.set()
    assert [f.result(10) for f in futures] == [PutResult.STORED] * 40
    for k in keys:
        i_put, i_done = g.log.index(("put", k)), g.log.index(("done", k))
        assert any(e == ("flush", None) for e in g.log[i_put:i_done]), k  # fsync between put and ack
    st = w.stats()
    assert st.batches <= 3 and st.stored == 40 and st.submitted == 40  # batched: few fsync rounds
    w.close()
    assert s.get_many(keys) == [payload(k) for k in keys]


def test_writer_queue_is_bounded_and_drops_instead_of_blocking(open_store):
    s = open_store(budget=100 * REC, segment=50 * REC)
    g = GatedStore(s)
    w = SSDWriter(s, max_pending_bytes=5 * P)
    first = w.submit(key(100), payload(key(100)))
    assert g.entered.wait(10)  # the worker is now stuck in put() with that one record
    futures = [w.submit(key(i), payload(key(i))) for i in range(12)]
    assert [f.done() for f in futures] == [False] * 5 + [True] * 7  # five fit the queue's byte bound
    assert all(f.result() is PutResult.DROPPED for f in futures[5:]) and w.stats().dropped == 7
    assert w.stats().pending_bytes == 5 * P and w.stats().pending_records == 5
    g.gate.set()
    assert w.flush(10)
    assert first.result() is PutResult.STORED and all(f.result() is PutResult.STORED for f in futures[:5])
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.submit(key(0), b"x")


def test_writer_close_drains_the_queue_and_async_put(open_store):
    s = open_store(budget=100 * REC, segment=50 * REC)
    w = SSDWriter(s)
    assert asyncio.run(w.put(key(0), payload(key(0)))) is PutResult.STORED
    futures = [w.submit(key(i), bytearray(payload(key(i)))) for i in range(1, 30)]
    w.close()
    assert all(f.result(0) is PutResult.STORED for f in futures)
    assert s.get_many([key(i) for i in range(30)]) == [payload(key(i)) for i in range(30)]
    with pytest.raises(ValueError, match="BlockHash"):
        w.submit("k", b"")


def test_writer_runs_maintenance(open_store, clock):
    s = open_store()
    keys = [key(i) for i in range(4)]
    put_all(s, keys)
    clock.advance(1)
    put_all(s, keys)  # segment 1 is now all dead
    w = SSDWriter(s, maintain_interval_s=0.01)
    deadline = time.monotonic() + 5
    while s.stats().evicted_segments == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    w.close()
    assert s.stats().evicted_segments == 1 and s.get_many(keys) == [payload(k) for k in keys]


def test_store_dir_can_be_copied_and_reopened(open_store, tmp_path):
    """A directory is self-describing: copy it elsewhere and the index comes back from the files."""
    s = open_store()
    put_all(s, [key(i) for i in range(7)])
    s.close()
    shutil.copytree(tmp_path / "ssd", tmp_path / "copy")
    with SSDStore(KVStoreConfig(ssd_dir=str(tmp_path / "copy"), ssd_budget_bytes=12 * REC,
                                ssd_segment_bytes=4 * REC)) as c:  # fmt: skip
        assert c.get_many([key(i) for i in range(7)]) == [payload(key(i)) for i in range(7)]


def test_descriptors_are_capped_by_max_open_segments(open_store):
    s = open_store(budget=40 * REC, max_open_segments=2)
    keys = [key(i) for i in range(36)]  # 9 segments
    put_all(s, keys)

    def open_segment_fds():
        links = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
        return sum(os.readlink(link).endswith(".seg") for link in links if os.path.exists(link))

    assert open_segment_fds() <= 3  # two idle sealed ones + the active one
    assert s.get_many(keys[::-1]) == [payload(k) for k in keys[::-1]]
    assert open_segment_fds() <= 3
    s.check_integrity(deep=True)
    s.close()
    s2 = open_store(budget=40 * REC, max_open_segments=2)
    assert open_segment_fds() <= 2 and s2.get_many(keys) == [payload(k) for k in keys]


def test_a_read_racing_a_compaction_finds_the_moved_record(open_store, clock, monkeypatch):
    s = open_store(budget=20 * REC)
    keys = [key(i) for i in range(8)]
    put_all(s, keys)
    clock.advance(1)
    put_all(s, keys[:3])  # segment 1 keeps one live record, keys[3]: maintain() will move it
    real = s._reader._read_chunk
    calls = []

    def compact_in_between(*args):
        if not calls:
            s.maintain()  # after the lookup, before the pin: segment 1 is compacted and deleted
        calls.append(args[0])
        return real(*args)

    monkeypatch.setattr(s._reader, "_read_chunk", compact_in_between)
    assert s.get(keys[3]) == payload(keys[3])
    assert calls[0] == [1] and calls[1] != [1]  # looked up again in its new segment
    assert s.stats().compactions == 1 and s.stats().hits == 1
    s.check_integrity(deep=True)


def test_writer_skips_cancelled_puts_and_survives(open_store):
    s = open_store(budget=100 * REC, segment=50 * REC)
    g = GatedStore(s)
    w = SSDWriter(s)
    first = w.submit(key(0), payload(key(0)))
    assert g.entered.wait(10)
    doomed = w.submit(key(1), payload(key(1)))
    assert doomed.cancel() and not first.cancel()  # queued: cancellable; taken by the worker: not
    g.gate.set()
    assert first.result(10) is PutResult.STORED
    assert asyncio.run(w.put(key(2), payload(key(2)))) is PutResult.STORED  # the worker lives on
    assert key(1) not in s and w.stats().cancelled == 1
    w.close()
