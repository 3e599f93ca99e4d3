"""SnapshotPool: the async interface of the encoder-snapshot tier, and ``EmbeddedSnapshotPool``.

The snapshot tier is a best-effort cache with a short TTL (DESIGN.md §5): a snapshot that is not there
costs a bounded replay, never a failed request. So no operation of a pool raises for a storage failure:
``put`` answers False, ``get`` None, ``points`` {}, ``points_many`` a list of {} and ``delete`` False,
and ``stats()`` counts why.
ValueError is raised only for wrong arguments (a programming error).

Two implementations share this interface:
- ``EmbeddedSnapshotPool`` (here): in-process, used when no ``--redis-url`` is given; TTL on an injectable
  clock and a byte budget with LRU eviction.
- ``RedisSnapshotPool`` (snapshot/redis_pool.py): Redis or Redis Cluster through ``redis.asyncio``.

Directory semantics (both pools): one directory per (namespace, last full block hash) maps
tail_len -> tail hash hex. A put overwrites the field of its tail_len and refreshes the directory's TTL,
so a directory may list a point whose snapshot is gone (evicted by Redis); ``get`` of it is a plain miss.
"""

from __future__ import annotations

import abc
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.snapshot.key import HEADER_BYTES, SnapshotKey


@dataclass(slots=True)
class SnapshotStats:
    """Monotonic counters of one pool (``redis_down`` is a gauge); ``SnapshotPool.stats()`` returns a copy.

    Per call of the interface exactly one outcome is counted: a ``get`` is a hit, miss, error or corrupt;
    a ``put`` a put or a put failure. A call skipped by the Redis pool's circuit breaker is an error /
    put failure there too, and its Redis call is counted in ``skipped_by_op`` instead of ``redis_errors``.
    """

    puts: int = 0  # snapshots stored
    put_failures: int = 0  # puts answered False (too big, pool down or slow, Redis refused)
    hits: int = 0  # get() results, one per call ...
    misses: int = 0  # ... absent (never written, expired, evicted, flushed)
    errors: int = 0  # ... the pool failed or timed out (also a miss for the caller)
    corrupt: int = 0  # ... a stored value failed validation (also a miss; the value is dropped)
    bytes_written: int = 0  # encoded bytes (header + payload) of stored snapshots
    bytes_read: int = 0  # encoded bytes of hits
    redis_errors: int = 0  # failed Redis calls of any operation, timeouts included
    timeouts: int = 0  # Redis calls that exceeded redis_timeout_s (a subset of redis_errors)
    evictions: int = 0  # embedded pool: snapshots dropped (LRU) to fit the byte budget
    expirations: int = 0  # embedded pool: snapshots dropped because their TTL passed
    # Redis pool, by operation (put, get, points, points_many, delete, unlink); empty for the embedded pool
    errors_by_op: dict[str, int] = field(default_factory=dict)  # failed calls other than timeouts
    timeouts_by_op: dict[str, int] = field(default_factory=dict)  # calls over redis_timeout_s
    skipped_by_op: dict[str, int] = field(default_factory=dict)  # not sent: the circuit breaker was open
    breaker_opens: int = 0  # Redis pool: times Redis was found down (the circuit breaker opened)
    redis_down: int = 0  # gauge, Redis pool: 1 while the circuit breaker is open (calls are skipped)
    redis_calls: int = 0  # Redis pool: round trips sent (skipped calls excluded), whatever their outcome
    redis_call_s: float = 0.0  # Redis pool: their summed duration (mean latency = redis_call_s / redis_calls)

    @property
    def lookups(self) -> int:
        return self.hits + self.misses + self.errors + self.corrupt


def _check_key(key: object) -> SnapshotKey:
    if not isinstance(key, SnapshotKey):
        raise ValueError(f"a snapshot key must be a SnapshotKey, got {type(key).__name__}")
    return key


def _check_payload(payload: object) -> bytes:
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, (bytearray, memoryview)):
        return bytes(payload)  # an immutable copy: the caller may reuse its buffer
    raise ValueError(f"a snapshot payload must be bytes, got {type(payload).__name__}")


def _check_dir(namespace: object, block_hash: object) -> None:
    if not isinstance(namespace, BlockHash) or not isinstance(block_hash, BlockHash):
        raise ValueError("points() needs two BlockHash values (namespace root, last full block hash)")


