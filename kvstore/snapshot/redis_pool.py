"""RedisSnapshotPool: the snapshot tier on Redis or Redis Cluster (``redis.asyncio``, hiredis parser).

Writes (one round trip, MULTI/EXEC; both keys carry the hash tag ``{ns:block}`` so Redis Cluster puts
them on one slot and accepts the transaction)::

    SET     ft:snap:{ns:block}:<tail_len>:<tail>  <header+payload>  PX ttl     value and TTL in one command
    HSET    ft:snapdir:{ns:block}  <tail_len> <tail hex>
    PEXPIRE ft:snapdir:{ns:block}  ttl                                          directory outlives its points

Reads: GET of a point; HGETALL of one directory (``points``) or of many in one non-transactional
pipeline (``points_many``: one round trip, one deadline, however many block boundaries a lookup probes).

Failure behaviour: every Redis call runs under ``asyncio.wait_for(timeout=redis_timeout_s)`` with
client retries off; a timeout, a connection error or a Redis error reply makes the call a counted miss
(``get`` None, ``put`` False, ``points`` {}, ``points_many`` all {}), never an exception. Counters are
kept per operation (put, get, points, points_many, delete, unlink), timeouts apart from other errors. A timed-out call
drops its connection (redis-py disconnects a connection cancelled mid-reply), so a slow server cannot
desynchronise the pool. Redis eviction (``maxmemory`` with a volatile policy) or FLUSHALL simply makes
keys absent: plain misses. A value that fails ``Snapshot.decode`` is a counted corrupt miss and is
deleted (best effort).

Circuit breaker (circuit_breaker.py): a timeout or a connection failure marks Redis down. For the
back-off (``breaker_base_s``, doubling after each failed probe up to ``breaker_max_s``, reset on
success) every call is skipped, answered as a miss at once and counted in ``skipped_by_op``; then one
call probes. A Redis error *reply* (OOM, WRONGTYPE, ...) proves the server is up and does not trip it.
The log says it once per transition: WARNING when Redis goes down (or is unreachable at the first call),
WARNING "back" when a call succeeds again; a refused operation is logged when it starts being refused.

Value size: a V4.1-Flash snapshot is ~11.4 MiB (engine/tiers/snapshot_codec.py; the replay tail is 10 MiB of
it), far below ``max_value_bytes`` (Redis' 512 MB ``proto-max-bulk-len``; a larger put is refused and
counted in ``put_failures`` before anything is sent). It must also cross the network within
``timeout_s``: ~0.1 s on 1 GbE, ~10 ms on 10 GbE or loopback; on a slower link raise the timeout.

Concurrency: a ``redis.asyncio`` client belongs to the event loop that first uses it; call one pool from
one loop. The counters are plain ints updated on that loop.

Redis Cluster (``redis+cluster://host:port``) goes through ``redis.asyncio.cluster.RedisCluster`` and
the same code; it is not exercised by the tests (no cluster is available there), only its URL parsing is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ClusterError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.circuit_breaker import CircuitBreaker, Permit
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.redis_url import parse_redis_url
from flashtier.kvstore.snapshot.key import (HEADER_BYTES, Snapshot, SnapshotCorrupt, SnapshotKey, directory_key,
                                            namespace_patterns)
from flashtier.kvstore.snapshot.pool import (
    EmbeddedSnapshotPool,
    SnapshotPool,
    SnapshotStats,
    _check_dir,
    _check_dirs,
    _check_key,
    _check_namespaces,
    _check_payload,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

REDIS_MAX_VALUE_BYTES = 512 * 1024 * 1024  # Redis' default proto-max-bulk-len
REDIS_OPS = ("put", "get", "points", "points_many", "delete", "unlink")  # the per-operation counter labels
_TIMEOUTS = (asyncio.TimeoutError, TimeoutError, RedisTimeoutError)  # our bound, or the socket's
_DOWN = (RedisError, RedisClusterException, OSError)  # cluster set-up errors are not RedisErrors

# DEL the snapshot; HDEL its directory field only if it still names this tail hash (another put of the
# same tail_len with other tokens may have taken the field over). Both keys are on one cluster slot.
_DELETE_LUA = """
local n = redis.call('DEL', KEYS[1])
if redis.call('HGET', KEYS[2], ARGV[1]) == ARGV[2] then redis.call('HDEL', KEYS[2], ARGV[1]) end
return n
"""


class RedisSnapshotPool(SnapshotPool):
    """``SnapshotPool`` on Redis: one key per snapshot with ``SET ... PX``, plus a directory hash per block.

    Mutates only Redis (and its own counters). No call raises for a Redis failure; see the module doc.
    """

    def __init__(self, url: str, *, ttl_s: float = 300.0, timeout_s: float = 0.25,
                 max_value_bytes: int = REDIS_MAX_VALUE_BYTES, breaker_base_s: float = 1.0,
                 breaker_max_s: float = 30.0) -> None:  # fmt: skip
        super().__init__()
        if not ttl_s > 0:
            raise ValueError(f"RedisSnapshotPool ttl_s must be > 0, got {ttl_s!r}")
        if not timeout_s > 0:
            raise ValueError(f"RedisSnapshotPool timeout_s must be > 0, got {timeout_s!r}")
        if not max_value_bytes > HEADER_BYTES:
            raise ValueError(f"RedisSnapshotPool max_value_bytes must exceed the {HEADER_BYTES} B header")
        self.target = parse_redis_url(url)
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.timeout_s = float(timeout_s)
        self.max_value_bytes = max_value_bytes
        self.breaker = CircuitBreaker(base_s=breaker_base_s, max_s=breaker_max_s)
        common = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=False)
        self._client: Redis | RedisCluster
        if self.target.cluster:  # cluster retries follow MOVED/ASK redirections; wait_for still bounds them
            self._client = RedisCluster.from_url(self.target.url, **common)
        else:
            self._client = Redis.from_url(self.target.url, retry=Retry(NoBackoff(), 0), **common)
        parts = urlsplit(self.target.url)
        self._where = parts.path if self.target.url.startswith("unix:") else f"{parts.hostname}:{parts.port or 6379}"
        for counts in (self._stats.errors_by_op, self._stats.timeouts_by_op, self._stats.skipped_by_op):
            counts.update(dict.fromkeys(REDIS_OPS, 0))
        self._ever_up = False
        self._refused: set[str] = set()  # operations whose last answer was a Redis error reply
        self._closed = False

    @classmethod
    def from_config(cls, config: KVStoreConfig) -> RedisSnapshotPool:
        if config.redis_url is None:
            raise ValueError("KVStoreConfig.redis_url is None; use EmbeddedSnapshotPool (snapshot_pool_from_config)")
        return cls(config.redis_url, ttl_s=config.snapshot_ttl_s, timeout_s=config.redis_timeout_s)

    @property
    def is_cluster(self) -> bool:
        return self.target.cluster

    def stats(self) -> SnapshotStats:
        st = super().stats()
        st.breaker_opens, st.redis_down = self.breaker.opens, int(self.breaker.is_open)
        return st

    async def _call(self, op: str, make: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
        """One Redis round trip ``make()`` under the timeout and the circuit breaker: (True, result), or
        (False, None) with the failure (or the skip) counted under ``op`` and a transition logged."""
        st = self._stats
        permit = Permit.SKIP if self._closed else self.breaker.allow()
        if permit is Permit.SKIP:
            if self._closed:
                st.redis_errors += 1
                st.errors_by_op[op] += 1
            else:
                st.skipped_by_op[op] += 1
            return False, None
        started = time.monotonic()
        try:
            result = await asyncio.wait_for(make(), self.timeout_s)
        except _TIMEOUTS as exc:
            st.redis_errors, st.timeouts = st.redis_errors + 1, st.timeouts + 1
            st.timeouts_by_op[op] += 1
            self._down(op, exc, permit)
            return False, None
        except _DOWN as exc:
            st.redis_errors += 1
            st.errors_by_op[op] += 1
            if isinstance(exc, ResponseError) and not isinstance(exc, ClusterError):
                self._up()  # an error reply: Redis is there, it refused this command
                self._refuse(op, exc)
            else:
                self._down(op, exc, permit)
            return False, None
        except BaseException:  # cancelled: no verdict on Redis
            if permit is Permit.PROBE:
                self.breaker.release()
            raise
        finally:
            st.redis_calls, st.redis_call_s = st.redis_calls + 1, st.redis_call_s + time.monotonic() - started
        self._up()
        self._refused.discard(op)
        return True, result

    def _down(self, op: str, exc: BaseException, permit: Permit) -> None:
        if self.breaker.failed(probe=permit is Permit.PROBE):
            state = "went down" if self._ever_up else "is unreachable"
            log.warning("redis snapshot pool %s %s (%s: %s: %s); snapshots are misses and calls are skipped for "
                        "%.0f s, then probed", self._where, state, op, type(exc).__name__, exc,
                        self.breaker.backoff_s)  # fmt: skip

    def _up(self) -> None:
        self._ever_up = True
        if self.breaker.succeeded():
            log.warning("redis snapshot pool %s is back", self._where)

    def _refuse(self, op: str, exc: ResponseError) -> None:
        if op not in self._refused:
            self._refused.add(op)
            log.warning("redis snapshot pool %s refused %s (%s); counted as a miss", self._where, op, exc)

    async def _put_tx(self, key: SnapshotKey, value: bytes) -> list:
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.set(key.redis_key(), value, px=self.ttl_ms)
            pipe.hset(key.directory_key(), str(key.tail_len), key.tail_hash.hex())
            pipe.pexpire(key.directory_key(), self.ttl_ms)
            return await pipe.execute()

    async def put(self, key: SnapshotKey, payload: bytes) -> bool:
        key, payload = _check_key(key), _check_payload(payload)
        if HEADER_BYTES + len(payload) > self.max_value_bytes:
            self._stats.put_failures += 1
            return False
        value = Snapshot(key, payload).encode()
        ok, _ = await self._call("put", lambda: self._put_tx(key, value))
        if not ok:
            self._stats.put_failures += 1
            return False
        self._stats.puts += 1
        self._stats.bytes_written += len(value)
        return True

    async def get(self, key: SnapshotKey) -> bytes | None:
        key = _check_key(key)
        ok, value = await self._call("get", lambda: self._client.get(key.redis_key()))
        if not ok:
            self._stats.errors += 1
            return None
        if value is None:
            self._stats.misses += 1
            return None
        try:
            snap = Snapshot.decode(value, expected=key)
        except SnapshotCorrupt as exc:
            self._stats.corrupt += 1
            log.warning("dropping corrupt snapshot %s: %s", key.redis_key(), exc)
            await self._call("unlink", lambda: self._client.unlink(key.redis_key()))
            return None
        self._stats.hits += 1
        self._stats.bytes_read += len(value)
        return snap.payload

    async def points(self, namespace: BlockHash, block_hash: BlockHash) -> dict[int, str]:
        _check_dir(namespace, block_hash)
        ok, raw = await self._call("points", lambda: self._client.hgetall(directory_key(namespace, block_hash)))
        return _directory(raw) if ok else {}

    async def points_many(self, namespace: BlockHash, block_hashes: Sequence[BlockHash]) -> list[dict[int, str]]:
        """The directories of ``block_hashes`` from one non-transactional pipeline of HGETALLs: one round
        trip (Redis Cluster: one per node, sent concurrently) under one ``timeout_s``. Failure (timeout,
        connection, breaker open): all empty, counted once under ``points_many``. A key whose reply is an
        error (not a hash) is {} and the call counts one error; the other keys are answered."""
        hashes = _check_dirs(namespace, block_hashes)
        if not hashes:
            return []
        keys = [directory_key(namespace, h) for h in hashes]
        ok, replies = await self._call("points_many", lambda: self._hgetall_many(keys))
        if not ok:
            return [{} for _ in hashes]
        bad = [r for r in replies if isinstance(r, Exception)]
        if bad:
            self._stats.redis_errors += 1
            self._stats.errors_by_op["points_many"] += 1
            if isinstance(bad[0], ResponseError):
                self._refuse("points_many", bad[0])
        return [{} if isinstance(r, Exception) else _directory(r) for r in replies]

    async def _hgetall_many(self, keys: list[str]) -> list:
        async with self._client.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.hgetall(k)
            return await pipe.execute(raise_on_error=False)

    async def delete(self, key: SnapshotKey) -> bool:
        key = _check_key(key)
        args = (key.redis_key(), key.directory_key(), str(key.tail_len), key.tail_hash.hex())
        ok, n = await self._call("delete", lambda: self._client.eval(_DELETE_LUA, 2, *args))
        return bool(ok and n)

    async def delete_namespaces(self, namespaces: Collection[BlockHash]) -> int:
        """See ``SnapshotPool.delete_namespaces``: for each namespace, ``SCAN MATCH`` over the keys of its
        points and directories (``ft:snap:{<ns hex>:*``, ``ft:snapdir:{<ns hex>:*``: the namespace is the
        first half of the hash tag, snapshot/key.py), then ``UNLINK`` in batches. One SCAN pass per
        namespace; each round trip under ``timeout_s``. On Redis Cluster ``scan_iter`` walks every primary.

        Mutates Redis only. Failure: the Redis error (or TimeoutError) is raised, not counted as a miss;
        the keys unlinked before it are gone. The circuit breaker is bypassed: an operator's deletion
        asks Redis even while lookups skip it. RuntimeError on a closed pool.
        """
        wanted = _check_namespaces(namespaces)
        if self._closed:
            raise RuntimeError("the snapshot pool is closed")
        removed = 0
        for ns in sorted(wanted, key=lambda h: h.digest):
            points, directories = namespace_patterns(ns)
            for pattern, counts in ((points, True), (directories, False)):
                batch: list[bytes] = []
                scan = self._client.scan_iter(match=pattern, count=1000)
                while True:
                    try:
                        key = await asyncio.wait_for(anext(scan), self.timeout_s)
                    except StopAsyncIteration:
                        break
                    batch.append(key)
                    if len(batch) >= 500:
                        n = await self._unlink(batch)
                        removed += n if counts else 0
                        batch = []
                if batch:
                    n = await self._unlink(batch)
                    removed += n if counts else 0
        return removed

    async def _unlink(self, keys: list[bytes]) -> int:
        """UNLINK ``keys`` (one per call on a cluster: keys of several slots); the number that existed."""
        if self.target.cluster:
            return sum([await asyncio.wait_for(self._client.unlink(k), self.timeout_s) for k in keys])
        return await asyncio.wait_for(self._client.unlink(*keys), self.timeout_s)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(self._client.aclose(), self.timeout_s)
        except (*_TIMEOUTS, *_DOWN) as exc:
            log.info("closing the redis snapshot pool: %s: %s", type(exc).__name__, exc)


def _directory(raw: dict | None) -> dict[int, str]:
    """A directory hash's reply as {tail_len: tail hash hex}, sorted; a field this module did not write
    is skipped, not trusted."""
    out: dict[int, str] = {}
    for field, value in (raw or {}).items():
        try:
            tail_len, tail_hex = int(field), value.decode("ascii")
            BlockHash.from_hex(tail_hex)
        except (ValueError, AttributeError):
            continue
        if tail_len >= 0 and tail_hex == tail_hex.lower():
            out[tail_len] = tail_hex
    return dict(sorted(out.items()))


def snapshot_pool_from_config(config: KVStoreConfig) -> SnapshotPool:
    """The pool ``config`` asks for: Redis when ``redis_url`` is set, else the embedded pool."""
    if config.redis_url is None:
        return EmbeddedSnapshotPool.from_config(config)
    return RedisSnapshotPool.from_config(config)
