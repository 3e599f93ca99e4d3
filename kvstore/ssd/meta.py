"""SSDMeta: the metadata of one SSDStore, shared by its parts and guarded by the metadata lock.

The store is split by job (SegmentLog writes and deletes files, SSDReader serves reads, Compactor makes
room, RefreshQueue re-appends hot records); they all see the same index, segment table, byte count,
descriptor cache and stats through one SSDMeta. Who may touch what::

    lock       the metadata lock: held briefly, never across file I/O (see ssd/store.py for the order)
    index      read and written under ``lock`` (readers drop corrupt entries, writers insert)
    segments   written only by the writer side (write lock + ``lock``); readers look up under ``lock``;
               a writer holding the write lock may read it without ``lock``
    bytes      the same rule as ``segments``
    stats      counters: written under ``lock`` by everyone
    health     fault states (ssd/health.py): its ``*_locked`` methods need ``lock``; they count into ``stats``
    fds        the descriptor cache (its ``*_locked`` methods need ``lock``)
    closed     set by close() under both locks; readers check it under ``lock``
"""

from __future__ import annotations

from dataclasses import dataclass, field
from threading import Lock

from flashtier.kvstore.ssd.fd_cache import DescriptorCache
from flashtier.kvstore.ssd.health import SSDHealth
from flashtier.kvstore.ssd.index import SSDIndex
from flashtier.kvstore.ssd.segment import Segment
from flashtier.kvstore.ssd.stats import SSDStats


@dataclass(slots=True, eq=False)
class SSDMeta:
    """Index, segment table (id -> Segment, ascending ids), disk bytes, descriptors, stats, fault states,
    closed flag. ``directory`` only names the store in log lines."""

    lock: Lock
    fds: DescriptorCache
    directory: str = ""
    index: SSDIndex = field(default_factory=SSDIndex)
    segments: dict[int, Segment] = field(default_factory=dict)
    bytes: int = 0  # sum of the segments' sizes (check_integrity compares it with the files)
    stats: SSDStats = field(default_factory=SSDStats)
    closed: bool = False
    health: SSDHealth = field(init=False)

    def __post_init__(self) -> None:
        self.health = SSDHealth(self.stats, self.directory)

    def check_open(self) -> None:
        """RuntimeError once the store is closed."""
        if self.closed:
            raise RuntimeError("SSDStore is closed")

    def sealed_segments(self) -> list[Segment]:
        """Sealed segments by id (the active one excluded). Metadata lock or write lock held."""
        return [s for _, s in sorted(self.segments.items()) if s.sealed]

    def young(self, seg: Segment, cutoff: float) -> int:
        """Live bytes of ``seg`` created after ``cutoff`` (now - lifetime). Takes the metadata lock."""
        with self.lock:
            return self.index.young_bytes(seg.segment_id, cutoff)
