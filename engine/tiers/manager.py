"""The KV tiers as the engine uses them: SSD write-through, snapshot puts, resume lookups (DESIGN §5).

    engine thread                         tier I/O thread (its own asyncio loop)
    write_block(hash, image) ---------->  SSDWriter (batched appends + fsync, its own thread)
    put_snapshot(key, payload) ------->   snapshot pool .put (Redis with a bounded timeout / embedded)
    lookup(query) -> Future ---------->   SSD index probe, snapshot directory + get, SSD block reads
                                          into the RestoreBuffer (engine/tiers/restore_buffer.py)
The engine never waits: a request whose lookup is pending sits in LOADING and the step goes on. Any
tier failure is a miss (counted), never an error for the request. SSD blocks come back as a
``RestoredRun`` (slots of a held restore buffer), installed into the pool in one copy (resume.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from flashtier.engine.tiers.restore_buffer import RESTORE_MAX_BYTES, RestoreBuffer
from flashtier.engine.tiers.restored_run import RestoredRun
from flashtier.engine.tiers.snapshot_search import SnapshotQuery, find_snapshot
from flashtier.kvstore.block_hash import BlockHash, fork_chain
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.snapshot.persist import load_pool, save_pool
from flashtier.kvstore.snapshot.pool import EmbeddedSnapshotPool
from flashtier.kvstore.snapshot.redis_pool import snapshot_pool_from_config
from flashtier.kvstore.snapshot.key import SnapshotKey
from flashtier.kvstore.ssd.put_result import PutResult
from flashtier.kvstore.ssd.store import SSDStore
from flashtier.kvstore.ssd.tenant_delete import TenantDeletion
from flashtier.kvstore.ssd.writer import SSDWriter
from flashtier.kvstore.tenant import DEFAULT_TENANT_TAG

log = logging.getLogger("flashtier.engine.tiers.manager")

@dataclass(frozen=True)
class LookupQuery:
    namespace: BlockHash
    prompt: list[int]
    hashes: list[BlockHash]  # chained hashes of the prompt's full blocks
    hbm_blocks: int  # leading blocks already found in the runtime pool
    block_size: int
    replayed_namespace: BlockHash | None = None  # also resume replayed states (resume policy "replay")
    fork_block: int | None = None  # hashes[fork_block:] already follow a replayed fork (found in HBM)
    block_bytes: int = 0  # one block image (the restore buffer's slot); needed with an SSD tier
    pin_memory: bool = False  # the pool is on CUDA: restore through pinned host memory


@dataclass(frozen=True)
class ForkedChain:
    """The lookup left the exact chain at ``block`` (an SSD miss) and found more on the replayed fork."""

    hashes: tuple[BlockHash, ...]
    block: int


class SnapshotOutcome(enum.Enum):
    """What a lookup found in the snapshot pool (the value names the metric label)."""

    HIT = "hit"
    MISS = "miss"  # a candidate was listed but its payload is gone, or a block under it vanished
    ERROR = "error"  # the lookup failed, or the payload did not validate
    NONE = "none"  # no candidate point


@dataclass(frozen=True)
class TierLookup:
    """A finished resume lookup: SSD block images after the HBM hits, and the best snapshot.

    ``ssd_images`` holds a slot of the tier's restore buffer until the engine installs it (or the lookup
    is dropped and collected); a tuple of bytes (a hand-built lookup) is copied into a run of its own.
    """

    ssd_images: RestoredRun  # images of blocks hbm_blocks .. hbm_blocks + len - 1, read from SSD
    snapshot_point: int | None = None  # P of the snapshot found (None: no usable snapshot)
    snapshot_payload: bytes | None = None
    outcome: SnapshotOutcome = SnapshotOutcome.MISS
    fork: ForkedChain | None = None  # set when the blocks after the HBM hits follow a replayed fork

    def __post_init__(self) -> None:
        if not isinstance(self.ssd_images, RestoredRun):
            object.__setattr__(self, "ssd_images", RestoredRun.from_images(tuple(self.ssd_images)))


@dataclass
class TierStats:
    """Counters of the engine's tier use (monotonic)."""

    ssd_blocks_written: int = 0
    ssd_bytes_written: int = 0
    ssd_write_refused: int = 0  # admission control: the budget is full of entries inside their lifetime
    ssd_blocks_loaded: int = 0
    snapshot_puts: int = 0
    snapshot_bytes_written: int = 0
    snapshot_lookups: dict[SnapshotOutcome, int] = field(default_factory=lambda: dict.fromkeys(SnapshotOutcome, 0))
    lookups: int = 0
    # the embedded pool's file (kvstore/snapshot/persist.py): snapshots loaded at start-up, files found damaged
    snapshot_restored: int = 0
    snapshot_restore_corrupt: int = 0


