"""SSDReader: the read path of an SSDStore: look up, pin, pread in coalesced runs, verify, count.

One ``get_many`` goes::

    lookup (metadata lock) ──▶ pin a few segments (lock) ──▶ pread + verify (no lock) ──▶ unpin (lock)
        ▲                                                    │ segment deleted before its pin?
        └──────────── look the key up again (at most 3 rounds) ◀──┘
    ──▶ count hits/misses/bytes, drop corrupt entries, queue old hits for refresh (lock)

Readers never take the write lock, so they never wait for an fsync; a record is served only after its
checksum and its header (key, length) match what the index says. Adjacent records of one segment are
read by one pread (``coalesce_runs`` in ssd_record_io.py).

Thread-safe: any number of reader threads (never the engine thread: reads block on the disk).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.ssd_index import IndexEntry
from flashtier.kvstore.ssd_meta import SSDMeta
from flashtier.kvstore.ssd_record_io import Located, coalesce_runs, verified_payload
from flashtier.kvstore.ssd_refresh import RefreshQueue
from flashtier.kvstore.ssd_segment import Segment

_LOOKUP_ROUNDS = 3  # a key moves at most once or twice while we read


@dataclass(slots=True)
class _ReadTally:
    """What one get_many saw, counted into the stats at its end."""

    served: dict[BlockHash, IndexEntry] = field(default_factory=dict)  # verified hits
    bad: list[Located] = field(default_factory=list)  # records failing checks
    nbytes: int = 0
    nops: int = 0
    errors: int = 0
    error: OSError | None = None  # the first one, for the log line of a state change


class SSDReader:
    """get_many over the shared metadata; hits old enough are offered to the refresh queue."""

    def __init__(self, meta: SSDMeta, refresh: RefreshQueue, clock: Callable[[], float], *,
                 coalesce_gap_bytes: int) -> None:  # fmt: skip
        self._meta = meta
        self._refresh = refresh
        self._clock = clock
        self._gap = coalesce_gap_bytes

    def get_many(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        """Payloads for ``keys`` (None for a miss), reading adjacent records of a segment in one pread.

        Takes the metadata lock only briefly (file reads happen outside it, on pinned segments), a few
        segments at a time so at most ~max_open descriptors are open. A key whose segment was deleted
        meanwhile (compacted or evicted) is looked up again.
        Mutates: hit/miss/read counters; a read I/O error is a miss, counted in ``read_errors`` and
        logged once per state change (``SSDHealth``); a record failing its checks is dropped from the
        index and counted in ``corrupt_records`` (a miss, never served); a hit older than the refresh age
        is queued for maintain() to re-append.
        Failure: ValueError for a key that is not a BlockHash; RuntimeError once the store is closed.
        """
        for key in keys:
            if not isinstance(key, BlockHash):
                raise ValueError(f"SSD keys are BlockHash, got {type(key).__name__}")
        meta = self._meta
        out: list[bytes | None] = [None] * len(keys)
        positions: dict[BlockHash, list[int]] = {}
        for i, key in enumerate(keys):
            positions.setdefault(key, []).append(i)
        tally = _ReadTally()
        todo = list(positions)
        for _ in range(_LOOKUP_ROUNDS):
            if not todo:
                break
            with meta.lock:
                meta.check_open()
                groups: dict[int, list[Located]] = {}
                for key in todo:
                    entry = meta.index.get(key)
                    if entry is not None:
                        groups.setdefault(entry.segment_id, []).append((key, entry))
            todo = []
            seg_ids = sorted(groups)
            step = max(1, meta.fds.max_open // 2)
            for chunk in (seg_ids[i : i + step] for i in range(0, len(seg_ids), step)):
                todo += self._read_chunk(chunk, groups, positions, out, tally)
        with meta.lock:
            self._count_locked(len(keys), out, tally)
        return out

    def _read_chunk(self, chunk: list[int], groups: dict[int, list[Located]], positions: dict[BlockHash, list[int]],
                    out: list[bytes | None], tally: _ReadTally) -> list[BlockHash]:  # fmt: skip
        """Pin, read and verify the records of the segments in ``chunk``; fills ``out`` and ``tally``.
        Returns the keys whose segment was retired before it could be pinned (to look up again)."""
        meta = self._meta
        pinned: list[Segment] = []
        moved: list[BlockHash] = []
        with meta.lock:
            for seg_id in chunk:
                seg = meta.segments.get(seg_id)
                if seg is None or seg.retired:
                    moved += [key for key, _ in groups[seg_id]]
                    continue
                try:
                    meta.fds.open_locked(seg)
                except OSError as exc:
                    tally.errors, tally.error = tally.errors + 1, tally.error or exc
                    continue
                seg.pin()
                pinned.append(seg)
        try:
            for seg in pinned:
                for run in coalesce_runs(groups[seg.segment_id], self._gap):
                    start, end = run[0][1].offset, run[-1][1].end
                    try:
                        data = seg.read(start, end - start)
                    except OSError as exc:
                        tally.errors, tally.error = tally.errors + 1, tally.error or exc
                        continue
                    tally.nbytes, tally.nops = tally.nbytes + len(data), tally.nops + 1
                    for key, entry in run:
                        payload = verified_payload(data, entry.offset - start, key, entry)
                        if payload is None:
                            tally.bad.append((key, entry))
                        else:
                            tally.served[key] = entry
                        for i in positions[key]:
                            out[i] = payload
        finally:
            with meta.lock:
                for seg in pinned:
                    seg.unpin()
                meta.fds.trim_locked()
        return moved

    def _count_locked(self, n: int, out: list[bytes | None], tally: _ReadTally) -> None:
        """Metadata lock held: counters, corrupt-entry removal and refresh queueing after a read."""
        st = self._meta.stats
        hits = sum(p is not None for p in out)
        st.hits, st.misses = st.hits + hits, st.misses + n - hits
        st.bytes_read, st.read_ops = st.bytes_read + tally.nbytes, st.read_ops + tally.nops
        if tally.errors:
            self._meta.health.read_failed_locked(tally.errors, tally.error)
        elif tally.nops:
            self._meta.health.read_ok_locked()
        for key, entry in tally.bad:
            if self._meta.index.remove(key, entry) is not None:
                st.corrupt_records += 1
        self._refresh.offer_locked(tally.served, self._clock())

