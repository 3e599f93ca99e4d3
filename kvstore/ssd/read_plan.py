"""ReadPlan: the byte ranges one SSD read reads, and which wanted records each range holds.

The records a ``get_many`` wants (in the caller's order, any mix of segments) are sorted by (segment,
offset) and cut into *runs*; a run is one contiguous range of one segment, read by one ``preadv``::

    segment 3:  |rec a|rec b|      |rec c|................|rec d|
                 └─── run 1 (gap <= gap bytes) ──┘        └ run 2 ┘   (gap too wide: a new run)

A record joins the current run when it starts at or after the run's end, at most ``gap`` bytes after
it, and the run stays within ``max_run_bytes``. A record larger than ``max_run_bytes`` is a run of its
own (the caller reads it with a buffer of its size). Records of a run never overlap, so a run can also
be scattered straight into per-record destinations: an index never holds overlapping records
(``SSDIndex.check_integrity``), and if it did, the later record would start a new run. A key listed
twice at the same place is planned once.

Pure: no I/O, no locks; safe from any thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from operator import itemgetter

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.ssd.index import IndexEntry
from flashtier.kvstore.ssd.record import HEADER_BYTES

Located = tuple[BlockHash, IndexEntry]  # a key and where its newest record is


@dataclass(frozen=True, slots=True)
class ReadRun:
    """One contiguous read: bytes [offset, offset + length) of a segment, holding ``records``."""

    segment_id: int
    offset: int  # the first record's header
    length: int  # up to the last record's end, gaps included
    records: tuple[Located, ...]  # ascending, disjoint offsets

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """Every run of one read, by (segment, offset)."""

    runs: tuple[ReadRun, ...]

    @property
    def nbytes(self) -> int:
        """Bytes the plan reads (records plus the gaps read through)."""
        return sum(r.length for r in self.runs)

    @property
    def record_count(self) -> int:
        return sum(len(r.records) for r in self.runs)

    def by_segment(self) -> dict[int, list[ReadRun]]:
        """segment id -> its runs by offset; ids ascending."""
        out: dict[int, list[ReadRun]] = {}
        for run in self.runs:
            out.setdefault(run.segment_id, []).append(run)
        return out


def plan_reads(located: Iterable[Located], *, gap: int, max_run_bytes: int) -> ReadPlan:
    """The runs that read every record of ``located`` (any order, duplicates allowed).

    Failure: ValueError naming ``gap`` (< 0) or ``max_run_bytes`` (< 1). Mutates nothing.
    """
    if gap < 0:
        raise ValueError(f"gap must be >= 0 bytes, got {gap}")
    if max_run_bytes < 1:
        raise ValueError(f"max_run_bytes must be >= 1, got {max_run_bytes}")
    # sort and deduplicate on plain fields (hashing (key, entry) pairs would cost more than the plan)
    todo = sorted((((e.segment_id, e.offset, e.length, k.digest), k, e) for k, e in located), key=itemgetter(0))
    runs: list[ReadRun] = []
    seg, start, end, records, last = -1, 0, 0, [], None
    for pos, key, entry in todo:
        if pos == last:
            continue  # the same key at the same place: listed twice
        last = pos
        rec_end = entry.offset + HEADER_BYTES + entry.length
        if not (records and entry.segment_id == seg and end <= entry.offset <= end + gap
                and rec_end - start <= max_run_bytes):  # fmt: skip
            if records:
                runs.append(ReadRun(seg, start, end - start, tuple(records)))
            seg, start, records = entry.segment_id, entry.offset, []
        records.append((key, entry))
        end = rec_end
    if records:
        runs.append(ReadRun(seg, start, end - start, tuple(records)))
    return ReadPlan(tuple(runs))
