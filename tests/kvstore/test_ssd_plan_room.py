"""plan_room: exact plans on small hand-made segment tables, and that the store runs the plan it gets.

Every expected plan below was worked out by hand from the rules in ssd/room_plan.py (three phases, a
segment counted once at its first step, later steps kept for retries); ``bytes_after`` is the predicted
disk use after each step. Budgets are in bytes, records 100 B, ``pressure_ratio`` 0.9 unless noted.
"""

import pytest
import xxhash

from flashtier.kvstore.ssd import compaction as ssd_compaction
from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.ssd.record import HEADER_BYTES
from flashtier.kvstore.ssd.room_plan import RoomAction, RoomPlan, RoomStep, SegmentUsage, plan_room
from flashtier.kvstore.ssd.store import PutResult, SSDStore

DEAD, EXPIRED, COMPACT = RoomAction.DELETE_DEAD, RoomAction.DELETE_EXPIRED, RoomAction.COMPACT


def seg(segment_id, size, live=0, young=0, newest=None, *, sealed=True) -> SegmentUsage:
    return SegmentUsage(segment_id, size, live_records=live, young_bytes=young, newest_created_at=newest, sealed=sealed)


def plan(segments, need, budget, ratio=0.9) -> RoomPlan:
    return plan_room(segments, need=need, budget=budget, pressure_ratio=ratio)


def test_a_write_that_fits_exactly_needs_no_step():
    p = plan([seg(1, 400, 4, 400, 5.0), seg(2, 500, 5, 500, 6.0, sealed=False)], need=100, budget=1000)
    assert p == RoomPlan(steps=(), needed=0, refuse=False)
    assert (p.planned, p.deletes, p.compactions) == ((), (), ())


def test_dead_segment_meets_the_budget_exactly():
    table = [seg(1, 400), seg(2, 400, 4, 400, 50.0), seg(3, 300, 3, 300, 60.0, sealed=False)]
    p = plan(table, need=300, budget=1000)  # 1100 + 300 over; deleting segment 1 leaves 700 + 300 = 1000
    assert p.steps == (RoomStep(DEAD, 1, 700), RoomStep(EXPIRED, 1, 700), RoomStep(COMPACT, 1, 700))
    assert (p.needed, p.refuse, p.deletes, p.compactions) == (1, False, (1,), ())
    assert p.planned == (RoomStep(DEAD, 1, 700),)
    over = plan(table, need=301, budget=1000)  # one byte more: segments 2 and 3 are young, > 90 % of size
    assert over.steps == p.steps and (over.needed, over.refuse, over.deletes) == (3, True, (1,))


def test_budget_full_of_young_records_refuses_without_steps():
    table = [seg(1, 400, 4, 400, 10.0), seg(2, 400, 4, 361, 20.0), seg(3, 200, 2, 200, 30.0, sealed=False)]
    p = plan(table, need=100, budget=1000)  # 361 / 400 young is just over 0.9: not worth compacting
    assert p == RoomPlan(steps=(), needed=0, refuse=True)
    p2 = plan(table[:1] + [seg(2, 400, 4, 360, 20.0)] + table[2:], need=100, budget=1000)  # exactly 0.9: a candidate
    assert p2.steps == (RoomStep(COMPACT, 2, 960),) and (p2.needed, p2.refuse) == (1, True)


def test_expired_segments_go_first_oldest_newest_record_first():
    table = [
        seg(1, 400, 2, 0, 30.0),  # expired, newest record at 30
        seg(2, 400, 4, 0, 10.0),  # expired, older: goes first
        seg(3, 400, 1, 100, 90.0),  # 25 % young: would compact, but the expired ones suffice
        seg(4, 200, 2, 200, 95.0, sealed=False),
    ]
    p = plan(table, need=100, budget=1000)  # 1400 + 100: 500 over
    assert p.steps == (
        RoomStep(EXPIRED, 2, 1000),
        RoomStep(EXPIRED, 1, 600),
        RoomStep(COMPACT, 1, 600),
        RoomStep(COMPACT, 2, 600),
        RoomStep(COMPACT, 3, 300),
    )
    assert (p.needed, p.refuse, p.deletes, p.compactions) == (2, False, (2, 1), ())


def test_compaction_picks_the_emptiest_segment_first():
    table = [
        seg(1, 400, 3, 300, 50.0),  # 75 % young
        seg(2, 400, 1, 100, 40.0),  # 25 % young: emptiest
        seg(3, 400, 4, 380, 60.0),  # 95 %: never compacted
        seg(4, 400, 4, 360, 70.0),  # 90 %: last resort
        seg(5, 100, 1, 100, 80.0, sealed=False),
    ]
    p = plan(table, need=100, budget=1500)  # 1700 + 100: 300 over; compacting 2 frees exactly 300
    assert p.steps == (RoomStep(COMPACT, 2, 1400), RoomStep(COMPACT, 1, 1300), RoomStep(COMPACT, 4, 1260))
    assert (p.needed, p.refuse, p.compactions, p.deletes) == (1, False, (2,), ())
    assert plan(table, need=101, budget=1500).compactions == (2, 1)
    worst = plan(table, need=241, budget=1500)  # 1260 + 241 > 1500 even after all three
    assert (worst.needed, worst.refuse, worst.compactions) == (3, True, (2, 1, 4))