def _check_dirs(namespace: object, block_hashes: object) -> list[BlockHash]:
    if isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes, Sequence):
        raise ValueError(f"points_many() needs a sequence of BlockHash values, got {type(block_hashes).__name__}")
    if not isinstance(namespace, BlockHash) or not all(isinstance(h, BlockHash) for h in block_hashes):
        raise ValueError("points_many() needs BlockHash values (namespace root, last full block hashes)")
    return list(block_hashes)


def _check_namespaces(namespaces: object) -> frozenset[BlockHash]:
    if isinstance(namespaces, (str, bytes)) or not isinstance(namespaces, Collection):
        raise ValueError(f"delete_namespaces() needs a collection of BlockHash values, got {type(namespaces).__name__}")
    if not all(isinstance(ns, BlockHash) for ns in namespaces):
        raise ValueError("delete_namespaces() needs BlockHash values (namespace roots)")
    return frozenset(namespaces)


class SnapshotPool(abc.ABC):
    """Async store of encoder snapshots keyed by ``SnapshotKey``; failures are counted misses, never raised.

    Every method is a coroutine except ``stats()``, a cheap synchronous copy of the counters that a
    metrics collector may call from any thread.
    """

    def __init__(self) -> None:
        self._stats = SnapshotStats()

    @abc.abstractmethod
    async def put(self, key: SnapshotKey, payload: bytes) -> bool:
        """Store ``payload`` under ``key`` with the pool's TTL and list it in its directory.

        Replaces an existing value of the same key and restarts its TTL. False (counted in
        ``put_failures``) when it was not stored: larger than the pool can hold, pool down, slow or full.
        """

    @abc.abstractmethod
    async def get(self, key: SnapshotKey) -> bytes | None:
        """The payload of ``key``, or None (a miss, an error or a corrupt value: each counted)."""

    @abc.abstractmethod
    async def points(self, namespace: BlockHash, block_hash: BlockHash) -> dict[int, str]:
        """The directory after ``block_hash``: {tail_len: tail hash hex}; {} when none or on failure."""

    async def points_many(self, namespace: BlockHash, block_hashes: Sequence[BlockHash]) -> list[dict[int, str]]:
        """``[points(namespace, h) for h in block_hashes]`` in one round trip under one deadline.

        Both pools override it (the Redis pool with one pipeline). Failure: a list of empty dicts, the
        failure counted once. ValueError for an argument that is not a BlockHash. This default (for other
        subclasses) calls ``points`` once per hash.
        """
        _check_dirs(namespace, block_hashes)
        return [await self.points(namespace, h) for h in block_hashes]

    @abc.abstractmethod
    async def delete(self, key: SnapshotKey) -> bool:
        """Remove ``key`` (and its directory field if it still names this tail hash); True if it existed."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections/memory. Later calls behave as a pool that is down (counted failures)."""

    async def delete_namespaces(self, namespaces: Collection[BlockHash]) -> int:
        """Remove every snapshot (and directory) whose key's namespace root is one of ``namespaces``: a tenant's
        deletion (its namespaces: the engine's ``tenant_namespaces``). Returns the snapshots removed.

        Unlike the other operations a failure is raised (the pool's error, or RuntimeError for a closed
        pool): an operator's deletion must not look done when it is not. ValueError for a namespace that
        is not a BlockHash. Both pools override it; this default raises NotImplementedError.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot delete by namespace")

    def stats(self) -> SnapshotStats:
        st = self._stats
        return replace(st, errors_by_op=dict(st.errors_by_op), timeouts_by_op=dict(st.timeouts_by_op),
                       skipped_by_op=dict(st.skipped_by_op))  # fmt: skip


@dataclass(slots=True)
class _Entry:
    payload: bytes
    expires_at: float


class EmbeddedSnapshotPool(SnapshotPool):
    """In-process pool with the Redis pool's semantics: per-key TTL, a byte budget, LRU eviction.

    - TTL: an entry lives ``ttl_s`` from its (last) put on ``clock`` (``time.monotonic`` by default);
      ``get`` does not extend it, like Redis ``GET``. Expired entries are dropped lazily (on access and
      at every put, oldest first) and counted in ``expirations``.
    - Budget: the encoded size (header + payload) of all entries stays <= ``budget_bytes``. A put that
      does not fit evicts least-recently-used entries (``get`` and ``put`` refresh recency) and counts
      ``evictions``; a value larger than the whole budget is refused (False). A V4.1-Flash payload is
      ~11.4 MiB (engine/tiers/snapshot_codec.py, replay tail included): the default 4 GiB holds ~360.
    - Directory fields are removed together with the entry they name, so ``points`` lists live entries only.
    - Locking: one ``threading.Lock`` guards all state; it is held only for in-memory work (never across
      an ``await``), so the pool is safe from the event loop and from other threads at once.
    """

    def __init__(self, ttl_s: float, budget_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if not ttl_s > 0:
            raise ValueError(f"EmbeddedSnapshotPool ttl_s must be > 0, got {ttl_s!r}")
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"EmbeddedSnapshotPool budget_bytes must be a positive int, got {budget_bytes!r}")
        self.ttl_s = float(ttl_s)
        self.budget_bytes = budget_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._lru: OrderedDict[SnapshotKey, _Entry] = OrderedDict()  # least recently used first
        self._by_put: OrderedDict[SnapshotKey, None] = OrderedDict()  # oldest put (= earliest expiry) first
        self._dirs: dict[tuple[BlockHash, BlockHash], dict[int, SnapshotKey]] = {}
        self._bytes = 0
        self._closed = False

    @classmethod
    def from_config(cls, config: KVStoreConfig, clock: Callable[[], float] = time.monotonic) -> EmbeddedSnapshotPool:
        return cls(config.snapshot_ttl_s, config.snapshot_budget_bytes, clock)

    @property
    def bytes_used(self) -> int:
        """Encoded bytes held now (expired entries not yet dropped included)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._lru)

    # -- internal, all called with self._lock held ------------------------------------------------------

    def _remove(self, key: SnapshotKey) -> None:
        entry = self._lru.pop(key)
        del self._by_put[key]
        self._bytes -= HEADER_BYTES + len(entry.payload)
        d = self._dirs.get((key.namespace, key.block_hash))
        if d is not None and d.get(key.tail_len) == key:
            del d[key.tail_len]
            if not d:
                del self._dirs[(key.namespace, key.block_hash)]

    def _expire(self, now: float) -> None:
        while self._by_put:
            key = next(iter(self._by_put))
            if self._lru[key].expires_at > now:
                break
            self._remove(key)
            self._stats.expirations += 1

    def _live(self, key: SnapshotKey, now: float) -> _Entry | None:
        entry = self._lru.get(key)
        if entry is not None and entry.expires_at <= now:
            self._remove(key)
            self._stats.expirations += 1
            return None
        return entry

    def _points_locked(self, namespace: BlockHash, block_hash: BlockHash) -> dict[int, str]:
        d = self._dirs.get((namespace, block_hash), {})
        return {tail_len: key.tail_hash.hex() for tail_len, key in sorted(d.items())}

    def check_integrity(self) -> None:
        """RuntimeError if the byte count, the two orders or the directories disagree (tests call it)."""
        with self._lock:
            total = sum(HEADER_BYTES + len(e.payload) for e in self._lru.values())
            if total != self._bytes or total > self.budget_bytes:
                raise RuntimeError(f"bytes_used {self._bytes} != sum of entries {total} (budget {self.budget_bytes})")
            if set(self._lru) != set(self._by_put):
                raise RuntimeError("LRU order and expiry order hold different keys")
            for (ns, bh), d in self._dirs.items():
                for tail_len, key in d.items():
                    if key not in self._lru or (key.namespace, key.block_hash, key.tail_len) != (ns, bh, tail_len):
                        raise RuntimeError(f"directory field {tail_len} names a missing or foreign key {key}")

    # -- the interface ------------------------------------------------------------------------------------

    async def put(self, key: SnapshotKey, payload: bytes) -> bool:
        key, payload = _check_key(key), _check_payload(payload)
        size = HEADER_BYTES + len(payload)
        with self._lock:
            if self._closed or size > self.budget_bytes:
                self._stats.put_failures += 1
                return False
            now = self._clock()
            self._expire(now)
            if key in self._lru:
                self._remove(key)
            while self._bytes + size > self.budget_bytes:
                self._remove(next(iter(self._lru)))
                self._stats.evictions += 1
            self._lru[key] = _Entry(payload, now + self.ttl_s)
            self._by_put[key] = None
            self._bytes += size
            self._dirs.setdefault((key.namespace, key.block_hash), {})[key.tail_len] = key
            self._stats.puts += 1
            self._stats.bytes_written += size
            return True

    async def get(self, key: SnapshotKey) -> bytes | None:
        key = _check_key(key)
        with self._lock:
            if self._closed:
                self._stats.errors += 1
                return None
            entry = self._live(key, self._clock())
            if entry is None:
                self._stats.misses += 1
                return None
            self._lru.move_to_end(key)
            self._stats.hits += 1
            self._stats.bytes_read += HEADER_BYTES + len(entry.payload)
            return entry.payload

    async def points(self, namespace: BlockHash, block_hash: BlockHash) -> dict[int, str]:
        _check_dir(namespace, block_hash)
        with self._lock:
            if self._closed:
                return {}
            self._expire(self._clock())
            return self._points_locked(namespace, block_hash)

    async def points_many(self, namespace: BlockHash, block_hashes: Sequence[BlockHash]) -> list[dict[int, str]]:
        hashes = _check_dirs(namespace, block_hashes)
        with self._lock:
            if self._closed:
                return [{} for _ in hashes]
            self._expire(self._clock())
            return [self._points_locked(namespace, h) for h in hashes]

    async def delete(self, key: SnapshotKey) -> bool:
        key = _check_key(key)
        with self._lock:
            if self._closed or self._live(key, self._clock()) is None:
                return False
            self._remove(key)
            return True

    async def delete_namespaces(self, namespaces: Collection[BlockHash]) -> int:
        """See ``SnapshotPool.delete_namespaces``. Mutates the entries, both orders and the directories under
        the lock, in one pass over the entries (O(snapshots held): the byte budget bounds them to hundreds).
        RuntimeError on a closed pool (nothing is held then)."""
        wanted = _check_namespaces(namespaces)
        with self._lock:
            if self._closed:
                raise RuntimeError("the snapshot pool is closed")
            victims = [key for key in self._lru if key.namespace in wanted]
            for key in victims:
                self._remove(key)
            return len(victims)

    def live_entries(self) -> list[tuple[SnapshotKey, bytes, float]]:
        """(key, payload, seconds of TTL left) of every live entry, least recently used first (what
        kvstore/snapshot/persist.py saves at a clean shutdown). Mutates: drops expired entries (counted in
        ``expirations``). Empty once closed."""
        with self._lock:
            if self._closed:
                return []
            now = self._clock()
            self._expire(now)
            return [(key, e.payload, e.expires_at - now) for key, e in self._lru.items()]

    def restore_entry(self, key: SnapshotKey, payload: bytes, ttl_left_s: float) -> bool:
        """Insert a snapshot an earlier process saved, with ``ttl_left_s`` (capped at ``ttl_s``) of its TTL
        left: its expiry is not restarted. Otherwise a ``put`` (budget, LRU eviction, directory, counted as
        a put). False, and nothing stored, when no TTL is left, the pool is closed or the value is larger
        than the budget. ValueError for a key or payload of the wrong type."""
        key, payload = _check_key(key), _check_payload(payload)
        size = HEADER_BYTES + len(payload)
        with self._lock:
            if self._closed or size > self.budget_bytes or not ttl_left_s > 0:
                return False
            now = self._clock()
            if key in self._lru:
                self._remove(key)
            while self._bytes + size > self.budget_bytes:
                self._remove(next(iter(self._lru)))
                self._stats.evictions += 1
            expires_at = now + min(ttl_left_s, self.ttl_s)
            self._lru[key] = _Entry(payload, expires_at)
            # ``_by_put`` must stay in expiry order: restored in expiry order (persist.py), each goes last at once
            later = [] if not self._by_put or self._lru[next(reversed(self._by_put))].expires_at <= expires_at else [
                k for k in self._by_put if self._lru[k].expires_at > expires_at]
            self._by_put[key] = None
            for k in later:
                self._by_put.move_to_end(k)
            self._bytes += size
            self._dirs.setdefault((key.namespace, key.block_hash), {})[key.tail_len] = key
            self._stats.puts += 1
            self._stats.bytes_written += size
            return True

    async def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lru.clear()
            self._by_put.clear()
            self._dirs.clear()
            self._bytes = 0
