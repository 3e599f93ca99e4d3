"""plan_room: which SSD segments to delete or compact so that a write of ``need`` bytes fits the budget.

Pure: no I/O, no clock, no lock. The store describes each segment file as a ``SegmentUsage`` (taken
under its metadata lock), calls ``plan_room`` and runs the steps in order, stopping as soon as the write
fits (``Compactor.make_room``). Steps come in three phases::

    over budget ──▶ 1. DELETE_DEAD     sealed segments with no live record, by id
                ──▶ 2. DELETE_EXPIRED  segments with bytes and no young byte, oldest first (by newest
                                       record; a dead one has none and sorts first), then by id
                ──▶ 3. COMPACT         segments with bytes whose young bytes are <= ``pressure_ratio`` of
                                       their size, emptiest (young / size) first, then by id: copy the
                                       young records out, delete the segment
                ──▶ still over budget: refuse the write (the budget is full of young records)

Why that order: dead space costs nothing to drop; expired records may be dropped (their lifetime is
over) and the oldest go first; compaction costs writes, and a segment more than ``pressure_ratio``
young would copy more than ratio / (1 - ratio) bytes per byte it frees (9 at 0.9): never compacted.

Each phase lists every segment that qualifies in the snapshot, so one segment can appear under several
phases (a dead segment with bytes is also expired; an expired one is also a compaction candidate). The
prediction counts a segment at its first step only, and the store skips a step whose segment is gone:
a repeat acts only as a retry when the earlier step failed (an fsync or read error). Steps past the
predicted fit stay in the plan for the same reason: a step can free less than predicted (an I/O error,
or the active segment received earlier compactions' copies and is no longer worth compacting).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class RoomAction(Enum):
    DELETE_DEAD = "delete_dead"  # nothing live in it: unlink
    DELETE_EXPIRED = "delete_expired"  # every live record past its lifetime: unlink (counted as expirations)
    COMPACT = "compact"  # copy its young records to the active segment, then unlink


@dataclass(frozen=True, slots=True)
class SegmentUsage:
    """One segment file as the planner sees it (young = created_at > now - lifetime)."""

    segment_id: int
    size: int  # bytes in the file: live + dead records + a torn tail
    live_records: int  # records the index points at
    young_bytes: int  # bytes of live records still inside their lifetime
    newest_created_at: float | None  # of its newest live record; None when nothing is live
    sealed: bool = True  # False for the active segment (still appended to)

    def __post_init__(self) -> None:
        if self.size < 0 or self.live_records < 0 or self.young_bytes < 0:
            raise ValueError(f"negative size or count in {self}")
        if (self.live_records == 0) != (self.newest_created_at is None) or (self.live_records == 0 < self.young_bytes):
            raise ValueError(f"{self}: newest_created_at and young_bytes need a live record (and it needs them)")


@dataclass(frozen=True, slots=True)
class RoomStep:
    action: RoomAction
    segment_id: int
    bytes_after: int  # predicted disk bytes once this step ran, every earlier one having gone as predicted


@dataclass(frozen=True, slots=True)
class RoomPlan:
    """The steps to try, in order; the store stops at the first point where the write fits."""

    steps: tuple[RoomStep, ...]  # every candidate step, in order (see the module docstring)
    needed: int  # leading steps predicted to make the write fit; len(steps) when it never fits
    refuse: bool  # predicted: still over budget after every step (an admission refusal)

    @property
    def planned(self) -> tuple[RoomStep, ...]:
        """The steps predicted to run (the rest are there in case one frees less than predicted)."""
        return self.steps[: self.needed]

    @property
    def deletes(self) -> tuple[int, ...]:
        """Segment ids predicted to be deleted, in order."""
        return self._first(RoomAction.DELETE_DEAD, RoomAction.DELETE_EXPIRED)

    @property
    def compactions(self) -> tuple[int, ...]:
        """Segment ids predicted to be compacted, in order."""
        return self._first(RoomAction.COMPACT)

    def _first(self, *actions: RoomAction) -> tuple[int, ...]:
        seen: set[int] = set()
        out = []
        for step in self.planned:
            if step.segment_id not in seen and step.action in actions:
                out.append(step.segment_id)
            seen.add(step.segment_id)
        return tuple(out)


def plan_room(segments: Sequence[SegmentUsage], *, need: int, budget: int, pressure_ratio: float) -> RoomPlan:
    """The plan to bring disk use (the sum of ``segments``' sizes) plus ``need`` within ``budget``.

    Empty (and not refused) when the write fits already. A deletion is predicted to free the segment's
    size, a compaction its size minus its young bytes (the copies land elsewhere).
    Failure: ValueError for a negative ``need`` or a ``pressure_ratio`` outside [0, 1).
    """
    if need < 0:
        raise ValueError(f"need must be >= 0, got {need}")
    if not 0.0 <= pressure_ratio < 1.0:
        raise ValueError(f"pressure_ratio must be in [0, 1), got {pressure_ratio!r}")
    used = sum(s.size for s in segments)
    if used + need <= budget:
        return RoomPlan(steps=(), needed=0, refuse=False)
    by_id = sorted(segments, key=lambda s: s.segment_id)
    sized = [s for s in by_id if s.size]
    dead = [s for s in by_id if s.sealed and s.live_records == 0]
    expired = sorted((s for s in sized if s.young_bytes == 0),
                     key=lambda s: (_or_minus_inf(s.newest_created_at), s.segment_id))  # fmt: skip
    ranked = sorted((s for s in sized if s.young_bytes <= pressure_ratio * s.size),
                    key=lambda s: (s.young_bytes / s.size, s.segment_id))  # fmt: skip
    candidates = [(RoomAction.DELETE_DEAD, s) for s in dead]
    candidates += [(RoomAction.DELETE_EXPIRED, s) for s in expired]
    candidates += [(RoomAction.COMPACT, s) for s in ranked]
    steps: list[RoomStep] = []
    gone: set[int] = set()
    needed: int | None = None
    for action, seg in candidates:
        if seg.segment_id not in gone:
            gone.add(seg.segment_id)
            used -= seg.size - (seg.young_bytes if action is RoomAction.COMPACT else 0)
        steps.append(RoomStep(action, seg.segment_id, used))
        if needed is None and used + need <= budget:
            needed = len(steps)
    return RoomPlan(steps=tuple(steps), needed=len(steps) if needed is None else needed, refuse=needed is None)


def _or_minus_inf(t: float | None) -> float:
    return -float("inf") if t is None else t
