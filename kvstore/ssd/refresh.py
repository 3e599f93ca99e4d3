"""RefreshQueue: hot SSD records waiting to be re-appended, so their lifetime restarts before it ends.

A record's lifetime counts from its last write (``ssd_lifetime_s``); a block that keeps being hit must
not expire. So a hit on a record at least ``ssd_refresh_age_s`` old is queued by the reader and
re-appended by the writer's next maintain()::

    get hit, age >= refresh age ──offer_locked()──▶ queued (at most max_pending, else not queued)
    queued ──drain()──▶ re-read + verified ──put()──▶ new record, created_at = now (``refreshes``)
                 └── skipped: superseded meanwhile, or younger than the refresh age by now

The queue is bounded and lossy on purpose: a hit that finds it full is not queued, and the next hit on
the same block queues it again. Readers offer under the metadata lock; ``drain`` runs under the write
lock (it calls back into the store's put path) and takes the metadata lock only briefly.
"""

from __future__ import annotations

from collections.abc import Callable

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.ssd.index import IndexEntry
from flashtier.kvstore.ssd.meta import SSDMeta
from flashtier.kvstore.ssd.put_result import PutResult
from flashtier.kvstore.ssd.record import decode_header
from flashtier.kvstore.ssd.record_io import verified_payload

Put = Callable[[BlockHash, bytes, float, bytes], PutResult]  # the store's put under the write lock (key, payload,
#                                                              now, tenant)


class RefreshQueue:
    """Keys whose served record was old enough to re-append, with the entry that was served."""

    def __init__(self, meta: SSDMeta, *, refresh_age_s: float, max_pending: int) -> None:
        self._meta = meta
        self._age = refresh_age_s
        self._max = max_pending
        self._pending: dict[BlockHash, IndexEntry] = {}

    def offer_locked(self, served: dict[BlockHash, IndexEntry], now: float) -> None:
        """Queue each served entry at least the refresh age old, while there is room. Metadata lock held."""
        for key, entry in served.items():
            if now - entry.created_at >= self._age and len(self._pending) < self._max:
                self._pending[key] = entry

    def drain(self, now: float, put: Put) -> None:
        """Re-append every queued record still current and old enough, through ``put``.

        Mutates: empties the queue; ``refreshes`` for each stored copy. A record that fails its checks
        is dropped from the index and counted corrupt; a read error is counted and the key skipped.
        Write lock held (``put`` needs it); takes the metadata lock briefly.
        """
        meta = self._meta
        with meta.lock:
            pending, self._pending = self._pending, {}
        for key, entry in pending.items():
            with meta.lock:
                if meta.index.get(key) != entry or now - entry.created_at < self._age:
                    continue
            seg = meta.segments[entry.segment_id]
            try:
                with meta.fds.pinned(seg):
                    data = seg.read(entry.offset, entry.record_bytes)
            except OSError as exc:
                with meta.lock:
                    meta.health.read_failed_locked(1, exc)
                continue
            payload = verified_payload(data, 0, key, entry)
            if payload is None:
                with meta.lock:
                    if meta.index.remove(key, entry) is not None:
                        meta.stats.corrupt_records += 1
                continue
            if put(key, payload, now, decode_header(data).tenant).ok:  # the copy keeps its tenant
                with meta.lock:
                    meta.stats.refreshes += 1

