"""delete_tenant: remove one tenant's records from a running SSDStore, from the index *and* from disk.

Records carry the tag of the tenant they were written under (ssd/record.py). Deleting a tenant::

    flush + seal the active segment          every record appended so far is in a sealed, fsynced file
    per segment: scan headers                the tenant's records, live or superseded (dead bytes count:
                                             "deleted" means no longer in any file)
      none of the tenant's, all attributable   untouched
      else                                     the tenant's live entries leave the index (no longer served),
                                               then the segment is compacted (ssd/compaction.py): the other
                                               tenants' live records are copied byte-identical (same
                                               created_at, so their lifetime guarantee is unchanged) to the
                                               active segment, fsynced, and the source unlinked
    flush                                    the directory is fsynced after the last unlink

A segment also counts as holding the tenant's bytes when it holds bytes no tenant can be proven to own:
version-1 records (no tenant), damaged ranges and torn tails. They are never served; the rewrite drops them.

Runs under the store's write lock (puts wait); the metadata lock is taken briefly inside, so reads go on
and a read that races the deletion is either a hit on the old copy (before the index changed) or a miss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from flashtier.kvstore.ssd.compaction import Compactor
from flashtier.kvstore.ssd.index import IndexEntry
from flashtier.kvstore.ssd.log import SegmentLog
from flashtier.kvstore.ssd.meta import SSDMeta
from flashtier.kvstore.tenant import TAG_BYTES

__all__ = ["TenantDeletion", "delete_tenant"]


@dataclass(slots=True)
class TenantDeletion:
    """What one ``delete_tenant`` did."""

    records_deleted: int = 0  # the tenant's records found in segments (live and superseded)
    live_deleted: int = 0  # of which the index served (entries dropped)
    bytes_deleted: int = 0  # record bytes of the tenant's records
    unattributed_bytes: int = 0  # version-1 records, damaged ranges and torn tails dropped with them
    segments_rewritten: int = 0  # segments compacted (others' records copied) and unlinked
    records_kept: int = 0  # other tenants' live records copied out of rewritten segments
    seconds: float = 0.0


def delete_tenant(meta: SSDMeta, log: SegmentLog, compactor: Compactor, tenant: bytes, now: float) -> TenantDeletion:
    """See the module doc. Store write lock held. Mutates the index, the segment files and their table.

    Failure: OSError when a segment could not be scanned or rewritten (the tenant's entries are out of the
    index already, so nothing of it is served; its bytes stay in that segment until a retry).
    ValueError for a tag that is not TAG_BYTES bytes.
    """
    if not isinstance(tenant, bytes) or len(tenant) != TAG_BYTES:
        raise ValueError(f"a tenant is a {TAG_BYTES}-byte tag, got {tenant!r}")
    started = time.monotonic()
    out = TenantDeletion()
    if not log.flush():
        raise OSError("SSD tier: fsync failed before the tenant deletion")
    log.seal_active()
    failed: list[int] = []
    for seg in list(meta.sealed_segments()):
        with meta.fds.pinned(seg):
            scan = seg.scan()
        mine = [(off, h) for off, h in scan.records if h.tenant == tenant]
        unattributed = scan.legacy_bytes + scan.torn_bytes + (scan.end - scan.torn_bytes - scan.legacy_bytes
                                                              - sum(h.record_bytes for _, h in scan.records))
        if not mine and not unattributed:
            continue
        with meta.lock:
            for off, h in mine:
                if meta.index.remove(h.key, IndexEntry(seg.segment_id, off, h.length, h.created_at)) is not None:
                    out.live_deleted += 1
            kept = meta.index.live_count(seg.segment_id)
        out.records_deleted += len(mine)
        out.bytes_deleted += sum(h.record_bytes for _, h in mine)
        out.unattributed_bytes += unattributed
        # young_only=False: every other live record moves, whatever its age, so the segment can go
        if compactor.compact(seg, now, young_only=False):
            out.segments_rewritten += 1
            out.records_kept += kept
        else:
            failed.append(seg.segment_id)
    log.flush()  # fsyncs the directory after the last unlink
    with meta.lock:
        meta.stats.tenant_records_deleted += out.records_deleted
        if not failed:
            meta.stats.tenant_deletions += 1
    out.seconds = time.monotonic() - started
    if failed:
        raise OSError(f"SSD tier {meta.directory}: segments {failed} could not be rewritten; the tenant's "
                      "entries are no longer served, run the deletion again to remove their bytes")
    return out
