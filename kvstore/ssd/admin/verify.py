"""verify_tier: read every record of an SSD tier and check it the way a read does (``flashtier kv verify``).

Each record found by the header scan is read whole and decoded with ``decode_record`` (header checksum,
key, payload crc32c), the check every SSDStore read applies before serving a block. Ranges the scan
skipped over damaged headers are reported too (their records cannot be read: no trustworthy length).
A torn tail is reported apart: it is what a crash mid-append leaves, ignored by the store, not damage.

A bad record is *live* when it is the copy the store would serve for its key (the newest); a bad live
record is a future miss (the store drops it when a read fails the check), a bad dead one costs nothing.

Read-only: files are opened O_RDONLY and nothing is written or fsynced.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from flashtier.kvstore.ssd.admin.scan import TierScan
from flashtier.kvstore.ssd.record import RecordCorrupt, decode_record

__all__ = ["BadRecord", "TornTail", "VerifyReport", "verify_tier"]

_READ_BYTES = 16 << 20  # records are read in runs of about this many bytes


@dataclass(frozen=True, slots=True)
class BadRecord:
    """A record (or a damaged range) that fails its checks."""

    segment_id: int
    offset: int  # of the record header, or of the damaged range
    bytes: int  # the record's bytes, or the range's length
    key: str | None  # block hash hex from the header; None for a damaged range
    live: bool  # the copy a store would serve (bad live records are misses)
    reason: str


@dataclass(frozen=True, slots=True)
class TornTail:
    segment_id: int
    offset: int
    bytes: int


@dataclass(slots=True)
class VerifyReport:
    directory: str
    segments: int = 0
    records: int = 0  # records read and checked
    bytes_checked: int = 0
    bad: list[BadRecord] = field(default_factory=list)
    torn: list[TornTail] = field(default_factory=list)
    namespaces: dict[str, list[int]] = field(default_factory=dict)  # tenant tag hex -> [records checked, bad]
    legacy_records: int = 0  # version-1 records (no tenant): skipped, never served; not damage

    @property
    def ok(self) -> bool:
        """No bad record and no damaged range (torn tails are not damage)."""
        return not self.bad


def _runs(records: list[tuple[int, int]]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(start, end, [(offset, size)]) runs of adjacent records, each about _READ_BYTES or one record."""
    runs: list[tuple[int, int, list[tuple[int, int]]]] = []
    for offset, size in records:
        if runs and runs[-1][1] == offset and offset + size - runs[-1][0] <= _READ_BYTES:
            start, _, members = runs[-1]
            runs[-1] = (start, offset + size, [*members, (offset, size)])
        else:
            runs.append((offset, offset + size, [(offset, size)]))
    return runs


def verify_tier(scan: TierScan) -> VerifyReport:
    """Check every record of ``scan`` (see the module doc). OSError if a segment cannot be read."""
    report = VerifyReport(str(scan.directory), segments=len(scan.segments))
    for seg in scan.segments:
        for start, end in seg.damaged:
            report.bad.append(BadRecord(seg.segment_id, start, end - start, None, False, "damaged record header"))
        report.legacy_records += len(seg.scan.legacy)
        if seg.scan.torn_bytes:
            report.torn.append(TornTail(seg.segment_id, seg.size - seg.scan.torn_bytes, seg.scan.torn_bytes))
        headers = dict(seg.records)
        fd = os.open(seg.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            for start, end, members in _runs([(off, h.record_bytes) for off, h in seg.records]):
                data = os.pread(fd, end - start, start)
                for offset, size in members:
                    header = headers[offset]
                    report.records += 1
                    report.bytes_checked += size
                    counts = report.namespaces.setdefault(header.tenant.hex(), [0, 0])
                    counts[0] += 1
                    try:
                        decode_record(memoryview(data)[offset - start : offset - start + size], header.key)
                    except RecordCorrupt as exc:
                        counts[1] += 1
                        live = scan.is_live(seg.segment_id, offset, header)
                        report.bad.append(BadRecord(seg.segment_id, offset, size, header.key.hex(), live, str(exc)))
        finally:
            os.close(fd)
    report.bad.sort(key=lambda b: (b.segment_id, b.offset))
    return report
