"""SSDIndex: the in-memory map key -> newest record on disk, plus what each segment still holds live.

A record is *live* when the index points at it and *dead* when a newer record of its key superseded it
(or its bytes were found damaged). "Newest" is decided by ``IndexEntry.recency`` = (created_at, segment
id, offset): the latest write wins, and among equal times the later position (a compaction copy keeps
its original ``created_at`` and lands later). The same rule is used at run time and by ``rebuild``, so
the index after a restart is the one the running store had (minus what never reached the disk).

Per segment it keeps the live entries, their bytes and the oldest/newest ``created_at`` (cached, and
recomputed lazily after a removal), which is what eviction and compaction choose by.

Not thread-safe: the store guards it with its metadata lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.ssd.record import HEADER_BYTES
from flashtier.kvstore.ssd.segment import SegmentScan


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """Where one key's newest record lives."""

    segment_id: int
    offset: int  # of the header, in the segment file
    length: int  # payload bytes
    created_at: float  # seconds on the store clock (from the header)

    @property
    def record_bytes(self) -> int:
        return HEADER_BYTES + self.length

    @property
    def end(self) -> int:
        return self.offset + self.record_bytes

    @property
    def recency(self) -> tuple[float, int, int]:
        return (self.created_at, self.segment_id, self.offset)


@dataclass(slots=True)
class _SegmentLive:
    entries: dict[BlockHash, IndexEntry] = field(default_factory=dict)
    bytes: int = 0
    oldest: float | None = None  # cached min created_at of entries; None = recompute
    newest: float | None = None  # cached max created_at of entries; None = recompute


