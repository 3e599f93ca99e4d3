"""SSDReader through the store: get_many and get_many_into against per-record reads (the oracle: one pread
and decode_record per key, what the reader did before runs), damage inside a coalesced run, truncated
segment files, read errors, and get_many_into's argument checks.

Records are 60 B headers with payloads of 1..400 B; segments hold 2,000 B."""

import errno
import os
import random

import numpy as np
import pytest
import torch

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.ssd.reader import SSDReader
from flashtier.kvstore.ssd.record import HEADER_BYTES, RecordCorrupt, decode_record

from .ssd_store_support import clock, flip, key, open_store, payload  # noqa: F401 - clock and open_store are fixtures

P = 100 - HEADER_BYTES  # as ssd_store_support.P
REC = HEADER_BYTES + P
SEG = 2000


def per_record(store, k: BlockHash) -> bytes | None:
    """The oracle: the key's record read on its own and decoded by the record format's decoder."""
    e = store.entry(k)
    if e is None:
        return None
    fd = os.open(store.segment_path(e.segment_id), os.O_RDONLY)
    try:
        raw = os.pread(fd, e.record_bytes, e.offset)
    finally:
        os.close(fd)
    try:
        data = decode_record(raw, k)
    except RecordCorrupt:
        return None
    return data if len(data) == e.length else None


def with_reader(store, clock, *, gap: int, run_bytes: int, pipeline: bool = True, prefetch_bytes: int = 1 << 20):
    """Swap in a reader with other limits (the store passes only the gap)."""
    store._reader = SSDReader(store._meta, store._refresh, clock, coalesce_gap_bytes=gap, run_bytes=run_bytes,
                              prefetch_bytes=prefetch_bytes, pipeline=pipeline)  # fmt: skip
    return store


def into(store, keys, slot: int, fill: int = 0xEE):
    dest = bytearray([fill]) * (len(keys) * slot)
    ok = store.get_many_into(keys, dest, slot)
    return ok, [bytes(dest[i * slot : (i + 1) * slot]) for i in range(len(keys))]


@pytest.fixture
def mixed(open_store):
    """~60 records of 1..400 B over several segments, with dead records (holes) between live ones."""
    s = open_store(budget=1000 * SEG, segment=SEG)
    rnd = random.Random(11)
    for i in range(60):
        s.put(key(i), payload(key(i), P if i % 3 else rnd.randint(1, 400)))
        if i % 7 == 3:
            s.put(key(i - 2), payload(key(i - 2), P))  # supersede an earlier record: a hole in its segment
    assert s.flush()
    return s


@pytest.mark.parametrize("pipeline", [True, False], ids=["io-thread", "one-thread"])
@pytest.mark.parametrize("gap,run_bytes", [(0, 8 << 20), (REC, 8 << 20), (10 * REC, 3 * REC), (0, 1)],
                         ids=["adjacent", "gap-1-record", "gap-10-small-runs", "one-record-runs"])  # fmt: skip
def test_get_many_matches_per_record_reads_on_random_key_sets(mixed, clock, gap, run_bytes, pipeline):
    s = with_reader(mixed, clock, gap=gap, run_bytes=run_bytes, pipeline=pipeline, prefetch_bytes=gap)
    rnd = random.Random(gap + run_bytes)
    for _ in range(12):
        keys = [key(rnd.randrange(70)) for _ in range(rnd.randint(0, 40))]  # duplicates, misses (60..69)
        want = [per_record(s, k) for k in keys]
        before = s.stats()
        assert s.get_many(keys) == want
        ok, slots = into(s, keys, P)
        assert ok == [w is not None and len(w) == P for w in want]
        assert slots == [w if hit else b"\xee" * P for w, hit in zip(want, ok)]  # other lengths: untouched
        st = s.stats()
        assert st.hits - before.hits == sum(w is not None for w in want) + sum(ok)
        assert st.misses - before.misses == 2 * len(keys) - (st.hits - before.hits)
        assert st.corrupt_records == 0 and st.read_errors == 0
    s.check_integrity(deep=True)


