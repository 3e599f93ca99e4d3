"""SSDReader: the read path of an SSDStore: look up, plan, pin, preadv whole runs, verify, count.

One ``get_many`` (or ``get_many_into``) goes::

    lookup (metadata lock) ──▶ plan runs ──▶ pin a few segments (lock) ──▶ preadv + verify ──▶ unpin (lock)
        ▲                                                             │ segment deleted before its pin?
        └─────────────── look the key up again (at most 3 rounds) ◀───┘
    ──▶ count hits/misses/bytes, drop corrupt entries, queue old hits for refresh (lock)

Where the time goes in a restore of thousands of 57 KB records, and what this path does about it:
  - one read per record, or per key order: the wanted records are sorted by (segment, offset) and read
    in runs of up to RUN_BYTES (ssd/read_plan.py), whatever order the caller asked in;
  - fresh memory per read (page faults): runs land in two buffers reused across calls
    (ssd/read_buffers.py), or straight in the caller's buffer (``get_many_into``: no copy in user space);
  - per-record Python objects: records are checked on views of the run (ssd/read_check.py);
  - reading and checking in turn: an I/O thread reads run k+1 (preadv and the kernel's page-cache work
    release the GIL) while the caller's thread checks run k, and the runs after it are announced to the
    kernel (``prefetch``) so the disk streams ahead of both (ssd/read_sinks.py splits fill from check).
Readers never take the write lock, so they never wait for an fsync; a record is served only after its
checksums and its header (key, length) match what the index says.

Thread-safe: any number of reader threads (never the engine thread: reads block on the disk).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.ssd.meta import SSDMeta
from flashtier.kvstore.ssd.read_buffers import ReadBuffers
from flashtier.kvstore.ssd.read_io import prefetch
from flashtier.kvstore.ssd.read_plan import ReadRun, plan_reads
from flashtier.kvstore.ssd.read_sinks import BytesSink, IntoSink, ReadTally
from flashtier.kvstore.ssd.refresh import RefreshQueue
from flashtier.kvstore.ssd.segment import Segment

_LOOKUP_ROUNDS = 3  # a key moves at most once or twice while we read
RUN_BYTES = 8 << 20  # one preadv: big enough to stream, small enough to stay in the CPU caches while checked
PREFETCH_BYTES = 32 << 20  # how far ahead of the run being checked the disk is kept busy
Sink = BytesSink | IntoSink


class SSDReader:
    """get_many / get_many_into over the shared metadata; hits old enough are offered to the refresh queue."""

    def __init__(self, meta: SSDMeta, refresh: RefreshQueue, clock: Callable[[], float], *,
                 coalesce_gap_bytes: int, run_bytes: int = RUN_BYTES, prefetch_bytes: int = PREFETCH_BYTES,
                 pipeline: bool | None = None) -> None:  # fmt: skip
        """``coalesce_gap_bytes``: read through holes up to this size rather than starting a new run;
        ``run_bytes``: the longest run (one preadv); ``prefetch_bytes``: how far ahead of the run being
        read the kernel is asked to read; ``pipeline``: read on an I/O thread while checking on the
        caller's (None: when the process has more than two CPUs). ValueError naming a size out of range."""
        for name, value, least in (("coalesce_gap_bytes", coalesce_gap_bytes, 0), ("run_bytes", run_bytes, 1),
                                   ("prefetch_bytes", prefetch_bytes, 0)):  # fmt: skip
            if value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
        self._meta = meta
        self._refresh = refresh
        self._clock = clock
        self._gap = coalesce_gap_bytes
        self._run_bytes = run_bytes
        self._prefetch_bytes = prefetch_bytes
        # the I/O thread pays off only with a core to run on: by default, on with more than two
        # (measured on a shared 2-core machine it was a few % slower than one thread)
        self.pipelined = _cores() > 2 if pipeline is None else pipeline
        self._buffers = ReadBuffers(run_bytes)

    def get_many(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        """Payloads for ``keys`` (None for a miss), in the caller's order, each as its own bytes.

        Takes the metadata lock only briefly (file reads happen outside it, on pinned segments), a few
        segments at a time so at most ~max_open descriptors are open. A key whose segment was deleted
        meanwhile (compacted or evicted) is looked up again. A key listed twice is read once.
        Mutates: hit/miss/read counters; a read I/O error is a miss, counted in ``read_errors`` and
        logged once per state change (``SSDHealth``); a record failing its checks (or cut off by the end
        of its file) is dropped from the index and counted in ``corrupt_records`` (a miss, never served);
        a hit older than the refresh age is queued for maintain() to re-append.
        Failure: ValueError for a key that is not a BlockHash; RuntimeError once the store is closed.
        """
        positions = _positions(keys)
        with self._buffers.lease() as one, self._buffers.lease() as two:
            sink = BytesSink(positions, len(keys), [one, two])
            self._collect(positions, len(keys), sink)
        return sink.out

    def get_many_into(self, keys: Sequence[BlockHash], dest: object, slot_bytes: int) -> list[bool]:
        """Read each key's payload straight into ``dest[i * slot_bytes : (i + 1) * slot_bytes]``.

        ``dest`` is any writable C-contiguous buffer of at least ``len(keys) * slot_bytes`` bytes (a
        bytearray, a numpy array, ``tensor.numpy()`` of a pinned uint8 CPU tensor); reusing one keeps
        the restore free of page faults and of any copy in user space. Returns ``ok[i]``: True when
        slot i holds the verified payload of ``keys[i]``. A miss (absent, damaged, unreadable, or a
        record whose payload is not exactly ``slot_bytes``) is False and its slot is zero-filled: the
        slot never keeps unverified bytes. Same locking, counting and refresh rules as ``get_many``.
        Mutates: the slots of the keys whose records were read (the payload, or zeros when damaged or
        unreadable); the slots of absent keys and of records of another length are left as they were.
        Failure: ValueError for a bad key, a read-only or non-contiguous ``dest``, one too small, or
        ``slot_bytes < 1``; RuntimeError once the store is closed.
        """
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes < 1:
            raise ValueError(f"slot_bytes must be a positive int, got {slot_bytes!r}")
        try:
            view = memoryview(dest)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError(f"dest must support the buffer protocol, got {type(dest).__name__}") from None
        if view.readonly or not view.c_contiguous:
            raise ValueError("dest must be a writable, C-contiguous buffer")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if view.nbytes < len(keys) * slot_bytes:
            raise ValueError(f"dest holds {view.nbytes} B, {len(keys)} slots of {slot_bytes} B need "
                             f"{len(keys) * slot_bytes}")  # fmt: skip
        positions = _positions(keys)
        sink = IntoSink(positions, len(keys), view, slot_bytes)
        self._collect(positions, len(keys), sink)
        return sink.ok

    def _collect(self, positions: dict[BlockHash, list[int]], n: int, sink: Sink) -> None:
        """Look up, plan and read every key of ``positions`` into ``sink``; then count."""
        meta = self._meta
        tally = ReadTally()
        todo = list(positions)
        for _ in range(_LOOKUP_ROUNDS):
            if not todo:
                break
            with meta.lock:
                meta.check_open()
                located = [(k, e) for k in todo if (e := meta.index.get(k)) is not None and sink.accepts(e)]
            runs = plan_reads(located, gap=self._gap, max_run_bytes=self._run_bytes).by_segment()
            todo = []
            seg_ids = list(runs)
            step = max(1, meta.fds.max_open // 2)
            for chunk in (seg_ids[i : i + step] for i in range(0, len(seg_ids), step)):
                todo += self._read_chunk(chunk, runs, sink, tally)
        with meta.lock:
            self._count_locked(n, sink.hits(), tally)

    def _read_chunk(self, chunk: list[int], runs: dict[int, list[ReadRun]], sink: Sink,
                    tally: ReadTally) -> list[BlockHash]:  # fmt: skip
        """Pin the segments in ``chunk``, read their runs into ``sink`` and count into ``tally``.
        Returns the keys whose segment was retired before it could be pinned (to look up again)."""
        meta = self._meta
        pinned: list[Segment] = []
        moved: list[BlockHash] = []
        with meta.lock:
            for seg_id in chunk:
                seg = meta.segments.get(seg_id)
                if seg is None or seg.retired:
                    moved += [key for run in runs[seg_id] for key, _ in run.records]
                    continue
                try:
                    meta.fds.open_locked(seg)
                except OSError as exc:
                    tally.failed(exc)
                    continue
                seg.pin()
                pinned.append(seg)
        try:
            self._read_runs([(seg.fd, run) for seg in pinned for run in runs[seg.segment_id]], sink, tally)
        finally:
            with meta.lock:
                for seg in pinned:
                    seg.unpin()
                meta.fds.trim_locked()
        return moved

    def _read_runs(self, queue: list[tuple[int, ReadRun]], sink: Sink, tally: ReadTally) -> None:
        """Fill and check every run of ``queue`` (descriptors pinned by the caller). When pipelined and
        there is more than one run, an I/O thread fills run k+1 while this thread checks run k, so the
        kernel's page-cache work and copy overlap the checksums and the copies out. A read error is
        counted in ``tally``; the run's keys stay misses."""
        ahead = _Announcer(queue, self._prefetch_bytes)

        def fill(k: int) -> Any:
            ahead.upto(k)
            return sink.fill(queue[k][0], queue[k][1], k)

        if len(queue) < 2 or not self.pipelined:
            for k, (_, run) in enumerate(queue):
                try:
                    filled = fill(k)
                except OSError as exc:
                    tally.failed(exc)
                    continue
                sink.check(run, filled, tally)
            return
        with ThreadPoolExecutor(1, thread_name_prefix="ssd-read") as io:  # exits once every fill is done
            nxt: Future[Any] | None = io.submit(fill, 0)
            for k, (_, run) in enumerate(queue):
                this, nxt = nxt, io.submit(fill, k + 1) if k + 1 < len(queue) else None
                assert this is not None
                try:
                    filled = this.result()
                except OSError as exc:
                    tally.failed(exc)
                    continue
                sink.check(run, filled, tally)

    def _count_locked(self, n: int, hits: int, tally: ReadTally) -> None:
        """Metadata lock held: counters, corrupt-entry removal and refresh queueing after a read."""
        st = self._meta.stats
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


class _Announcer:
    """Tells the kernel about the runs ahead (``prefetch``), so the disk reads them while earlier ones are
    copied and checked. Used by one thread at a time (whichever fills)."""

    def __init__(self, queue: list[tuple[int, ReadRun]], window: int) -> None:
        self._queue, self._window = queue, window
        self._next, self._next_at = 1, queue[0][1].length if queue else 0  # run 0 is read right away
        self._filled, self._filled_end = -1, 0

    def upto(self, k: int) -> None:
        """Run ``k`` is about to be read: announce every later run starting within the window after its end."""
        while self._filled < k:
            self._filled += 1
            self._filled_end += self._queue[self._filled][1].length
        if self._next <= k:  # runs up to k are read now anyway: announcing them would only cost a call
            self._next, self._next_at = k + 1, self._filled_end
        while self._next < len(self._queue) and self._next_at < self._filled_end + self._window:
            fd, run = self._queue[self._next]
            prefetch(fd, run.offset, run.length)
            self._next, self._next_at = self._next + 1, self._next_at + run.length


def _cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _positions(keys: Sequence[BlockHash]) -> dict[BlockHash, list[int]]:
    """key -> its indexes in ``keys``. ValueError for a key that is not a BlockHash."""
    positions: dict[BlockHash, list[int]] = {}
    for i, key in enumerate(keys):
        if not isinstance(key, BlockHash):
            raise ValueError(f"SSD keys are BlockHash, got {type(key).__name__}")
        positions.setdefault(key, []).append(i)
    return positions
