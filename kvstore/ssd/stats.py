"""SSDStats: the counters and gauges of one SSDStore (what ``SSDStore.stats()`` returns).

Counters only grow (export deltas); gauges are filled in when ``stats()`` takes its snapshot, so the
instance the store keeps holds zeros in them. Every field is written under the store's metadata lock.
Faults are counted by cause here and logged once per state change by ``SSDHealth`` (ssd/health.py).
"""

from __future__ import annotations

from dataclasses import dataclass


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
    admission_refusals: int = 0  # writes refused because the budget is full of young records (not I/O)
    expirations: int = 0  # live records dropped because they were past their lifetime
    corrupt_records: int = 0  # damaged headers found by scans + records failing checks on read
    torn_bytes: int = 0  # bytes of torn tails found at start-up (ignored: dropped from the index)
    legacy_records: int = 0  # version-1 records (no tenant) skipped at start-up: never served
    tenant_deletions: int = 0  # delete_tenant() calls that completed
    tenant_records_deleted: int = 0  # records (live or dead) removed by them
    evicted_segments: int = 0  # segment files deleted (dead, expired or compacted)
    compactions: int = 0  # segments whose records were copied out
    compacted_bytes: int = 0  # bytes copied by compaction
    bytes_read: int = 0
    bytes_written: int = 0
    read_ops: int = 0  # pread calls for payloads (one per coalesced run)
    fsyncs: int = 0
    read_errors: int = 0  # failed preads (reads, compaction and refresh reads): a miss, never raised
    write_errors: int = 0  # failed appends / fsyncs, every cause (the sum of the three below)
    write_errors_disk_full: int = 0  # ... ENOSPC / EDQUOT
    write_errors_unwritable: int = 0  # ... EROFS / EACCES / EPERM (read-only or forbidden directory)
    write_errors_io: int = 0  # ... any other OSError (EIO, ...)