def test_a_flipped_byte_inside_a_coalesced_run_misses_that_record_only(open_store):
    s = open_store(budget=1000 * SEG, segment=SEG)
    keys = [key(i) for i in range(8)]
    for k in keys:
        s.put(k, payload(k))
    assert s.flush()
    flip(s, keys[3], HEADER_BYTES + 9)
    ops = s.stats().read_ops
    got = s.get_many(keys[::-1])[::-1]
    assert got == [None if i == 3 else payload(k) for i, k in enumerate(keys)]
    st = s.stats()
    assert st.read_ops == ops + 1 and st.corrupt_records == 1 and keys[3] not in s  # one run, one bad record
    assert s.get_many(keys) == got and s.stats().corrupt_records == 1  # now a plain miss


def test_a_flipped_byte_read_into_a_buffer_leaves_a_zeroed_slot(open_store):
    s = open_store(budget=1000 * SEG, segment=SEG)
    keys = [key(i) for i in range(8)]
    for k in keys:
        s.put(k, payload(k))
    assert s.flush()
    flip(s, keys[5], 2)  # the header this time
    ok, slots = into(s, keys + [keys[1]], P)
    assert ok == [i != 5 for i in range(8)] + [True]
    assert slots == [bytes(P) if i == 5 else payload(k) for i, k in enumerate(keys)] + [payload(keys[1])]
    assert s.stats().corrupt_records == 1 and keys[5] not in s


@pytest.mark.parametrize("cut", [0, 1, REC - 1, REC, 3 * REC + HEADER_BYTES, 4 * REC - 1])
def test_a_truncated_segment_file_yields_misses_not_errors(open_store, cut):
    s = open_store(budget=1000 * SEG, segment=SEG)
    keys = [key(i) for i in range(6)]
    for k in keys:
        s.put(k, payload(k))
    assert s.flush()
    assert s.get_many(keys) == [payload(k) for k in keys]  # the reused run buffer now holds every record
    os.truncate(s.segment_path(s.entry(keys[0]).segment_id), cut)  # behind the store's back
    whole = cut // REC  # records still complete in the file
    want = [payload(k) if i < whole else None for i, k in enumerate(keys)]
    assert s.get_many(keys) == want  # not the intact bytes left in the buffer by the first read
    st = s.stats()
    assert (st.hits, st.read_errors, st.corrupt_records) == (len(keys) + whole, 0, len(keys) - whole)
    assert [k in s for k in keys] == [i < whole for i in range(len(keys))]


def test_a_truncated_file_read_into_a_buffer_zeroes_the_cut_slots(open_store):
    s = open_store(budget=1000 * SEG, segment=SEG)
    keys = [key(i) for i in range(4)]
    for k in keys:
        s.put(k, payload(k))
    assert s.flush()
    dest = bytearray(len(keys) * P)
    assert s.get_many_into(keys, dest, P) == [True] * 4  # dest holds every payload already
    os.truncate(s.segment_path(1), 2 * REC + HEADER_BYTES + 10)  # the third record loses most of its payload
    assert s.get_many_into(keys, dest, P) == [True, True, False, False]
    assert bytes(dest) == payload(keys[0]) + payload(keys[1]) + bytes(2 * P)


def test_a_read_error_into_a_buffer_leaves_no_unverified_bytes(open_store, monkeypatch):
    s = open_store(budget=1000 * SEG, segment=SEG)
    keys = [key(i) for i in range(3)]
    for k in keys:
        s.put(k, payload(k))
    assert s.flush()

    def scribble_then_fail(fd, views, offset):
        for v in views:
            v[:] = b"\xab" * v.nbytes
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "preadv", scribble_then_fail)
    ok, slots = into(s, keys, P)
    assert ok == [False] * 3 and slots == [bytes(P)] * 3
    st = s.stats()
    assert (st.read_errors, st.corrupt_records, st.misses) == (1, 0, 3) and all(k in s for k in keys)


def test_get_many_into_fills_a_tensor_and_copies_duplicates(open_store):
    s = open_store(budget=1000 * SEG, segment=SEG)
    keys = [key(i) for i in range(5)]
    for k in keys:
        s.put(k, payload(k))
    assert s.flush()
    order = [keys[4], keys[0], keys[4], key(99), keys[2]]
    dest = torch.full((len(order) + 1, P), 7, dtype=torch.uint8)  # one spare slot at the end
    ok = s.get_many_into(order, dest.numpy(), P)
    assert ok == [True, True, True, False, True]
    want = [payload(k) if hit else bytes([7]) * P for k, hit in zip(order, ok)] + [bytes([7]) * P]
    assert [bytes(row.numpy()) for row in dest] == want


