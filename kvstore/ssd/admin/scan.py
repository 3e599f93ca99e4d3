"""TierScan: a read-only look at an SSD tier directory that no store has open (the operator tools' input).

``scan_tier`` lists the segment files, scans each one's headers the way SSDStore does at start-up
(Segment.scan: same resynchronisation, same torn-tail rule) and rebuilds the same index (newest record of
a key wins), without taking the store's LOCK, fsyncing, or writing anything. What the start-up scan only
counts, it locates: the byte ranges skipped over damaged headers, so ``kv verify`` can name them.

A segment's bytes, front to back, are records, damaged ranges and at most one torn tail::

    [record][record][ damaged header(s) ... ][record] ... [torn tail: a record cut short / zero fill]
                     ^ a gap between two valid records: the scan resynchronised on the next magic

Callers must make sure no process writes the directory meanwhile (server/kv_admin/lock.py does): a
segment being appended to would show a torn tail that is in fact a write in flight.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from flashtier.kvstore.ssd.index import IndexEntry, SSDIndex
from flashtier.kvstore.ssd.record import RecordHeader
from flashtier.kvstore.ssd.segment import Segment, SegmentScan, parse_segment_name

__all__ = ["ScannedSegment", "TierScan", "damaged_ranges", "scan_tier"]


def damaged_ranges(scan: SegmentScan) -> list[tuple[int, int]]:
    """The [start, end) byte ranges of ``scan``'s segment that hold neither a valid record nor the torn tail.

    Each range is one resynchronisation of Segment.scan (one ``scan.corrupt``): a gap before a valid
    header, or a tail that is neither a record nor all zeros.
    """
    out: list[tuple[int, int]] = []
    expected = 0
    spans = sorted([(o, h.record_bytes) for o, h in scan.records] + list(scan.legacy))  # legacy: not damage
    for offset, size in spans:
        if offset > expected:
            out.append((expected, offset))
        expected = offset + size
    tail = scan.end - expected
    if tail > 0 and scan.torn_bytes != tail:
        out.append((expected, scan.end))
    return out


@dataclass(frozen=True, slots=True)
class ScannedSegment:
    """One segment file as its header scan found it."""

    segment_id: int
    path: Path
    scan: SegmentScan
    damaged: tuple[tuple[int, int], ...]  # damaged_ranges(scan)

    @property
    def size(self) -> int:
        return self.scan.end

    @property
    def records(self) -> list[tuple[int, RecordHeader]]:
        return self.scan.records

    @property
    def unattributed_bytes(self) -> int:
        """Bytes no tenant can be proven to own: version-1 records, damaged ranges, the torn tail."""
        return self.scan.legacy_bytes + sum(e - s for s, e in self.damaged) + self.scan.torn_bytes


@dataclass(frozen=True, slots=True)
class TierScan:
    """Every segment of one directory (ascending ids) and the index a store would rebuild from them."""

    directory: Path
    segments: tuple[ScannedSegment, ...]
    index: SSDIndex  # key -> newest valid record

    @property
    def bytes(self) -> int:
        """Segment file bytes on disk (records, dead or alive, damaged ranges and torn tails)."""
        return sum(s.size for s in self.segments)

    def is_live(self, segment_id: int, offset: int, header: RecordHeader) -> bool:
        """Whether the record at (``segment_id``, ``offset``) is the one a store would serve for its key."""
        return self.index.get(header.key) == IndexEntry(segment_id, offset, header.length, header.created_at)


def scan_tier(directory: str | os.PathLike[str]) -> TierScan:
    """Scan the segment files of ``directory`` (headers only; payloads are read by ``verify_tier``).

    Mutates nothing. ValueError when ``directory`` is not a directory; OSError when a segment cannot be
    read (the operator sees which file).
    """
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory")
    segments: list[ScannedSegment] = []
    for name in sorted(os.listdir(path)):
        if parse_segment_name(name) is None:
            continue
        seg = Segment.existing(path / name)
        seg.open_fd()
        try:
            scan = seg.scan()
        finally:
            seg.close()
        segments.append(ScannedSegment(seg.segment_id, seg.path, scan, tuple(damaged_ranges(scan))))
    index = SSDIndex.rebuild((s.segment_id, s.scan) for s in segments)
    return TierScan(path, tuple(segments), index)
