"""plan_reads: how the records one get_many wants are cut into contiguous runs (named cases + a property).

Records here are 100 B (44 B header + 56 B payload) unless a case says otherwise."""

import random

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.ssd.index import IndexEntry
from flashtier.kvstore.ssd.read_plan import ReadPlan, ReadRun, plan_reads
from flashtier.kvstore.ssd.record import HEADER_BYTES

P = 56
REC = HEADER_BYTES + P


def key(i: int) -> BlockHash:
    return BlockHash(xxhash.xxh3_128_digest(i.to_bytes(8, "little")))


def at(i: int, seg: int, offset: int, length: int = P) -> tuple[BlockHash, IndexEntry]:
    return key(i), IndexEntry(seg, offset, length, 1.0)


def shape(plan: ReadPlan) -> list[tuple[int, int, int, list[int]]]:
    """(segment, offset, length, [record offsets]) per run: what the assertions compare."""
    return [(r.segment_id, r.offset, r.length, [e.offset for _, e in r.records]) for r in plan.runs]


def test_adjacent_records_are_one_run():
    plan = plan_reads([at(i, 1, i * REC) for i in range(4)], gap=0, max_run_bytes=1 << 20)
    assert shape(plan) == [(1, 0, 4 * REC, [0, REC, 2 * REC, 3 * REC])]
    assert plan.nbytes == 4 * REC and plan.record_count == 4


def test_gapped_records_join_only_within_the_gap():
    recs = [at(0, 1, 0), at(1, 1, 2 * REC), at(2, 1, 5 * REC)]  # holes of 1 and 2 records
    assert shape(plan_reads(recs, gap=0, max_run_bytes=1 << 20)) == [
        (1, 0, REC, [0]), (1, 2 * REC, REC, [2 * REC]), (1, 5 * REC, REC, [5 * REC])]  # fmt: skip
    assert shape(plan_reads(recs, gap=REC, max_run_bytes=1 << 20)) == [
        (1, 0, 3 * REC, [0, 2 * REC]), (1, 5 * REC, REC, [5 * REC])]  # fmt: skip
    assert shape(plan_reads(recs, gap=2 * REC, max_run_bytes=1 << 20)) == [(1, 0, 6 * REC, [0, 2 * REC, 5 * REC])]
    assert plan_reads(recs, gap=2 * REC, max_run_bytes=1 << 20).nbytes == 6 * REC  # the holes are read too


def test_runs_never_cross_segments_and_come_out_by_segment_then_offset():
    recs = [at(0, 2, 0), at(1, 1, REC), at(2, 2, REC), at(3, 1, 0)]  # adjacent offsets, two segments
    plan = plan_reads(recs, gap=1 << 30, max_run_bytes=1 << 30)
    assert shape(plan) == [(1, 0, 2 * REC, [0, REC]), (2, 0, 2 * REC, [0, REC])]
    assert list(plan.by_segment()) == [1, 2] and [len(v) for v in plan.by_segment().values()] == [1, 1]


def test_duplicates_are_planned_once():
    recs = [at(0, 1, 0), at(1, 1, REC)]
    plan = plan_reads(recs + recs[::-1] + recs, gap=0, max_run_bytes=1 << 20)
    assert shape(plan) == [(1, 0, 2 * REC, [0, REC])]
    assert [k for k, _ in plan.runs[0].records] == [key(0), key(1)]


def test_out_of_order_keys_are_sorted_by_offset():
    recs = [at(i, 7, i * REC) for i in range(6)]
    random.Random(3).shuffle(recs)
    plan = plan_reads(recs, gap=0, max_run_bytes=1 << 20)
    assert shape(plan) == [(7, 0, 6 * REC, [i * REC for i in range(6)])]
    assert [k for k, _ in plan.runs[0].records] == [key(i) for i in range(6)]


def test_max_run_bytes_splits_a_long_run():
    plan = plan_reads([at(i, 1, i * REC) for i in range(7)], gap=0, max_run_bytes=3 * REC)
    assert shape(plan) == [(1, 0, 3 * REC, [0, REC, 2 * REC]), (1, 3 * REC, 3 * REC, [3 * REC, 4 * REC, 5 * REC]),
                           (1, 6 * REC, REC, [6 * REC])]  # fmt: skip


def test_a_single_huge_record_is_a_run_of_its_own():
    big = 10 * REC
    recs = [at(0, 1, 0), at(1, 1, REC, big - HEADER_BYTES), at(2, 1, REC + big)]
    plan = plan_reads(recs, gap=0, max_run_bytes=4 * REC)
    assert shape(plan) == [(1, 0, REC, [0]), (1, REC, big, [REC]), (1, REC + big, REC, [REC + big])]
    assert max(r.length for r in plan.runs) == big  # longer than max_run_bytes: the reader sizes its buffer


def test_overlapping_entries_start_a_new_run():
    """An index never holds overlapping records; if it did, a scatter read could not express the run."""
    plan = plan_reads([at(0, 1, 0), at(1, 1, REC // 2)], gap=1 << 20, max_run_bytes=1 << 20)
    assert shape(plan) == [(1, 0, REC, [0]), (1, REC // 2, REC, [REC // 2])]


def test_empty_input_and_bad_arguments():
    assert plan_reads([], gap=0, max_run_bytes=1) == ReadPlan(())
    with pytest.raises(ValueError, match="gap"):
        plan_reads([], gap=-1, max_run_bytes=1)
    with pytest.raises(ValueError, match="max_run_bytes"):
        plan_reads([], gap=0, max_run_bytes=0)


def test_run_end():
    assert ReadRun(1, 100, 50, ()).end == 150


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30), st.integers(0, 150)), max_size=40),
       st.integers(0, 300), st.integers(1, 1000), st.randoms(use_true_random=False))  # fmt: skip
def test_every_record_is_read_exactly_once_within_the_limits(slots, gap, max_run, rnd):
    # lay records out without overlap: per segment, slot s starts at s * 200 and is at most 200 B long
    chosen = {(seg, s): length for seg, s, length in slots}
    recs = [at(i, seg, s * 200, length) for i, ((seg, s), length) in enumerate(sorted(chosen.items()))]
    rnd.shuffle(recs)
    plan = plan_reads(recs + recs[: len(recs) // 2], gap=gap, max_run_bytes=max_run)
    planned = [kv for r in plan.runs for kv in r.records]
    assert sorted(planned, key=lambda kv: kv[0].digest) == sorted(recs, key=lambda kv: kv[0].digest)
    assert [(r.segment_id, r.offset) for r in plan.runs] == sorted((r.segment_id, r.offset) for r in plan.runs)
    for r in plan.runs:
        entries = [e for _, e in r.records]
        assert entries[0].offset == r.offset and entries[-1].end == r.end
        assert all(e.segment_id == r.segment_id for e in entries)
        assert all(0 <= b.offset - a.end <= gap for a, b in zip(entries, entries[1:]))  # disjoint, near
        assert r.length <= max_run or len(entries) == 1
