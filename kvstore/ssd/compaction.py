"""Compactor: keeps an SSDStore inside its disk budget: makes room for writes, compacts, collects garbage.

Under pressure (a write of n bytes would pass ``ssd_budget_bytes``) ``make_room`` snapshots the segments,
asks ``plan_room`` (ssd/room_plan.py: delete dead, delete expired oldest first, compact mostly-expired
segments emptiest first) and runs the steps until the write fits. If it still does not fit, young
records fill the budget and the write is refused: a result (PutResult.REFUSED), never an exception.

Without pressure ``collect`` (from maintain()) garbage-collects superseded records: dead segments are
deleted and segments whose live bytes (young or not) are <= ``compact_live_ratio`` of their size are
compacted, when the copies fit the budget.

A compaction copies records byte-identical (same created_at, so lifetimes do not restart) to the active
segment, fsyncs them, then deletes the source::

    source sealed ──pread runs + verify──▶ copies appended ──flush (inside delete)──▶ source unlinked
                        │ a record failing its checks: dropped from the index, counted corrupt
                        └ I/O error: stop, the source stays (its records are still indexed where valid)

The copies land before the source goes, so disk use may pass the budget by less than one segment for
that moment. Every method needs the store's write lock; the metadata lock is taken briefly inside.
"""

from __future__ import annotations

from flashtier.kvstore.ssd.log import SegmentLog
from flashtier.kvstore.ssd.meta import SSDMeta
from flashtier.kvstore.ssd.record_io import coalesce_runs, verified_payload
from flashtier.kvstore.ssd.room_plan import RoomAction, SegmentUsage, plan_room
from flashtier.kvstore.ssd.segment import Segment


class Compactor:
    """Space management of one store: admission-time room making and background garbage collection."""

    def __init__(self, meta: SSDMeta, log: SegmentLog, *, budget_bytes: int, lifetime_s: float,
                 compact_live_ratio: float, pressure_compact_ratio: float,
                 coalesce_gap_bytes: int) -> None:  # fmt: skip
        self._meta = meta
        self._log = log
        self._budget = budget_bytes
        self._lifetime_s = lifetime_s
        self._compact_ratio = compact_live_ratio
        self._pressure_ratio = pressure_compact_ratio
        self._gap = coalesce_gap_bytes

    def make_room(self, need: int, now: float) -> bool:
        """Free disk until ``need`` more bytes fit the budget; whether they fit now.

        Mutates: may delete and compact segments (see plan_room for which, in what order).
        Failure: False when young records fill the budget (the caller refuses the write); I/O errors
        are counted and the next step is tried.
        """
        meta = self._meta
        if meta.bytes + need <= self._budget:
            return True
        cutoff = now - self._lifetime_s
        plan = plan_room(self._usage(cutoff), need=need, budget=self._budget, pressure_ratio=self._pressure_ratio)
        for step in plan.steps:
            if meta.bytes + need <= self._budget:
                return True
            seg = meta.segments.get(step.segment_id)
            if seg is None:
                continue  # deleted by an earlier step (a repeat is only a retry after a failure)
            if step.action is not RoomAction.COMPACT:
                self._log.delete(seg, now)
            # checked again: the active segment may have grown with an earlier compaction's copies
            elif meta.young(seg, cutoff) <= self._pressure_ratio * seg.size:
                self.compact(seg, now, young_only=True)
        return meta.bytes + need <= self._budget

    def collect(self, now: float) -> None:
        """Delete sealed segments with nothing live; compact those whose live bytes are <= compact_live_ratio
        of their size (only if the copies fit the budget). Never drops a young record."""
        meta = self._meta
        for seg in meta.sealed_segments():
            if seg.retired:
                continue
            with meta.lock:
                count, live = meta.index.live_count(seg.segment_id), meta.index.live_bytes(seg.segment_id)
            if count == 0:
                self._log.delete(seg, now)
            elif live <= self._compact_ratio * seg.size and meta.bytes + live <= self._budget:
                self.compact(seg, now, young_only=False)

    def compact(self, seg: Segment, now: float, *, young_only: bool) -> bool:
        """Copy ``seg``'s live records (only the young ones if ``young_only``) to the active segment,
        fsync them, then delete ``seg``. Returns whether ``seg`` was deleted.

        Mutates: index (entries move to the copies), ``compactions``/``compacted_bytes``, read counters.
        Failure: False on an I/O error; ``seg`` stays (the records already copied are served from the copies).
        """
        meta = self._meta
        if seg is self._log.active:
            self._log.seal_active()
        cutoff = now - self._lifetime_s
        with meta.lock:
            entries = [(k, e) for k, e in meta.index.segment_entries(seg.segment_id)
                       if not young_only or e.created_at > cutoff]  # fmt: skip
        copied = 0
        for run in coalesce_runs(entries, self._gap):
            start, end = run[0][1].offset, run[-1][1].end
            try:
                with meta.fds.pinned(seg):
                    data = seg.read(start, end - start)
            except OSError as exc:
                with meta.lock:
                    meta.health.read_failed_locked(1, exc)
                return False
            with meta.lock:
                meta.stats.bytes_read += len(data)
                meta.stats.read_ops += 1
            for key, entry in run:
                rel = entry.offset - start
                if verified_payload(data, rel, key, entry) is None:
                    with meta.lock:
                        if meta.index.remove(key, entry) is not None:
                            meta.stats.corrupt_records += 1
                    continue
                new = self._log.append(data[rel : rel + entry.record_bytes], entry.created_at, entry.length)
                if new is None:
                    return False
                copied += entry.record_bytes
                with meta.lock:
                    meta.index.insert(key, new)
        with meta.lock:
            meta.stats.compactions += 1
            meta.stats.compacted_bytes += copied
        return self._log.delete(seg, now)

    def _usage(self, cutoff: float) -> list[SegmentUsage]:
        """Every segment as plan_room sees it, young meaning created after ``cutoff``. Takes the metadata lock."""
        meta = self._meta
        with meta.lock:  # readers may drop corrupt entries: index reads need the metadata lock
            return [SegmentUsage(segment_id=seg_id, size=seg.size, live_records=meta.index.live_count(seg_id),
                                 young_bytes=meta.index.young_bytes(seg_id, cutoff),
                                 newest_created_at=meta.index.newest_created_at(seg_id), sealed=seg.sealed)
                    for seg_id, seg in meta.segments.items()]  # fmt: skip