@dataclass
class TierDeletion:
    """What ``TierManager.delete_tenant`` removed."""

    queued_discarded: int = 0  # write-through blocks dropped from the writer's queue
    ssd: TenantDeletion | None = None  # None: no SSD tier
    snapshots_deleted: int = 0


class TierManager:
    """SSD store + writer, snapshot pool and the I/O loop; one per engine."""

    def __init__(self, config: KVStoreConfig, *, ssd_clock=None, restore_max_bytes: int = RESTORE_MAX_BYTES):
        """``restore_max_bytes``: the largest kept restore buffer (a longer restore reads into a one-off one)."""
        self.config = config
        self.restore_max_bytes = restore_max_bytes
        self.restore: RestoreBuffer | None = None  # made by the first lookup that may read SSD blocks
        self.stats = TierStats()
        self.ssd = None
        self.writer = None
        if config.ssd_dir is not None:
            kw = {"clock": ssd_clock} if ssd_clock is not None else {}
            self.ssd = SSDStore(config, **kw)
            self.writer = SSDWriter(self.ssd)
        self.snapshots = snapshot_pool_from_config(config)
        self.snapshots_survive_restart = config.redis_url is not None
        # the embedded pool survives a clean restart in a file beside the SSD tier (saved by ``close``)
        self._pool_file_dir = config.ssd_dir if isinstance(self.snapshots, EmbeddedSnapshotPool) else None
        if self._pool_file_dir is not None:
            loaded = load_pool(self.snapshots, self._pool_file_dir)
            self.stats.snapshot_restored, self.stats.snapshot_restore_corrupt = loaded.loaded, loaded.corrupt
            if loaded.loaded or loaded.expired:
                log.info("embedded snapshot pool: %d snapshots loaded from %s (%d expired while stopped)",
                         loaded.loaded, self._pool_file_dir, loaded.expired)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flashtier-tier-io", daemon=True)
        self._thread.start()
        self._pending: set[concurrent.futures.Future] = set()

    # ---- writes (fire and forget) ----------------------------------------------------------------
    def write_block(self, key: BlockHash, image: bytes, on_durable: Callable[[int], None] | None = None,
                    tenant: bytes = DEFAULT_TENANT_TAG) -> None:
        """Write-through of a completed full block of tenant ``tenant`` (its tag, kvstore/tenant.py: the
        record carries it, so the tenant's deletion finds it). ``on_durable(nbytes)`` runs (on the writer
        thread) once the record is fsynced; a refused or failed write is only counted."""
        if self.writer is None or key in self.ssd:
            return  # already on disk: a hit older than the refresh age re-appends it there
        fut = self.writer.submit(key, image, tenant)
        fut.add_done_callback(lambda f, n=len(image): self._count_write(f, n, on_durable))

    def _count_write(self, fut: concurrent.futures.Future, nbytes: int,
                     on_durable: Callable[[int], None] | None) -> None:
        try:
            result = fut.result()
        except Exception:  # noqa: BLE001 - a failed write is a future miss
            result = PutResult.FAILED
        if result.ok:
            self.stats.ssd_blocks_written += 1
            self.stats.ssd_bytes_written += nbytes
            if on_durable is not None:
                on_durable(nbytes)
        elif result is PutResult.REFUSED:  # I/O failures and queue drops: the store and writer count them
            self.stats.ssd_write_refused += 1

    def put_snapshot(self, key: SnapshotKey, payload: bytes, on_stored: Callable[[int], None] | None = None) -> None:
        """Fire-and-forget put. ``on_stored(nbytes)`` runs (on the I/O thread) once an out-of-process
        pool (Redis) confirmed it; the embedded pool lives and dies with this process, so never."""
        self.stats.snapshot_puts += 1
        self.stats.snapshot_bytes_written += len(payload)
        fut = self._submit(self.snapshots.put(key, payload))
        if on_stored is not None and self.snapshots_survive_restart:
            fut.add_done_callback(lambda f, n=len(payload): _result_ok(f) and on_stored(n))

    def _submit(self, coro) -> concurrent.futures.Future:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return fut

    # ---- lookups ----------------------------------------------------------------------------------
    def lookup(self, query: LookupQuery) -> concurrent.futures.Future[TierLookup]:
        """Start a resume lookup; the future yields a ``TierLookup`` (never raises). Engine thread only.

        Mutates: the counters; the first call with an SSD tier makes ``restore`` (slots of
        ``query.block_bytes``, pinned per ``query.pin_memory``). Failure: ValueError naming
        ``block_bytes`` / ``pin_memory`` when they do not fit that buffer (a programming error).
        """
        if self.ssd is not None:
            self._restore_for(query)
        self.stats.lookups += 1
        return self._submit(self._lookup(query))

    def drop_lookup(self, fut: concurrent.futures.Future[TierLookup]) -> None:
        """Give back what a lookup nobody will install holds (its SSD images' restore lease): at once when
        it is done, else on the I/O thread the moment it completes. Never waits; any thread. The
        request's abort calls it, so a dropped lookup never keeps a kept buffer until the garbage
        collector finds its lease (it would make the next restores take one-off buffers meanwhile).
        Mutates ``restore``'s free list (through the lease). ``barrier`` waits until a drop of a lookup
        that was in flight has run."""
        fut.add_done_callback(_release_dropped)

    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every callback the I/O loop has started has run: the release of a dropped lookup
        whose future is done, say (a future's waiters wake before its callbacks run). Not from the I/O
        thread. TimeoutError after ``timeout`` seconds."""
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self._loop).result(timeout)

    def _restore_for(self, q: LookupQuery) -> RestoreBuffer:
        if self.restore is None:
            if q.block_bytes < 1:
                raise ValueError(f"block_bytes must be >= 1 with an SSD tier, got {q.block_bytes}")
            self.restore = RestoreBuffer(q.block_bytes, max_bytes=self.restore_max_bytes, pinned=q.pin_memory)
        elif q.block_bytes != self.restore.slot_bytes:
            raise ValueError(f"block_bytes {q.block_bytes} differs from the restore buffer's {self.restore.slot_bytes}")
        elif q.pin_memory != self.restore.pinned:
            raise ValueError(f"pin_memory {q.pin_memory} differs from the restore buffer's {self.restore.pinned}")
        return self.restore

    async def _lookup(self, q: LookupQuery) -> TierLookup:
        try:
            return await self._lookup_inner(q)
        except Exception:  # noqa: BLE001 - any tier failure is a miss
            log.exception("tier lookup failed; treating it as a miss")
            return TierLookup(RestoredRun.empty(), outcome=SnapshotOutcome.ERROR)

    async def _lookup_inner(self, q: LookupQuery) -> TierLookup:
        bs, n = q.block_size, len(q.prompt)
        hashes, available, fork = q.hashes, self._on_ssd(q.hashes, q.hbm_blocks), None
        if q.replayed_namespace is not None and q.fork_block is None and available < len(hashes):
            # where the exact chain ends, a conversation that went through a bounded replay goes on along its
            # replayed fork (block_hash.fork_root): approximate blocks, resumed only as a replay
            forked = fork_chain(hashes, q.namespace, q.prompt, bs, available)
            further = self._on_ssd(forked, available)
            if further > available:
                hashes, fork, available = forked, ForkedChain(tuple(forked), available), further
        # the longest snapshot point P <= n whose full blocks are all available (its replay tail carries
        # the encoder outputs that the decoder replay needs below P; P = n: a retry of the same prompt)
        best_b = min(available, n // bs)
        query = SnapshotQuery(q.namespace, q.replayed_namespace, q.prompt, hashes, bs)
        found = await find_snapshot(self.snapshots, query, best_b)
        point, payload = found.point, found.payload
        result = (SnapshotOutcome.HIT if point is not None else SnapshotOutcome.ERROR if found.failed else
                  SnapshotOutcome.MISS if found.listed else SnapshotOutcome.NONE)
        need = available if point is None else point // bs
        run = RestoredRun.empty()
        if self.ssd is not None and need > q.hbm_blocks:
            run = await self._loop.run_in_executor(None, self._read_run, hashes[q.hbm_blocks : need])
            if len(run) < need - q.hbm_blocks and point is not None:
                point, payload, result = None, None, SnapshotOutcome.MISS  # a block under it vanished
        return TierLookup(run, point, payload, result, fork)

    def _read_run(self, keys: list[BlockHash]) -> RestoredRun:
        """Read ``keys``' blocks into a lease of the restore buffer (a worker thread of the I/O loop): the
        run is the leading slots read verified, up to the first miss (absent, damaged or unreadable).
        Mutates the lease's slots and the SSD counters. Failure: a read error raised by the store
        propagates (a miss for the caller) with the lease given back."""
        restore = self.restore
        assert restore is not None and self.ssd is not None
        lease = restore.acquire(len(keys))
        try:
            ok = self.ssd.get_many_into(keys, lease.writable(), restore.slot_bytes)
        except BaseException:
            lease.release()
            raise
        good = next((i for i, hit in enumerate(ok) if not hit), len(ok))
        if not good:
            lease.release()
            return RestoredRun.empty()
        return RestoredRun(lease, good)

    def _on_ssd(self, hashes: list[BlockHash], start: int) -> int:
        """How far the run of ``hashes`` from ``start`` is in the SSD index (``start`` without an SSD tier)."""
        end = start
        if self.ssd is not None:
            while end < len(hashes) and self.ssd.entry(hashes[end]) is not None:
                end += 1
        return end

    def delete_tenant(self, tenant: bytes, namespaces: frozenset[BlockHash],
                      timeout: float = 120.0) -> TierDeletion:
        """Delete tenant ``tenant`` (its tag) from the SSD tier and its ``namespaces`` from the snapshot pool.

        SSD: the writer's queued blocks of the tenant are dropped (``discard_tenant``), the writer is
        flushed (a batch it had already taken is then on disk), and ``SSDStore.delete_tenant`` rewrites
        every segment holding one of its records, fsynced (ssd/tenant_delete.py). Snapshots:
        ``delete_namespaces`` on the I/O loop, waited for up to ``timeout`` s.

        Blocking (file rewrites, Redis round trips): call it from a worker thread, never from the engine
        thread or an event loop. Mutates the writer's queue, the segment files and the index, the pool.
        Failure: OSError from the SSD tier (its entries are no longer served; a retry removes the bytes),
        the pool's error or TimeoutError from the snapshot pool; each raised after the SSD part ran.
        """
        out = TierDeletion()
        if self.writer is not None and self.ssd is not None:
            out.queued_discarded = self.writer.discard_tenant(tenant)
            if not self.writer.flush(timeout):
                raise OSError("SSD tier: the writer did not flush before the tenant deletion")
            out.ssd = self.ssd.delete_tenant(tenant)
        fut = asyncio.run_coroutine_threadsafe(self.snapshots.delete_namespaces(namespaces), self._loop)
        out.snapshots_deleted = fut.result(timeout)
        return out

    def close(self) -> None:
        """Clean shutdown: wait for pending puts and lookups, save the embedded pool's live snapshots beside
        the SSD tier (a failure to save is logged: the next start has no snapshots, never fails), close the
        pool, the I/O loop, the SSD writer (flushed) and the store."""
        for fut in list(self._pending):
            try:
                fut.result(timeout=2)
            except Exception:  # noqa: BLE001
                pass
        if self._pool_file_dir is not None:
            try:
                n = save_pool(self.snapshots, self._pool_file_dir)
                log.info("embedded snapshot pool: %d snapshots saved to %s", n, self._pool_file_dir)
            except Exception:  # noqa: BLE001 - a lost file costs misses after the restart
                log.exception("embedded snapshot pool: could not save its snapshots to %s", self._pool_file_dir)
        try:
            asyncio.run_coroutine_threadsafe(self.snapshots.close(), self._loop).result(timeout=2)
        except Exception:  # noqa: BLE001
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2)
        if self.writer is not None:
            self.writer.close(timeout=10)
        if self.ssd is not None:
            self.ssd.close()


def _release_dropped(fut: concurrent.futures.Future[TierLookup]) -> None:
    """A dropped lookup's done-callback: release its SSD images' lease (a lookup never raises; a cancelled
    one holds nothing)."""
    if not fut.cancelled() and fut.exception() is None:
        fut.result().ssd_images.release()


def _result_ok(fut: concurrent.futures.Future) -> bool:
    """A write's or put's future succeeded: ``PutResult.ok`` (SSD) or True (snapshot pool)."""
    try:
        res = fut.result()
    except Exception:  # noqa: BLE001 - a failed write is a future miss
        return False
    return res if isinstance(res, bool) else res.ok