def test_get_many_into_refuses_bad_arguments(open_store):
    s = open_store(budget=1000 * SEG, segment=SEG)
    keys = [key(0), key(1)]
    with pytest.raises(ValueError, match="writable"):
        s.get_many_into(keys, bytes(2 * P), P)
    with pytest.raises(ValueError, match="holds"):
        s.get_many_into(keys, bytearray(2 * P - 1), P)
    with pytest.raises(ValueError, match="slot_bytes"):
        s.get_many_into(keys, bytearray(2 * P), 0)
    with pytest.raises(ValueError, match="slot_bytes"):
        s.get_many_into(keys, bytearray(2 * P), True)
    with pytest.raises(ValueError, match="buffer protocol"):
        s.get_many_into(keys, [0] * (2 * P), P)
    with pytest.raises(ValueError, match="writable"):
        s.get_many_into(keys, np.zeros((4, 2 * P), dtype=np.uint8)[:, :P], P)  # not contiguous
    with pytest.raises(ValueError, match="BlockHash"):
        s.get_many_into([b"\x00" * 16], bytearray(P), P)
    assert s.get_many_into([], bytearray(0), P) == []


@pytest.mark.parametrize("pipeline", [True, False], ids=["io-thread", "one-thread"])
def test_a_read_error_on_one_run_spares_the_others(open_store, clock, monkeypatch, pipeline):
    s = with_reader(open_store(budget=1000 * SEG, segment=SEG), clock, gap=0, run_bytes=2 * REC, pipeline=pipeline)
    keys = [key(i) for i in range(6)]  # one segment, three runs of two records
    for k in keys:
        s.put(k, payload(k))
    assert s.flush()
    real = os.preadv

    def fail_at_the_second_run(fd, views, offset):
        if offset == 2 * REC:
            raise OSError(errno.EIO, "injected")
        return real(fd, views, offset)

    monkeypatch.setattr(os, "preadv", fail_at_the_second_run)
    assert s.get_many(keys) == [payload(k) for k in keys[:2]] + [None, None] + [payload(k) for k in keys[4:]]
    ok, slots = into(s, keys, P)
    assert ok == [True, True, False, False, True, True] and slots[2:4] == [bytes(P)] * 2
    st = s.stats()
    assert (st.read_errors, st.corrupt_records, st.read_ops) == (2, 0, 4) and all(k in s for k in keys)


@pytest.mark.parametrize("pipeline", [True, False], ids=["io-thread", "one-thread"])
@pytest.mark.parametrize("window,announced", [(0, []), (1, [1, 2, 3, 4, 5]), (2 * REC, [1, 2, 3, 4, 5])])
def test_runs_ahead_are_announced_once_in_order_within_the_window(open_store, clock, monkeypatch, pipeline,
                                                                  window, announced):  # fmt: skip
    from flashtier.kvstore.ssd import reader as ssd_reader

    s = with_reader(open_store(budget=1000 * SEG, segment=SEG), clock, gap=0, run_bytes=REC, pipeline=pipeline,
                    prefetch_bytes=window)  # fmt: skip
    keys = [key(i) for i in range(6)]  # six runs of one record
    for k in keys:
        s.put(k, payload(k))
    assert s.flush()
    calls, reads = [], []
    real = os.preadv
    monkeypatch.setattr(ssd_reader, "prefetch", lambda fd, off, n: calls.append((off // REC, n, len(reads))))
    monkeypatch.setattr(os, "preadv", lambda fd, v, off: reads.append(off) or real(fd, v, off))
    assert s.get_many(keys) == [payload(k) for k in keys]
    assert [run for run, _, _ in calls] == announced and all(n == REC for _, n, _ in calls)
    # never announced after its own read, and at most window / REC + 1 runs ahead of the one being read
    assert all(before_reads <= run for run, _, before_reads in calls)
    assert all(run - before_reads <= window // REC + 1 for run, _, before_reads in calls)