class SSDIndex:
    """key -> IndexEntry (newest record wins) and segment id -> its live entries."""

    def __init__(self) -> None:
        self._map: dict[BlockHash, IndexEntry] = {}
        self._segments: dict[int, _SegmentLive] = {}

    @classmethod
    def rebuild(cls, scans: Iterable[tuple[int, SegmentScan]]) -> SSDIndex:
        """The index of every valid header in ``scans`` ((segment id, scan) pairs, any order)."""
        index = cls()
        for segment_id, scan in scans:
            for offset, header in scan.records:
                index.insert(header.key, IndexEntry(segment_id, offset, header.length, header.created_at))
        return index

    # ---- lookups -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def get(self, key: BlockHash) -> IndexEntry | None:
        return self._map.get(key)

    def keys(self) -> list[BlockHash]:
        return list(self._map)

    def items(self) -> Iterator[tuple[BlockHash, IndexEntry]]:
        return iter(self._map.items())

    def segment_ids(self) -> list[int]:
        """Segments holding at least one live entry."""
        return [s for s, live in self._segments.items() if live.entries]

    def segment_entries(self, segment_id: int) -> list[tuple[BlockHash, IndexEntry]]:
        """A copy of the live (key, entry) pairs in ``segment_id``, by offset."""
        live = self._segments.get(segment_id)
        return sorted(live.entries.items(), key=lambda kv: kv[1].offset) if live else []

    def live_bytes(self, segment_id: int) -> int:
        live = self._segments.get(segment_id)
        return live.bytes if live else 0

    def live_count(self, segment_id: int) -> int:
        live = self._segments.get(segment_id)
        return len(live.entries) if live else 0

    def young_bytes(self, segment_id: int, cutoff: float) -> int:
        """Live bytes in ``segment_id`` whose ``created_at > cutoff`` (cutoff = now - lifetime)."""
        live = self._segments.get(segment_id)
        if not live or not live.entries:
            return 0
        if self._oldest(live) > cutoff:
            return live.bytes
        if self._newest(live) <= cutoff:
            return 0
        return sum(e.record_bytes for e in live.entries.values() if e.created_at > cutoff)

    def newest_created_at(self, segment_id: int) -> float | None:
        live = self._segments.get(segment_id)
        return self._newest(live) if live and live.entries else None

    def oldest_created_at(self) -> float | None:
        """Smallest ``created_at`` of any live entry; None when empty."""
        return min((self._oldest(live) for live in self._segments.values() if live.entries), default=None)

    # ---- mutation ----------------------------------------------------------------------------------
    def insert(self, key: BlockHash, entry: IndexEntry) -> tuple[bool, IndexEntry | None]:
        """Point ``key`` at ``entry`` unless the key already has a newer record.

        Returns (installed, displaced): ``displaced`` is the entry that stopped being live (the old one
        when installed, ``entry`` itself when not), or None for a new key.
        """
        old = self._map.get(key)
        if old is not None and old.recency >= entry.recency:
            return False, entry
        if old is not None:
            self._unlink(key, old)
        self._map[key] = entry
        live = self._segments.setdefault(entry.segment_id, _SegmentLive())
        live.entries[key] = entry
        live.bytes += entry.record_bytes
        if live.oldest is not None and len(live.entries) > 1:
            live.oldest = min(live.oldest, entry.created_at)
        if live.newest is not None and len(live.entries) > 1:
            live.newest = max(live.newest, entry.created_at)
        if len(live.entries) == 1:
            live.oldest = live.newest = entry.created_at
        return True, old

    def remove(self, key: BlockHash, expected: IndexEntry | None = None) -> IndexEntry | None:
        """Drop ``key`` (only if it still points at ``expected``, when given); returns the dropped entry."""
        entry = self._map.get(key)
        if entry is None or (expected is not None and entry != expected):
            return None
        del self._map[key]
        self._unlink(key, entry)
        return entry

    def drop_segment(self, segment_id: int) -> list[tuple[BlockHash, IndexEntry]]:
        """Remove every live entry in ``segment_id`` (its file is going away); returns them."""
        live = self._segments.pop(segment_id, None)
        if live is None:
            return []
        for key in live.entries:
            del self._map[key]
        return list(live.entries.items())

    def _unlink(self, key: BlockHash, entry: IndexEntry) -> None:
        live = self._segments[entry.segment_id]
        del live.entries[key]
        live.bytes -= entry.record_bytes
        if not live.entries:
            del self._segments[entry.segment_id]
            return
        if live.oldest == entry.created_at:
            live.oldest = None
        if live.newest == entry.created_at:
            live.newest = None

    @staticmethod
    def _oldest(live: _SegmentLive) -> float:
        if live.oldest is None:
            live.oldest = min(e.created_at for e in live.entries.values())
        return live.oldest

    @staticmethod
    def _newest(live: _SegmentLive) -> float:
        if live.newest is None:
            live.newest = max(e.created_at for e in live.entries.values())
        return live.newest

    # ---- invariants --------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """RuntimeError unless the key map and the per-segment sets agree and records do not overlap."""
        seen = 0
        for segment_id, live in self._segments.items():
            if not live.entries:
                raise RuntimeError(f"segment {segment_id} is tracked with no live entries")
            total, prev_end = 0, 0
            for key, entry in sorted(live.entries.items(), key=lambda kv: kv[1].offset):
                if self._map.get(key) is not entry or entry.segment_id != segment_id:
                    raise RuntimeError(f"segment {segment_id} lists {key!r} -> {entry}; map: {self._map.get(key)}")
                if entry.offset < prev_end:
                    raise RuntimeError(f"segment {segment_id}: record at {entry.offset} overlaps one ending {prev_end}")
                prev_end, total = entry.end, total + entry.record_bytes
            if total != live.bytes:
                raise RuntimeError(f"segment {segment_id}: live bytes {live.bytes} != sum of its records {total}")
            for cached, real in ((live.oldest, min(e.created_at for e in live.entries.values())),
                                 (live.newest, max(e.created_at for e in live.entries.values()))):  # fmt: skip
                if cached is not None and cached != real:
                    raise RuntimeError(f"segment {segment_id}: cached created_at bound {cached} != {real}")
            seen += len(live.entries)
        if seen != len(self._map):
            raise RuntimeError(f"{len(self._map)} keys in the map but {seen} in the segment sets")