def test_ties_break_by_segment_id_and_input_order_does_not_matter():
    table = [seg(7, 300, 1, 0, 5.0), seg(3, 300, 1, 0, 5.0), seg(5, 300, 2, 150, 9.0), seg(4, 300, 1, 150, 9.0)]
    p = plan(table, need=100, budget=700)
    assert p.steps == (
        RoomStep(EXPIRED, 3, 900),
        RoomStep(EXPIRED, 7, 600),
        RoomStep(COMPACT, 3, 600),
        RoomStep(COMPACT, 7, 600),
        RoomStep(COMPACT, 4, 450),
        RoomStep(COMPACT, 5, 300),
    )
    assert p.needed == 2 and plan(list(reversed(table)), need=100, budget=700) == p


def test_ragged_sizes_empty_files_torn_tails_and_a_dead_active_segment():
    table = [
        seg(1, 0),  # sealed, empty (an append failed at byte 0)
        seg(2, 130, 1, 0, 5.0),  # one expired record + a torn tail
        seg(3, 250),  # dead, sealed
        seg(4, 370, 2, 100, 80.0),  # 27 % young
        seg(5, 90, sealed=False),  # the active segment, its record superseded: dead but not sealed
    ]
    p = plan(table, need=150, budget=700)  # 840 + 150: 290 over
    assert p.steps == (
        RoomStep(DEAD, 1, 840),
        RoomStep(DEAD, 3, 590),
        RoomStep(EXPIRED, 3, 590),  # dead segments are expired too (a retry if the first delete failed)
        RoomStep(EXPIRED, 5, 500),  # active, so not in phase 1; no newest record: sorts with the dead
        RoomStep(EXPIRED, 2, 370),
        RoomStep(COMPACT, 2, 370),
        RoomStep(COMPACT, 3, 370),
        RoomStep(COMPACT, 5, 370),
        RoomStep(COMPACT, 4, 100),
    )
    assert (p.needed, p.refuse, p.deletes, p.compactions) == (4, False, (1, 3, 5), ())


def test_pressure_ratio_zero_compacts_only_what_has_nothing_young():
    table = [seg(1, 400, 1, 1, 50.0), seg(2, 400, 4, 0, 10.0)]
    p = plan(table, need=500, budget=800, ratio=0.0)
    assert p.steps == (RoomStep(EXPIRED, 2, 400), RoomStep(COMPACT, 2, 400))
    assert (p.needed, p.refuse) == (2, True)


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError):
        seg(1, 100, 0, 0, 5.0)  # a newest record without a live one
    with pytest.raises(ValueError):
        seg(1, 100, 1, 0, None)
    with pytest.raises(ValueError):
        seg(1, 100, 0, 50, None)  # young bytes without a live record
    with pytest.raises(ValueError):
        seg(1, -1)
    with pytest.raises(ValueError):
        plan([], need=-1, budget=10)
    with pytest.raises(ValueError):
        plan([], need=1, budget=10, ratio=1.0)


# ---- the store runs the plan it gets --------------------------------------------------------------
HOUR, P = 3600.0, 56
REC = HEADER_BYTES + P
T0 = 1_000_000.0


def key(i: int) -> BlockHash:
    return BlockHash(xxhash.xxh3_128_digest(i.to_bytes(8, "little")))


def test_store_snapshots_segments_and_follows_the_plan(tmp_path, monkeypatch):
    now = [T0]
    cfg = KVStoreConfig(ssd_dir=str(tmp_path / "ssd"), ssd_budget_bytes=12 * REC, ssd_segment_bytes=4 * REC)
    seen: list[tuple[list[SegmentUsage], RoomPlan]] = []

    def recording(segments, **kw):
        seen.append((list(segments), plan_room(segments, **kw)))
        return seen[-1][1]

    monkeypatch.setattr(ssd_compaction, "plan_room", recording)
    with SSDStore(cfg, clock=lambda: now[0]) as s:
        for g in range(3):  # one segment each, an hour apart
            assert all(s.put(key(10 * g + i), bytes(P)).ok for i in range(4)) and s.flush()
            now[0] += HOUR
        now[0] = T0 + 73.5 * HOUR  # segments 1 and 2 expired (73.5 h, 72.5 h), segment 3 young
        assert seen == []  # nothing was over budget so far
        assert s.put(key(100), bytes(P)) is PutResult.STORED
        usage, p = seen[0]
        assert usage == [
            SegmentUsage(1, 4 * REC, 4, 0, T0, True),
            SegmentUsage(2, 4 * REC, 4, 0, T0 + HOUR, True),
            SegmentUsage(3, 4 * REC, 4, 4 * REC, T0 + 2 * HOUR, False),
        ]
        assert p.planned == (RoomStep(EXPIRED, 1, 8 * REC),) and not p.refuse
        assert s.entry(key(0)) is None and s.entry(key(10)) is not None  # only segment 1 went
        assert not s.segment_path(1).exists() and s.segment_path(2).exists()
        assert s.stats().expirations == 4 and s.stats().evicted_segments == 1
        s.check_integrity(deep=True)
