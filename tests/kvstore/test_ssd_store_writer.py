"""SSDWriter over a real SSDStore: batching with acknowledgement after fsync, the bounded queue, close and async
put, maintenance; concurrent readers during writes and compaction; and the store cases that involve the writer or a concurrent compaction (copying a store
directory, the descriptor cap, a read racing a compaction, cancelled puts)."""

import asyncio
import os
import random
import shutil
import threading
import time

import pytest

from flashtier.kvstore.tenant import DEFAULT_TENANT_TAG
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.ssd.store import PutResult, SSDStore
from flashtier.kvstore.ssd.writer import SSDWriter

from .ssd_store_support import (  # noqa: F401 - clock and open_store are fixtures
    P, REC, clock, config, key, open_store, payload, put_all,
)


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

    def put(self, k, p, tenant=DEFAULT_TENANT_TAG):
        self.entered.set()
        self.gate.wait(10)
        r = self.real_put(k, p, tenant)
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
