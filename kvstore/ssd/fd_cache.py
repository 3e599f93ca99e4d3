"""DescriptorCache: which sealed segments of an SSDStore hold an open file descriptor (an LRU).

A full 512 GiB tier has ~2,048 segments; keeping a descriptor per segment would run into the process
limit, so sealed segments open lazily and the least recently used idle ones are closed beyond a cap.
A segment's descriptor moves through::

    closed ──open_locked()──▶ open, in the LRU ──trim_locked() (over the cap, unpinned)──▶ closed
                                 │       ▲ open_locked() again: most recently used
                                 └──forget_locked() (segment deleted: Segment.retire closes it)──▶ gone
    active segment: open from create(), outside the LRU ──add_sealed_locked() when sealed──▶ in the LRU

Pinned segments are never closed (a reader outside the metadata lock is using the descriptor), so the
cap can be exceeded while many reads are in flight; the next unpin trims back down.

Not thread-safe by itself: every ``*_locked`` method needs the store's metadata lock, which the cache
shares (``pinned`` takes it). It never does file I/O other than open/close.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from threading import Lock

from flashtier.kvstore.ssd.segment import Segment


class DescriptorCache:
    """The LRU of sealed segments with an open descriptor, capped at ``max_open`` idle ones."""

    def __init__(self, lock: Lock, max_open: int) -> None:
        """``lock`` is the store's metadata lock. ValueError for ``max_open < 1``."""
        if max_open < 1:
            raise ValueError(f"max_open must be >= 1, got {max_open}")
        self._lock = lock
        self.max_open = max_open
        self._lru: OrderedDict[int, Segment] = OrderedDict()  # sealed segments with an open fd

    def __contains__(self, segment_id: object) -> bool:
        return segment_id in self._lru

    def open_locked(self, seg: Segment) -> None:
        """Make ``seg`` readable: open it if needed, mark it recently used, trim others to the cap.

        Mutates: the LRU; may close idle descriptors of other segments.
        Failure: OSError if the file cannot be opened (nothing changed). Metadata lock held.
        """
        if not seg.sealed:
            return  # the active segment keeps its descriptor until it is sealed
        seg.open_fd()
        self._lru[seg.segment_id] = seg
        self._lru.move_to_end(seg.segment_id)
        self.trim_locked(keep=seg)

    def trim_locked(self, keep: Segment | None = None) -> None:
        """Close idle (unpinned) descriptors, least recently used first, down to the cap; ``keep`` stays.

        Mutates: the LRU and the closed segments' descriptors. Metadata lock held.
        """
        if len(self._lru) <= self.max_open:
            return
        for seg_id, seg in list(self._lru.items()):
            if len(self._lru) <= self.max_open:
                break
            if seg.pins == 0 and seg is not keep:
                seg.close_fd()
                del self._lru[seg_id]

    def add_sealed_locked(self, seg: Segment) -> None:
        """The active segment ``seg`` was just sealed: its open descriptor joins the LRU (then trim)."""
        self._lru[seg.segment_id] = seg
        self.trim_locked()

    def forget_locked(self, segment_id: int) -> None:
        """Drop a deleted segment (its ``retire`` closes the descriptor once unpinned). Metadata lock held."""
        self._lru.pop(segment_id, None)

    def clear_locked(self) -> None:
        """Store shutdown: forget every entry (the caller closed the segments). Metadata lock held."""
        self._lru.clear()

    @contextmanager
    def pinned(self, seg: Segment) -> Iterator[Segment]:
        """Open and pin ``seg`` for I/O outside the metadata lock (taken here, briefly, on both ends).

        Failure: OSError if it cannot be opened (then it is not pinned). Call without the metadata lock.
        """
        with self._lock:
            self.open_locked(seg)
            seg.pin()
        try:
            yield seg
        finally:
            with self._lock:
                seg.unpin()
                self.trim_locked()

    def check_segment(self, seg: Segment) -> None:
        """RuntimeError unless ``seg`` being open matches its LRU membership (sealed ⇔ listed)."""
        if seg.sealed != (seg.segment_id in self._lru) and seg.is_open:
            raise RuntimeError(f"{seg!r}: open but {'not ' if seg.sealed else ''}in the descriptor LRU")

    def check_integrity(self, segments: dict[int, Segment]) -> None:
        """RuntimeError unless every LRU entry is open and is the segment ``segments`` holds for its id."""
        if any(not s.is_open or segments.get(i) is not s for i, s in self._lru.items()):
            raise RuntimeError("the descriptor LRU holds a closed or unknown segment")
