"""SSDStore: the log-structured SSD tier for full global-KV blocks (segments of records + an index).

Layout of ``ssd_dir``: ``LOCK`` (flock'd by the one store using the directory) and segment files
``000000000001.seg``, ``000000000002.seg``, ... (see ssd_segment.py; record format in ssd_record.py).
At start-up every segment is scanned (headers only) and the index rebuilt; new records always go to a
fresh segment. Records are written by ``put`` and made durable by ``flush`` (one fsync per dirty file:
callers batch, see SSDWriter); ``get``/``get_many`` verify checksums on every read.

Lifetime and capacity (``now`` from the injectable clock; age = now - created_at of the newest record)::

    young    age <  ssd_lifetime_s   never evicted, never dropped by compaction
    expired  age >= ssd_lifetime_s   still served while on disk; evicted only when a write needs room
    refresh  a hit with age >= ssd_refresh_age_s queues a re-append (done by maintain()), so a hot
             block's lifetime restarts before it can expire

Making room for a write of n bytes (``_make_room``), in order, until bytes + n <= ssd_budget_bytes:
  1. delete segments with no live record;
  2. delete segments whose live records are all expired, oldest first (by their newest record);
  3. compact segments whose young bytes are <= ``pressure_compact_ratio`` (0.9) of their size, emptiest
     first: copy the young records (byte-identical, same created_at) to the active segment, fsync,
     delete the source. The copies land first, so disk use may pass the budget by less than one
     segment for that moment.
If that is not enough, young records fill the budget (every segment is > 90 % young: compacting one
would cost more than 10x its yield in writes): the write is refused (PutResult.REFUSED, counted in
``admission_refusals``) and nothing raises; serving goes on and the block is a future miss.
``maintain()`` also garbage-collects superseded records without pressure: dead segments are deleted and
segments whose live bytes (young or not) are <= ``compact_live_ratio`` of their size are compacted.

Durability rules: a record is acknowledged by the flush() that follows it; a file is unlinked only after
every dirty segment was fsynced (so the record that superseded a deleted one is already on disk);
compaction fsyncs its copies before it deletes their source.

Locking (two locks, always taken in this order):
  ``_write_lock``  serialises every mutator: put, flush, maintain, close, check_integrity. Appends,
                   fsyncs, eviction and compaction run under it; it may be held across file I/O.
  ``_lock``        the metadata lock: index, segment table, byte counts, stats, pins. Held briefly and
                   never across file I/O. Readers take only this one: they look up and pin under it, read
                   and verify outside it, then unpin and count under it.
Readers (get/get_many, from a loader thread or a worker pool, never the engine thread) therefore never
wait for an fsync; writers go through SSDWriter, whose worker thread is the only caller of put/flush.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from threading import Lock

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.ssd_index import IndexEntry, SSDIndex
from flashtier.kvstore.ssd_record import HEADER_BYTES, RecordCorrupt, decode_header, decode_record, encode_record
from flashtier.kvstore.ssd_segment import Segment, SegmentScan, parse_segment_name, segment_name

Clock = Callable[[], float]
_MAX_READ_BYTES = 64 << 20  # cap on one coalesced read


class PutResult(Enum):
    """Outcome of one write; only STORED means the record is (or, after flush, will be) on disk."""

    STORED = "stored"
    REFUSED = "refused"  # admission control: the budget is full of records inside their lifetime
    FAILED = "failed"  # an I/O error (counted in write_errors)
    DROPPED = "dropped"  # SSDWriter only: its queue was over its byte bound

    @property
    def ok(self) -> bool:
        return self is PutResult.STORED


@dataclass(slots=True)
class SSDStats:
    """Counters (monotonic, never reset) and gauges (sampled by stats()) of one store."""

    # gauges
    bytes: int = 0  # segment file bytes on disk: live + dead records + torn tails
    live_bytes: int = 0  # bytes of records the index points at
    young_bytes: int = 0  # live bytes still inside their lifetime (what admission control cannot free)
    entries: int = 0  # keys in the index
    segments: int = 0
    oldest_entry_age_s: float = 0.0  # now - oldest created_at of a live record (0 when empty)
    # counters
    hits: int = 0  # keys served by get/get_many
    misses: int = 0  # keys not served (absent, corrupt or unreadable)
    puts: int = 0  # records stored by put (refreshes and compaction copies excluded)
    refreshes: int = 0  # hot records re-appended by maintain()
    admission_refusals: int = 0  # writes refused because the budget is full of young records
    expirations: int = 0  # live records dropped because they were past their lifetime
    corrupt_records: int = 0  # damaged headers found by scans + records failing checks on read
    torn_bytes: int = 0  # bytes of torn tails found at start-up (ignored)
    evicted_segments: int = 0  # segment files deleted (dead, expired or compacted)
    compactions: int = 0  # segments whose records were copied out
    compacted_bytes: int = 0  # bytes copied by compaction
    bytes_read: int = 0
    bytes_written: int = 0
    read_ops: int = 0  # pread calls for payloads (one per coalesced run)
    fsyncs: int = 0
    read_errors: int = 0
    write_errors: int = 0


@dataclass(slots=True)
class _ReadTally:
    """What one get_many saw, counted into the stats at its end."""

    served: dict[BlockHash, IndexEntry] = field(default_factory=dict)  # verified hits
    bad: list[tuple[BlockHash, IndexEntry]] = field(default_factory=list)  # records failing checks
    nbytes: int = 0
    nops: int = 0
    errors: int = 0


class SSDStore:
    """Segments + index for one ``ssd_dir``; thread-safe as described in the module docstring."""

    def __init__(self, config: KVStoreConfig, *, clock: Clock = time.time, compact_live_ratio: float = 0.5,
                 pressure_compact_ratio: float = 0.9, coalesce_gap_bytes: int = 0,
                 max_pending_refreshes: int = 4096, max_open_segments: int = 256) -> None:  # fmt: skip
        """Open (creating if needed) ``config.ssd_dir``, take its lock and rebuild the index by scanning.

        ValueError: the SSD tier is disabled (``ssd_dir`` None) or an argument is out of range.
        RuntimeError: another store holds the directory. OSError: the directory cannot be used.
        """
        if config.ssd_dir is None:
            raise ValueError("KVStoreConfig.ssd_dir is None: the SSD tier is disabled")
        ratios = {"compact_live_ratio": compact_live_ratio, "pressure_compact_ratio": pressure_compact_ratio}
        for name, ratio in ratios.items():
            if not 0.0 <= ratio < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {ratio!r}")
        if coalesce_gap_bytes < 0 or max_pending_refreshes < 0 or max_open_segments < 1:
            raise ValueError("coalesce_gap_bytes and max_pending_refreshes must be >= 0, max_open_segments >= 1")
        self.config = config
        self._clock = clock
        self._compact_ratio = compact_live_ratio
        self._pressure_ratio = pressure_compact_ratio
        self._gap = coalesce_gap_bytes
        self._max_refreshes = max_pending_refreshes
        self._max_open = max_open_segments
        self._open_lru: OrderedDict[int, Segment] = OrderedDict()  # sealed segments with an open fd
        self._write_lock, self._lock = Lock(), Lock()
        self._dir = Path(config.ssd_dir)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self._dir / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(f"{self._dir} is in use by another SSDStore (LOCK is held)") from None
        self._stats = SSDStats()
        self._segments: dict[int, Segment] = {}
        try:
            self._dir_fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            scans = [(seg_id, self._load_segment(name)) for name in sorted(os.listdir(self._dir))
                     if (seg_id := parse_segment_name(name)) is not None]  # fmt: skip
        except BaseException:
            for seg in self._segments.values():
                seg.close()
            os.close(self._lock_fd)  # releases the flock: a retry can open the directory
            raise
        self._index = SSDIndex.rebuild(scans)
        self._bytes = sum(seg.size for seg in self._segments.values())
        self._next_id = max(self._segments, default=0) + 1
        self._active: Segment | None = None
        self._dirty: set[Segment] = set()  # segments appended to since their last fsync
        self._dir_dirty = False
        self._refresh: dict[BlockHash, IndexEntry] = {}
        self._closed = False

    def _load_segment(self, name: str) -> SegmentScan:
        """Start-up: register segment file ``name``, scan its headers and fsync it (the previous process
        may have died before these pages reached the disk, and a later unlink of an older segment must
        not rely on records that are only in memory)."""
        seg = Segment.existing(self._dir / name)
        with self._lock:
            self._open_locked(seg)
        self._segments[seg.segment_id] = seg
        scan = seg.scan()
        seg.sync()
        self._stats.corrupt_records += scan.corrupt
        self._stats.torn_bytes += scan.torn_bytes
        return scan

    # ---- writes ------------------------------------------------------------------------------------
    def put(self, key: BlockHash, payload: bytes | bytearray | memoryview) -> PutResult:
        """Append a record for ``key`` (the newest record of a key wins); durable after the next flush().

        A key already on disk is appended again, which restarts its lifetime (blocks are
        content-addressed, so the bytes are the same); to only fill a miss, check ``key in store`` first.
        Takes the write lock; may evict expired segments or compact first (see ``_make_room``).
        Failure: REFUSED when the budget is full of young records, FAILED on an I/O error; never raises
        for those. ValueError for a bad key/payload or a record larger than one segment.
        """
        self.validate_record(key, payload)
        with self._write_lock:
            self._check_open()
            result = self._put_locked(key, payload, self._clock())
            if result.ok:
                with self._lock:
                    self._stats.puts += 1
            return result

    def validate_record(self, key: BlockHash, payload: object) -> None:
        """ValueError unless ``put(key, payload)`` would accept the arguments (no I/O, no lock)."""
        if not isinstance(key, BlockHash):
            raise ValueError(f"SSD keys are BlockHash, got {type(key).__name__}")
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise ValueError(f"an SSD payload must be bytes-like, got {type(payload).__name__}")
        size = HEADER_BYTES + memoryview(payload).nbytes
        if size > self.config.ssd_segment_bytes:
            raise ValueError(f"a record of {size} B does not fit a segment of {self.config.ssd_segment_bytes} B")

    def flush(self) -> bool:
        """fsync every segment written since the last flush (and the directory); returns when done.

        True when every fsync succeeded. On an fsync error the segment is sealed (no further appends),
        the error counted, and False returned: records since the last good flush may not be durable.
        """
        with self._write_lock:
            self._check_open()
            return self._flush_locked()

    def maintain(self) -> None:
        """Background upkeep, called by the writer between batches: queued refreshes, dead-segment
        deletion and compaction of segments whose live bytes are <= compact_live_ratio of their size.

        Takes the write lock. Never drops a young record; I/O errors are counted, not raised.
        """
        with self._write_lock:
            self._check_open()
            now = self._clock()
            self._drain_refreshes(now)
            for seg in self._sealed_segments():
                if seg.retired:
                    continue
                with self._lock:
                    count, live = self._index.live_count(seg.segment_id), self._index.live_bytes(seg.segment_id)
                if count == 0:
                    self._delete_segment(seg, now)
                elif live <= self._compact_ratio * seg.size and self._bytes + live <= self.config.ssd_budget_bytes:
                    self._compact(seg, now, young_only=False)

    # ---- reads -------------------------------------------------------------------------------------
    def get(self, key: BlockHash) -> bytes | None:
        """The verified payload of ``key``, or None (absent, or counted corrupt and dropped). See get_many."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        """Payloads for ``keys`` (None for a miss), reading adjacent records of a segment in one pread.

        Takes the metadata lock only briefly (file reads happen outside it, on pinned segments), a few
        segments at a time so at most ~max_open_segments descriptors are open; call it off the engine
        thread. A key whose segment was deleted meanwhile (compacted or evicted) is looked up again.
        Mutates: hit/miss/read counters; a record failing its checks is dropped from the index and
        counted in ``corrupt_records`` (a miss, never served); a hit older than the refresh age is
        queued for maintain() to re-append. ValueError for a key that is not a BlockHash.
        """
        for key in keys:
            if not isinstance(key, BlockHash):
                raise ValueError(f"SSD keys are BlockHash, got {type(key).__name__}")
        out: list[bytes | None] = [None] * len(keys)
        positions: dict[BlockHash, list[int]] = {}
        for i, key in enumerate(keys):
            positions.setdefault(key, []).append(i)
        tally = _ReadTally()
        todo = list(positions)
        for _ in range(3):  # a key moves at most once or twice while we read
            if not todo:
                break
            with self._lock:
                self._check_open()
                groups: dict[int, list[tuple[BlockHash, IndexEntry]]] = {}
                for key in todo:
                    entry = self._index.get(key)
                    if entry is not None:
                        groups.setdefault(entry.segment_id, []).append((key, entry))
            todo = []
            seg_ids = sorted(groups)
            step = max(1, self._max_open // 2)
            for chunk in (seg_ids[i : i + step] for i in range(0, len(seg_ids), step)):
                todo += self._read_chunk(chunk, groups, positions, out, tally)
        with self._lock:
            self._count_reads(len(keys), out, positions, tally)
        return out

    def _read_chunk(self, chunk: list[int], groups: dict[int, list[tuple[BlockHash, IndexEntry]]],
                    positions: dict[BlockHash, list[int]], out: list[bytes | None],
                    tally: _ReadTally) -> list[BlockHash]:  # fmt: skip
        """Pin, read and verify the records of the segments in ``chunk``; fills ``out`` and ``tally``.
        Returns the keys whose segment was retired before it could be pinned (to look up again)."""
        pinned, moved = [], []
        with self._lock:
            for seg_id in chunk:
                seg = self._segments.get(seg_id)
                if seg is None or seg.retired:
                    moved += [key for key, _ in groups[seg_id]]
                    continue
                try:
                    self._open_locked(seg)
                except OSError:
                    tally.errors += 1
                    continue
                seg.pin()
                pinned.append(seg)
        try:
            for seg in pinned:
                for run in self._runs(groups[seg.segment_id]):
                    start, end = run[0][1].offset, run[-1][1].end
                    try:
                        data = seg.read(start, end - start)
                    except OSError:
                        tally.errors += 1
                        continue
                    tally.nbytes, tally.nops = tally.nbytes + len(data), tally.nops + 1
                    for key, entry in run:
                        payload = _verified(data, entry.offset - start, key, entry)
                        if payload is None:
                            tally.bad.append((key, entry))
                        else:
                            tally.served[key] = entry
                        for i in positions[key]:
                            out[i] = payload
        finally:
            with self._lock:
                for seg in pinned:
                    seg.unpin()
                self._trim_open_locked()
        return moved

    async def get_many_async(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        """``get_many`` on the event loop's default worker pool (for asyncio callers)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.get_many, list(keys))

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def keys(self) -> list[BlockHash]:
        with self._lock:
            return self._index.keys()

    def entry(self, key: BlockHash) -> IndexEntry | None:
        """Where ``key``'s newest record is (segment id, offset, length, created_at); None if absent."""
        with self._lock:
            return self._index.get(key)

    def segment_path(self, segment_id: int) -> Path:
        """The file of ``segment_id`` (whether or not it exists)."""
        return self._dir / segment_name(segment_id)

    def stats(self) -> SSDStats:
        """A snapshot: counters plus gauges sampled now."""
        with self._lock:
            now = self._clock()
            oldest = self._index.oldest_created_at()
            segs = self._index.segment_ids()
            return dataclasses.replace(
                self._stats,
                bytes=self._bytes,
                live_bytes=sum(self._index.live_bytes(s) for s in segs),
                young_bytes=sum(self._index.young_bytes(s, now - self.config.ssd_lifetime_s) for s in segs),
                entries=len(self._index),
                segments=len(self._segments),
                oldest_entry_age_s=max(0.0, now - oldest) if oldest is not None else 0.0,
            )

    # ---- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Flush, close every file and release the directory lock. Idempotent."""
        with self._write_lock:
            if self._closed:
                return
            self._flush_locked()
            with self._lock:
                self._closed = True
                for seg in self._segments.values():
                    seg.close()
                self._open_lru.clear()
            os.close(self._dir_fd)
            os.close(self._lock_fd)  # releases the flock

    def __enter__(self) -> SSDStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- invariants --------------------------------------------------------------------------------
    def check_integrity(self, *, deep: bool = False) -> None:
        """RuntimeError unless the index, the segment table, the files and the stats agree.

        Checks: index invariants (no overlapping records, per-segment sums); every entry lies inside a
        known, unretired segment; byte totals equal the files' sizes on disk; one active segment at most.
        ``deep`` also reads every indexed header and checks key, length and created_at. Takes both locks.
        """
        with self._write_lock, self._lock:
            self._check_open()
            self._index.check_integrity()
            for seg_id in self._index.segment_ids():
                seg = self._segments.get(seg_id)
                if seg is None or seg.retired:
                    raise RuntimeError(f"index points into segment {seg_id}, which is {seg!r}")
                for key, entry in self._index.segment_entries(seg_id):
                    if entry.end > seg.size:
                        raise RuntimeError(f"{key!r} ends at {entry.end}, past the end of {seg!r}")
            total = 0
            for seg_id, seg in self._segments.items():
                if seg.segment_id != seg_id or seg.retired or seg_id >= self._next_id:
                    raise RuntimeError(f"segment table entry {seg_id} -> {seg!r} (next id {self._next_id})")
                disk = seg.path.stat().st_size if seg.path.exists() else None
                if disk != seg.size:
                    raise RuntimeError(f"{seg!r}: file has {disk} B")
                if seg.sealed != (seg.segment_id in self._open_lru) and seg.is_open:
                    raise RuntimeError(f"{seg!r}: open but {'not ' if seg.sealed else ''}in the descriptor LRU")
                if not seg.sealed and seg is not self._active:
                    raise RuntimeError(f"{seg!r} is unsealed but not the active segment")
                total += seg.size
            if total != self._bytes:
                raise RuntimeError(f"byte count {self._bytes} != sum of segment sizes {total}")
            if self._active is not None and self._segments.get(self._active.segment_id) is not self._active:
                raise RuntimeError(f"active {self._active!r} is not in the segment table")
            if not self._dirty <= set(self._segments.values()):
                raise RuntimeError("a dirty segment is not in the segment table")
            if any(not s.is_open or self._segments.get(i) is not s for i, s in self._open_lru.items()):
                raise RuntimeError("the descriptor LRU holds a closed or unknown segment")
            if deep:
                for key, entry in self._index.items():
                    seg = self._segments[entry.segment_id]
                    self._open_locked(seg)
                    _check_header(seg, key, entry)

    # ---- internals (write lock held unless noted) --------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SSDStore is closed")

    def _put_locked(self, key: BlockHash, payload: bytes | bytearray | memoryview, now: float) -> PutResult:
        raw = encode_record(key, payload, now)
        if not self._make_room(len(raw), now):
            with self._lock:
                self._stats.admission_refusals += 1
            return PutResult.REFUSED
        entry = self._append(raw, now, len(raw) - HEADER_BYTES)
        if entry is None:
            return PutResult.FAILED
        with self._lock:
            self._index.insert(key, entry)
        return PutResult.STORED

    def _append(self, raw: bytes, created_at: float, length: int) -> IndexEntry | None:
        """Append one encoded record to the active segment (rolling first if it would overflow)."""
        seg = self._active
        before = seg.size if seg is not None else 0
        try:
            if seg is not None and seg.size and seg.size + len(raw) > self.config.ssd_segment_bytes:
                self._seal_active()
                seg = None
            if seg is None:
                seg = Segment.create(self._dir, self._next_id)
                self._next_id += 1
                self._dir_dirty = True
                with self._lock:
                    self._segments[seg.segment_id] = seg
                self._active = seg
            before = seg.size
            self._dirty.add(seg)
            offset = seg.append(raw)
        except OSError:
            with self._lock:
                self._stats.write_errors += 1
                if seg is not None:
                    self._bytes += seg.size - before
            if seg is not None:
                self._seal_active()
            return None
        with self._lock:
            self._bytes += len(raw)
            self._stats.bytes_written += len(raw)
        return IndexEntry(seg.segment_id, offset, length, created_at)

    def _flush_locked(self) -> bool:
        """fsync the dirty segments, then the directory if a file was created or deleted; see flush()."""
        ok = True
        for seg in sorted(self._dirty, key=lambda s: s.segment_id):
            try:
                with self._pinned(seg):
                    seg.sync()
            except OSError:
                ok = False
                if seg is self._active:
                    self._seal_active()
                with self._lock:
                    self._stats.write_errors += 1
            self._dirty.discard(seg)
            with self._lock:
                self._stats.fsyncs += 1
        if self._dir_dirty:
            try:
                os.fsync(self._dir_fd)
                self._dir_dirty = False
            except OSError:
                ok = False
                with self._lock:
                    self._stats.write_errors += 1
        return ok

    def _seal_active(self) -> None:
        """Seal the active segment (no more appends); its open descriptor joins the LRU."""
        seg, self._active = self._active, None
        if seg is not None:
            seg.seal()
            with self._lock:
                self._open_lru[seg.segment_id] = seg
                self._trim_open_locked()

    def _open_locked(self, seg: Segment) -> None:
        """Metadata lock held: make ``seg`` readable (open it if needed, mark it recently used) and close
        the least recently used idle descriptors beyond ``max_open_segments``. OSError if it cannot open."""
        if not seg.sealed:
            return  # the active segment keeps its descriptor until it is sealed
        seg.open_fd()
        self._open_lru[seg.segment_id] = seg
        self._open_lru.move_to_end(seg.segment_id)
        self._trim_open_locked(keep=seg)

    def _trim_open_locked(self, keep: Segment | None = None) -> None:
        """Metadata lock held: close idle (unpinned) descriptors, least recently used first, down to the cap."""
        if len(self._open_lru) <= self._max_open:
            return
        for seg_id, seg in list(self._open_lru.items()):
            if len(self._open_lru) <= self._max_open:
                break
            if seg.pins == 0 and seg is not keep:
                seg.close_fd()
                del self._open_lru[seg_id]

    @contextmanager
    def _pinned(self, seg: Segment) -> Iterator[Segment]:
        """Open and pin ``seg`` for I/O outside the metadata lock. OSError if it cannot be opened."""
        with self._lock:
            self._open_locked(seg)
            seg.pin()
        try:
            yield seg
        finally:
            with self._lock:
                seg.unpin()
                self._trim_open_locked()

    def _sealed_segments(self) -> list[Segment]:
        return [s for _, s in sorted(self._segments.items()) if s.sealed]

    def _young(self, seg: Segment, cutoff: float) -> int:
        with self._lock:
            return self._index.young_bytes(seg.segment_id, cutoff)

    def _make_room(self, need: int, now: float) -> bool:
        """Free disk until ``need`` more bytes fit the budget (steps in the module docstring)."""
        budget = self.config.ssd_budget_bytes
        if self._bytes + need <= budget:
            return True
        cutoff = now - self.config.ssd_lifetime_s
        with self._lock:  # readers may drop corrupt entries: index reads need the metadata lock
            dead = [s for s in self._sealed_segments() if self._index.live_count(s.segment_id) == 0]
        for seg in dead:  # 1. nothing live
            if self._delete_segment(seg, now) and self._bytes + need <= budget:
                return True
        with self._lock:
            segs = [s for s in self._segments.values() if s.size]
            expired = [s for s in segs if self._index.young_bytes(s.segment_id, cutoff) == 0]
            expired.sort(key=lambda s: (_or_inf(self._index.newest_created_at(s.segment_id)), s.segment_id))
        for seg in expired:  # 2. every live record past its lifetime, oldest first
            if self._delete_segment(seg, now) and self._bytes + need <= budget:
                return True
        with self._lock:
            ranked = sorted(segs, key=lambda s: (self._index.young_bytes(s.segment_id, cutoff) / s.size, s.segment_id))
        for seg in ranked:  # 3. compaction of mostly dead/expired segments, emptiest first
            young = self._young(seg, cutoff)
            # the copies land before the source is deleted: disk use may pass the budget by < 1 segment
            if seg.retired or young > self._pressure_ratio * seg.size:
                continue
            self._compact(seg, now, young_only=True)
            if self._bytes + need <= budget:
                return True
        return self._bytes + need <= budget

    def _compact(self, seg: Segment, now: float, *, young_only: bool) -> bool:
        """Copy ``seg``'s live records (only the young ones if ``young_only``) to the active segment,
        fsync them, then delete ``seg``. Returns whether ``seg`` was deleted; on an I/O error it stays."""
        if seg is self._active:
            self._seal_active()
        cutoff = now - self.config.ssd_lifetime_s
        with self._lock:
            entries = [(k, e) for k, e in self._index.segment_entries(seg.segment_id)
                       if not young_only or e.created_at > cutoff]  # fmt: skip
        copied = 0
        for run in self._runs(entries):
            start, end = run[0][1].offset, run[-1][1].end
            try:
                with self._pinned(seg):
                    data = seg.read(start, end - start)
            except OSError:
                with self._lock:
                    self._stats.read_errors += 1
                return False
            with self._lock:
                self._stats.bytes_read += len(data)
                self._stats.read_ops += 1
            for key, entry in run:
                rel = entry.offset - start
                if _verified(data, rel, key, entry) is None:
                    with self._lock:
                        if self._index.remove(key, entry) is not None:
                            self._stats.corrupt_records += 1
                    continue
                new = self._append(data[rel : rel + entry.record_bytes], entry.created_at, entry.length)
                if new is None:
                    return False
                copied += entry.record_bytes
                with self._lock:
                    self._index.insert(key, new)
        with self._lock:
            self._stats.compactions += 1
            self._stats.compacted_bytes += copied
        return self._delete_segment(seg, now)

    def _delete_segment(self, seg: Segment, now: float) -> bool:
        """Unlink ``seg`` and drop its remaining live entries (all must be expired: counted as expirations).

        Refuses (False) while a young record is still in it or when the preceding fsync fails.
        """
        if self._young(seg, now - self.config.ssd_lifetime_s) > 0:
            return False
        if not self._flush_locked():
            return False
        if seg is self._active:
            self._active = None
        with self._lock:
            dropped = self._index.drop_segment(seg.segment_id)
            self._stats.expirations += len(dropped)
            self._stats.evicted_segments += 1
            del self._segments[seg.segment_id]
            self._bytes -= seg.size
            self._dirty.discard(seg)
            self._open_lru.pop(seg.segment_id, None)
            seg.retire()
        self._dir_dirty = True
        return True

    def _drain_refreshes(self, now: float) -> None:
        with self._lock:
            pending, self._refresh = self._refresh, {}
        for key, entry in pending.items():
            with self._lock:
                if self._index.get(key) != entry or now - entry.created_at < self.config.ssd_refresh_age_s:
                    continue
            seg = self._segments[entry.segment_id]
            try:
                with self._pinned(seg):
                    data = seg.read(entry.offset, entry.record_bytes)
            except OSError:
                with self._lock:
                    self._stats.read_errors += 1
                continue
            payload = _verified(data, 0, key, entry)
            if payload is None:
                with self._lock:
                    if self._index.remove(key, entry) is not None:
                        self._stats.corrupt_records += 1
                continue
            if self._put_locked(key, payload, now).ok:
                with self._lock:
                    self._stats.refreshes += 1

    def _runs(self, entries: list[tuple[BlockHash, IndexEntry]]) -> Iterator[list[tuple[BlockHash, IndexEntry]]]:
        """Group entries of one segment into runs read by one pread: sorted by offset, each starting at
        most ``coalesce_gap_bytes`` after the previous one's end, each run at most _MAX_READ_BYTES."""
        run: list[tuple[BlockHash, IndexEntry]] = []
        for key, entry in sorted(entries, key=lambda kv: kv[1].offset):
            if run and (entry.offset - run[-1][1].end > self._gap or entry.end - run[0][1].offset > _MAX_READ_BYTES):
                yield run
                run = []
            run.append((key, entry))
        if run:
            yield run

    def _count_reads(self, n: int, out: list[bytes | None], positions: dict[BlockHash, list[int]],
                     tally: _ReadTally) -> None:  # fmt: skip
        """Metadata lock held: counters, corrupt-entry removal and refresh queueing after a read."""
        st = self._stats
        hits = sum(p is not None for p in out)
        st.hits, st.misses = st.hits + hits, st.misses + n - hits
        st.bytes_read, st.read_ops = st.bytes_read + tally.nbytes, st.read_ops + tally.nops
        st.read_errors += tally.errors
        for key, entry in tally.bad:
            if self._index.remove(key, entry) is not None:
                st.corrupt_records += 1
        now = self._clock()
        for key, entry in tally.served.items():
            if now - entry.created_at >= self.config.ssd_refresh_age_s and len(self._refresh) < self._max_refreshes:
                self._refresh[key] = entry

def _or_inf(t: float | None) -> float:
    return -float("inf") if t is None else t


def _verified(data: bytes, rel: int, key: BlockHash, entry: IndexEntry) -> bytes | None:
    """The payload of the record at ``data[rel:]`` if it is intact and is the one ``entry`` describes."""
    try:
        payload = decode_record(memoryview(data)[rel : rel + entry.record_bytes], key)
    except RecordCorrupt:
        return None
    return payload if len(payload) == entry.length else None


def _check_header(seg: Segment, key: BlockHash, entry: IndexEntry) -> None:
    """RuntimeError unless the header at ``entry`` is intact and describes ``key``/``entry``."""
    try:
        header = decode_header(seg.read(entry.offset, HEADER_BYTES))
    except RecordCorrupt as exc:
        raise RuntimeError(f"{key!r} at {entry}: {exc}") from None
    if (header.key, header.length, header.created_at) != (key, entry.length, entry.created_at):
        raise RuntimeError(f"{key!r} at {entry}: header says {header}")
