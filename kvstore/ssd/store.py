"""SSDStore: the log-structured SSD tier for full global-KV blocks (segments of records + an index).

Layout of ``ssd_dir``: ``LOCK`` (flock'd by the one store using the directory) and segment files
``000000000001.seg``, ``000000000002.seg``, ... (see ssd/segment.py; record format in ssd/record.py).
At start-up every segment is scanned (headers only) and the index rebuilt; new records always go to a
fresh segment. Records are written by ``put`` and made durable by ``flush`` (one fsync per dirty file:
callers batch, see SSDWriter); ``get``/``get_many`` verify checksums on every read.

Lifetime and capacity (``now`` from the injectable clock; age = now - created_at of the newest record)::

    young    age <  ssd_lifetime_s   never evicted, never dropped by compaction
    expired  age >= ssd_lifetime_s   still served while on disk; evicted only when a write needs room
    refresh  a hit with age >= ssd_refresh_age_s queues a re-append (done by maintain()), so a hot
             block's lifetime restarts before it can expire

The store is a facade over its parts, which share one SSDMeta (index, segment table, stats)::

    put ──▶ Compactor.make_room (plan_room: delete dead, delete expired, compact) ──▶ SegmentLog.append
    flush ──▶ SegmentLog.flush          get/get_many ──▶ SSDReader (descriptors: DescriptorCache)
    maintain ──▶ RefreshQueue.drain (re-append hot records) ──▶ Compactor.collect (garbage)

A write that cannot fit because young records fill the budget is refused (PutResult.REFUSED, counted in
``admission_refusals``) and nothing raises; serving goes on and the block is a future miss. Write and
read I/O errors are misses too, counted by cause in SSDStats; every fault state change (disk full,
unwritable, I/O error, refusing, recovered) is one WARNING (ssd/health.py). Start-up logs one INFO scan
summary. Files are private: the directory is created 0700, LOCK and segments 0600, whatever the umask.
Durability rules are in ssd/log.py, compaction in ssd/compaction.py.

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
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from threading import Lock

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.ssd.compaction import Compactor
from flashtier.kvstore.ssd.fd_cache import DescriptorCache
from flashtier.kvstore.ssd.index import IndexEntry, SSDIndex
from flashtier.kvstore.ssd.log import SegmentLog
from flashtier.kvstore.ssd.meta import SSDMeta
from flashtier.kvstore.ssd.put_result import PutResult
from flashtier.kvstore.ssd.reader import SSDReader
from flashtier.kvstore.ssd.record import HEADER_BYTES, encode_record
from flashtier.kvstore.ssd.record_io import check_header
from flashtier.kvstore.ssd.refresh import RefreshQueue
from flashtier.kvstore.ssd.segment import (
    DIR_MODE,
    FILE_MODE,
    Segment,
    SegmentScan,
    parse_segment_name,
    segment_name,
)
from flashtier.kvstore.ssd.stats import SSDStats
from flashtier.kvstore.ssd.tenant_delete import TenantDeletion, delete_tenant
from flashtier.kvstore.tenant import DEFAULT_TENANT_TAG

__all__ = ["Clock", "PutResult", "SSDStats", "SSDStore", "TenantDeletion"]

Clock = Callable[[], float]
log = logging.getLogger("flashtier.kvstore.ssd")


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) with the leaf at mode 0700 whatever the umask. An existing
    directory keeps its mode (the operator chose it), with a WARNING if group or others may read it.
    OSError if it cannot be created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            log.warning("SSD tier %s: directory mode is %o; KV blocks hold prompt content, consider 0700",
                        path, mode)  # fmt: skip
        return
    os.chmod(path, DIR_MODE)  # mkdir's mode is filtered by the umask


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
        self._write_lock, self._lock = Lock(), Lock()
        self._dir = Path(config.ssd_dir)
        self._meta = meta = SSDMeta(self._lock, DescriptorCache(self._lock, max_open_segments), str(self._dir))
        started = time.monotonic()
        make_private_dir(self._dir)
        self._lock_fd = os.open(self._dir / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            os.fchmod(self._lock_fd, FILE_MODE)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(f"{self._dir} is in use by another SSDStore (LOCK is held)") from None
        except BaseException:
            os.close(self._lock_fd)
            raise
        try:
            self._dir_fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            scans = [(seg_id, self._load_segment(name)) for name in sorted(os.listdir(self._dir))
                     if (seg_id := parse_segment_name(name)) is not None]  # fmt: skip
        except BaseException:
            for seg in meta.segments.values():
                seg.close()
            os.close(self._lock_fd)  # releases the flock: a retry can open the directory
            raise
        meta.index = SSDIndex.rebuild(scans)
        meta.bytes = sum(seg.size for seg in meta.segments.values())
        self._log = SegmentLog(meta, self._dir, self._dir_fd, segment_bytes=config.ssd_segment_bytes,
                               lifetime_s=config.ssd_lifetime_s)  # fmt: skip
        self._refresh = RefreshQueue(meta, refresh_age_s=config.ssd_refresh_age_s, max_pending=max_pending_refreshes)
        self._reader = SSDReader(meta, self._refresh, clock, coalesce_gap_bytes=coalesce_gap_bytes)
        self._compactor = Compactor(meta, self._log, budget_bytes=config.ssd_budget_bytes,
                                    lifetime_s=config.ssd_lifetime_s, compact_live_ratio=compact_live_ratio,
                                    pressure_compact_ratio=pressure_compact_ratio,
                                    coalesce_gap_bytes=coalesce_gap_bytes)  # fmt: skip
        self._log_scan_summary(time.monotonic() - started)

    def _log_scan_summary(self, seconds: float) -> None:
        """One INFO line after the start-up scan: what the tier holds and what the scan dropped; one WARNING
        when it found version-1 records (no tenant: never served, reclaimed as garbage)."""
        st = self.stats()
        if st.legacy_records:
            log.warning("SSD tier %s: %d records of record version 1 (written before records carried their "
                        "tenant) dropped: they are never served and their bytes are reclaimed as garbage",
                        self._dir, st.legacy_records)  # fmt: skip
        log.info("SSD tier %s: %d segments, %d entries, %d B on disk (%d B live); scan dropped %d torn bytes "
                 "and %d corrupt records; oldest entry %.0f s old; scanned in %.2f s", self._dir, st.segments,
                 st.entries, st.bytes, st.live_bytes, st.torn_bytes, st.corrupt_records, st.oldest_entry_age_s,
                 seconds)  # fmt: skip

    def _load_segment(self, name: str) -> SegmentScan:
        """Start-up: register segment file ``name``, scan its headers and fsync it (the previous process
        may have died before these pages reached the disk, and a later unlink of an older segment must
        not rely on records that are only in memory)."""
        meta = self._meta
        seg = Segment.existing(self._dir / name)
        with self._lock:
            meta.fds.open_locked(seg)
        meta.segments[seg.segment_id] = seg
        scan = seg.scan()
        seg.sync()
        meta.stats.corrupt_records += scan.corrupt
        meta.stats.torn_bytes += scan.torn_bytes
        meta.stats.legacy_records += len(scan.legacy)
        return scan

    # ---- writes ------------------------------------------------------------------------------------
    def put(self, key: BlockHash, payload: bytes | bytearray | memoryview,
            tenant: bytes = DEFAULT_TENANT_TAG) -> PutResult:
        """Append a record for ``key`` of tenant ``tenant`` (a tag, kvstore/tenant.py) (the newest record of
        a key wins); durable after the next flush().

        A key already on disk is appended again, which restarts its lifetime (blocks are
        content-addressed, so the bytes are the same); to only fill a miss, check ``key in store`` first.
        Takes the write lock; may evict expired segments or compact first (``Compactor.make_room``).
        Failure: REFUSED when the budget is full of young records, FAILED on an I/O error; never raises
        for those. ValueError for a bad key/payload or a record larger than one segment.
        """
        self.validate_record(key, payload)
        with self._write_lock:
            self._meta.check_open()
            result = self._put_locked(key, payload, self._clock(), tenant)
            if result.ok:
                with self._lock:
                    self._meta.stats.puts += 1
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
            self._meta.check_open()
            return self._log.flush()

    def maintain(self) -> None:
        """Background upkeep, called by the writer between batches: queued refreshes, dead-segment
        deletion and compaction of segments whose live bytes are <= compact_live_ratio of their size.

        Takes the write lock. Never drops a young record; I/O errors are counted, not raised.
        """
        with self._write_lock:
            self._meta.check_open()
            now = self._clock()
            self._refresh.drain(now, self._put_locked)
            self._compactor.collect(now)

    def _put_locked(self, key: BlockHash, payload: bytes | bytearray | memoryview, now: float,
                    tenant: bytes = DEFAULT_TENANT_TAG) -> PutResult:
        """put() without the argument checks and the ``puts`` count. Write lock held."""
        raw = encode_record(key, payload, now, tenant)
        if not self._compactor.make_room(len(raw), now):
            with self._lock:
                self._meta.health.refused_locked(self.config.ssd_budget_bytes, now)
            return PutResult.REFUSED
        entry = self._log.append(raw, now, len(raw) - HEADER_BYTES)
        with self._lock:
            self._meta.health.admitted_locked(now)
            if entry is None:
                return PutResult.FAILED
            self._meta.index.insert(key, entry)
        return PutResult.STORED

    def delete_tenant(self, tenant: bytes) -> TenantDeletion:
        """Remove every record of tenant ``tenant`` (a tag), live or superseded, from the index and from disk:
        each segment holding one (or bytes no tenant can be proven to own: version-1 records, damaged
        ranges, torn tails) is rewritten without them, the copies fsynced, then the segment unlinked and
        the directory fsynced (ssd/tenant_delete.py). Other tenants' records keep their ``created_at``.

        Takes the write lock (writes wait). Failure: OSError after which the tenant's records are no
        longer served (dropped from the index first) but some may still be on disk; a retry finishes.
        ValueError for a tag that is not 16 bytes.
        """
        with self._write_lock:
            self._meta.check_open()
            return delete_tenant(self._meta, self._log, self._compactor, tenant, self._clock())

    # ---- reads -------------------------------------------------------------------------------------
    def get(self, key: BlockHash) -> bytes | None:
        """The verified payload of ``key``, or None (absent, or counted corrupt and dropped). See get_many."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        """Payloads for ``keys`` (None for a miss); see ``SSDReader.get_many``. Call it off the engine
        thread (it reads files). ValueError for a key that is not a BlockHash."""
        return self._reader.get_many(keys)

    def get_many_into(self, keys: Sequence[BlockHash], dest: object, slot_bytes: int) -> list[bool]:
        """Payload of ``keys[i]`` read straight into slot i of ``dest`` (e.g. a reused pinned buffer); True
        where slot i holds it verified. See ``SSDReader.get_many_into``. Call it off the engine thread."""
        return self._reader.get_many_into(keys, dest, slot_bytes)

    async def get_many_async(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        """``get_many`` on the event loop's default worker pool (for asyncio callers)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.get_many, list(keys))

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._meta.index

    def __len__(self) -> int:
        with self._lock:
            return len(self._meta.index)

    def keys(self) -> list[BlockHash]:
        with self._lock:
            return self._meta.index.keys()

    def entry(self, key: BlockHash) -> IndexEntry | None:
        """Where ``key``'s newest record is (segment id, offset, length, created_at); None if absent."""
        with self._lock:
            return self._meta.index.get(key)

    def segment_path(self, segment_id: int) -> Path:
        """The file of ``segment_id`` (whether or not it exists)."""
        return self._dir / segment_name(segment_id)

    def stats(self) -> SSDStats:
        """A snapshot: counters plus gauges sampled now."""
        meta = self._meta
        with self._lock:
            now = self._clock()
            oldest = meta.index.oldest_created_at()
            segs = meta.index.segment_ids()
            return dataclasses.replace(
                meta.stats,
                bytes=meta.bytes,
                live_bytes=sum(meta.index.live_bytes(s) for s in segs),
                young_bytes=sum(meta.index.young_bytes(s, now - self.config.ssd_lifetime_s) for s in segs),
                entries=len(meta.index),
                segments=len(meta.segments),
                oldest_entry_age_s=max(0.0, now - oldest) if oldest is not None else 0.0,
            )

    # ---- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Flush, close every file and release the directory lock. Idempotent."""
        meta = self._meta
        with self._write_lock:
            if meta.closed:
                return
            self._log.flush()
            with self._lock:
                meta.closed = True
                for seg in meta.segments.values():
                    seg.close()
                meta.fds.clear_locked()
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
        meta = self._meta
        with self._write_lock, self._lock:
            meta.check_open()
            meta.index.check_integrity()
            for seg_id in meta.index.segment_ids():
                seg = meta.segments.get(seg_id)
                if seg is None or seg.retired:
                    raise RuntimeError(f"index points into segment {seg_id}, which is {seg!r}")
                for key, entry in meta.index.segment_entries(seg_id):
                    if entry.end > seg.size:
                        raise RuntimeError(f"{key!r} ends at {entry.end}, past the end of {seg!r}")
            self._log.check_integrity()
            if deep:
                for key, entry in meta.index.items():
                    seg = meta.segments[entry.segment_id]
                    meta.fds.open_locked(seg)
                    check_header(seg, key, entry)
