"""SegmentLog: the writer's side of an SSDStore's segment files: append, roll, fsync, delete.

Records are appended to one active segment; when the next record would overflow it, the segment is
sealed and a fresh one (the next id) becomes active::

    no active ──append()──▶ active ──would overflow / I/O error──▶ sealed ──delete()──▶ unlinked
                              │ (Segment.create, directory dirty)      ▲
                              └────────── delete() of the active one ──┘ (no active until the next append)

Durability rules (why ``delete`` flushes first):
  - a record is acknowledged by the flush() that follows it (SSDWriter batches puts, one fsync each);
  - a file is unlinked only after every dirty segment was fsynced, so the record that superseded one in
    the deleted file is already on disk;
  - creating or unlinking a file dirties the directory, fsynced by the next flush().

Every method needs the store's write lock (one writer at a time: the log's own fields are guarded by
it); the shared metadata in ``SSDMeta`` is updated under the metadata lock, never held across I/O.
"""

from __future__ import annotations

import os
from pathlib import Path

from flashtier.kvstore.ssd.health import write_cause
from flashtier.kvstore.ssd.index import IndexEntry
from flashtier.kvstore.ssd.meta import SSDMeta
from flashtier.kvstore.ssd.segment import Segment


class SegmentLog:
    """The active segment, the dirty set and the file-level writes of one ``ssd_dir``."""

    def __init__(self, meta: SSDMeta, directory: Path, dir_fd: int, *, segment_bytes: int,
                 lifetime_s: float) -> None:  # fmt: skip
        """A log over the segments already in ``meta`` (loaded at start-up: all sealed); new segments
        get ids above the highest one. ``dir_fd`` is the open directory (for fsync); the store owns it."""
        self._meta = meta
        self._dir = directory
        self._dir_fd = dir_fd
        self._segment_bytes = segment_bytes
        self._lifetime_s = lifetime_s
        self.next_id = max(meta.segments, default=0) + 1
        self.active: Segment | None = None
        self._dirty: set[Segment] = set()  # segments appended to since their last fsync
        self._dir_dirty = False
        self._failed = False  # an append failed since the last flush (that cycle cannot end a fault)

    def append(self, raw: bytes, created_at: float, length: int) -> IndexEntry | None:
        """Append one encoded record to the active segment (rolling first if it would overflow).

        Mutates: the active segment (maybe a new one in the table), ``meta.bytes``, ``bytes_written``.
        Failure: None on an I/O error, counted by cause and logged on a state change (``SSDHealth``); the
        segment is sealed (its tail may hold part of the record, a torn tail to the next scan) unless the
        disk was full and nothing was written; the byte count follows the file.
        """
        meta = self._meta
        seg = self.active
        before = seg.size if seg is not None else 0
        op = "append"
        try:
            if seg is not None and seg.size and seg.size + len(raw) > self._segment_bytes:
                self.seal_active()
                seg = None
            if seg is None:
                op = "create"
                seg = Segment.create(self._dir, self.next_id)
                self.next_id += 1
                self._dir_dirty = True
                with meta.lock:
                    meta.segments[seg.segment_id] = seg
                self.active = seg
                op = "append"
            before = seg.size
            self._dirty.add(seg)
            offset = seg.append(raw)
        except OSError as exc:
            self._failed = True
            with meta.lock:
                meta.health.write_failed_locked(exc, op)
                if seg is not None:
                    meta.bytes += seg.size - before
            if seg is not None and (seg.size != before or write_cause(exc) != "disk_full"):
                self.seal_active()  # a clean ENOSPC (nothing written) keeps it: no empty segment per failure
            return None
        with meta.lock:
            meta.bytes += len(raw)
            meta.stats.bytes_written += len(raw)
        return IndexEntry(seg.segment_id, offset, length, created_at)

    def flush(self) -> bool:
        """fsync the dirty segments, then the directory if a file was created or deleted.

        Mutates: clears the dirty set (a failed segment too: it is sealed, never appended to again).
        A flush cycle (the appends since the previous flush, then this one) that fsynced a segment and
        saw no error ends a write fault (``SSDHealth.write_ok_locked`` logs the recovery).
        Failure: False after any fsync error (counted by cause, logged on a state change): records since
        the last good flush may not be durable.
        """
        meta = self._meta
        ok, synced = True, False
        for seg in sorted(self._dirty, key=lambda s: s.segment_id):
            try:
                with meta.fds.pinned(seg):
                    seg.sync()
                synced = True
            except OSError as exc:
                ok = False
                if seg is self.active:
                    self.seal_active()
                with meta.lock:
                    meta.health.write_failed_locked(exc, "fsync")
            self._dirty.discard(seg)
            with meta.lock:
                meta.stats.fsyncs += 1
        if self._dir_dirty:
            try:
                os.fsync(self._dir_fd)
                self._dir_dirty = False
            except OSError as exc:
                ok = False
                with meta.lock:
                    meta.health.write_failed_locked(exc, "fsync of the directory")
        if ok and synced and not self._failed:
            with meta.lock:
                meta.health.write_ok_locked()
        self._failed = False
        return ok

    def seal_active(self) -> None:
        """Seal the active segment (no more appends); its open descriptor joins the LRU."""
        seg, self.active = self.active, None
        if seg is not None:
            seg.seal()
            with self._meta.lock:
                self._meta.fds.add_sealed_locked(seg)

    def delete(self, seg: Segment, now: float) -> bool:
        """Unlink ``seg`` and drop its remaining live entries (all must be expired: counted as expirations).

        Mutates: index, segment table, byte count, ``expirations``/``evicted_segments``; dirties the
        directory. Failure: False, nothing deleted, while a young record is still in ``seg`` or when the
        preceding fsync fails.
        """
        meta = self._meta
        if meta.young(seg, now - self._lifetime_s) > 0:
            return False
        if not self.flush():
            return False
        if seg is self.active:
            self.active = None
        with meta.lock:
            dropped = meta.index.drop_segment(seg.segment_id)
            meta.stats.expirations += len(dropped)
            meta.stats.evicted_segments += 1
            del meta.segments[seg.segment_id]
            meta.bytes -= seg.size
            self._dirty.discard(seg)
            meta.fds.forget_locked(seg.segment_id)
            seg.retire()
        self._dir_dirty = True
        return True

    def check_integrity(self) -> None:
        """RuntimeError unless the segment table, the files' sizes, the byte count, the active segment and
        the dirty set agree (and each descriptor matches the LRU). Both store locks held."""
        meta = self._meta
        total = 0
        for seg_id, seg in meta.segments.items():
            if seg.segment_id != seg_id or seg.retired or seg_id >= self.next_id:
                raise RuntimeError(f"segment table entry {seg_id} -> {seg!r} (next id {self.next_id})")
            disk = seg.path.stat().st_size if seg.path.exists() else None
            if disk != seg.size:
                raise RuntimeError(f"{seg!r}: file has {disk} B")
            meta.fds.check_segment(seg)
            if not seg.sealed and seg is not self.active:
                raise RuntimeError(f"{seg!r} is unsealed but not the active segment")
            total += seg.size
        if total != meta.bytes:
            raise RuntimeError(f"byte count {meta.bytes} != sum of segment sizes {total}")
        if self.active is not None and meta.segments.get(self.active.segment_id) is not self.active:
            raise RuntimeError(f"active {self.active!r} is not in the segment table")
        if not self._dirty <= set(meta.segments.values()):
            raise RuntimeError("a dirty segment is not in the segment table")
        meta.fds.check_integrity(meta.segments)
