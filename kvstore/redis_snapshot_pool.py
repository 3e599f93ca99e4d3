"""RedisSnapshotPool: the snapshot tier on Redis or Redis Cluster (``redis.asyncio``, hiredis parser).

Writes (one round trip, MULTI/EXEC; both keys carry the hash tag ``{ns:block}`` so Redis Cluster puts
them on one slot and accepts the transaction)::

    SET     ft:snap:{ns:block}:<tail_len>:<tail>  <header+payload>  PX ttl     value and TTL in one command
    HSET    ft:snapdir:{ns:block}  <tail_len> <tail hex>
    PEXPIRE ft:snapdir:{ns:block}  ttl                                          directory outlives its points

Failure behaviour: every Redis call runs under ``asyncio.wait_for(timeout=redis_timeout_s)`` with
client retries off; a timeout, a connection error or a Redis error reply makes the call a counted miss
(``get`` None, ``put`` False, ``points`` {}), never an exception. A timed-out call drops its connection
(redis-py disconnects a connection cancelled mid-reply), so a slow server cannot desynchronise the pool.
Redis eviction (``maxmemory`` with a volatile policy) or FLUSHALL simply makes keys absent: plain misses.
A value that fails ``Snapshot.decode`` is a counted corrupt miss and is deleted (best effort).

Concurrency: a ``redis.asyncio`` client belongs to the event loop that first uses it; call one pool from
one loop. The counters are plain ints updated on that loop.

Redis Cluster (``redis+cluster://host:port``) goes through ``redis.asyncio.cluster.RedisCluster`` and
the same code; it is not exercised by the tests (no cluster is available there), only its URL parsing is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.snapshot import HEADER_BYTES, Snapshot, SnapshotCorrupt, SnapshotKey, directory_key
from flashtier.kvstore.snapshot_pool import EmbeddedSnapshotPool, SnapshotPool, _check_dir, _check_key, _check_payload

log = logging.getLogger(__name__)
T = TypeVar("T")

REDIS_MAX_VALUE_BYTES = 512 * 1024 * 1024  # Redis' default proto-max-bulk-len
_SCHEMES = {"redis": ("redis", False), "rediss": ("rediss", False), "unix": ("unix", False),
            "redis+cluster": ("redis", True), "rediss+cluster": ("rediss", True)}  # fmt: skip

# DEL the snapshot; HDEL its directory field only if it still names this tail hash (another put of the
# same tail_len with other tokens may have taken the field over). Both keys are on one cluster slot.
_DELETE_LUA = """
local n = redis.call('DEL', KEYS[1])
if redis.call('HGET', KEYS[2], ARGV[1]) == ARGV[2] then redis.call('HDEL', KEYS[2], ARGV[1]) end
return n
"""


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed ``--redis-url``: the URL redis-py gets, and whether it names a Redis Cluster."""

    url: str  # redis://, rediss:// or unix:// (the "+cluster" suffix removed)
    cluster: bool


def parse_redis_url(url: str) -> RedisTarget:
    """``redis://``, ``rediss://``, ``unix://`` (a server) or ``redis+cluster://`` / ``rediss+cluster://``.

    ValueError, naming the problem, for another scheme, a missing host or socket path, a bad port or a
    cluster URL that selects a database other than 0 (Redis Cluster has only db 0).
    """
    if not isinstance(url, str) or not url:
        raise ValueError(f"redis_url must be a non-empty string, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"redis_url {url!r}: scheme must be one of {sorted(_SCHEMES)}")
    scheme, cluster = _SCHEMES[parts.scheme]
    if scheme == "unix":
        if not parts.path:
            raise ValueError(f"redis_url {url!r}: a unix:// URL needs a socket path")
    else:
        if not parts.hostname:
            raise ValueError(f"redis_url {url!r}: no host")
        try:
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError as exc:
            raise ValueError(f"redis_url {url!r}: {exc}") from None
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"redis_url {url!r}: the path must be a database number, got {db!r}")
        if cluster and db not in ("", "0"):
            raise ValueError(f"redis_url {url!r}: Redis Cluster has only database 0")
    return RedisTarget(scheme + ":" + url.split(":", 1)[1], cluster)  # only the scheme changes


class RedisSnapshotPool(SnapshotPool):
    """``SnapshotPool`` on Redis: one key per snapshot with ``SET ... PX``, plus a directory hash per block.

    Mutates only Redis (and its own counters). No call raises for a Redis failure; see the module doc.
    """

    def __init__(self, url: str, *, ttl_s: float = 300.0, timeout_s: float = 0.25,
                 max_value_bytes: int = REDIS_MAX_VALUE_BYTES) -> None:  # fmt: skip
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
        common = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=False)
        self._client: Redis | RedisCluster
        if self.target.cluster:  # cluster retries follow MOVED/ASK redirections; wait_for still bounds them
            self._client = RedisCluster.from_url(self.target.url, **common)
        else:
            self._client = Redis.from_url(self.target.url, retry=Retry(NoBackoff(), 0), **common)
        self._healthy = True
        self._closed = False

    @classmethod
    def from_config(cls, config: KVStoreConfig) -> RedisSnapshotPool:
        if config.redis_url is None:
            raise ValueError("KVStoreConfig.redis_url is None; use EmbeddedSnapshotPool (snapshot_pool_from_config)")
        return cls(config.redis_url, ttl_s=config.snapshot_ttl_s, timeout_s=config.redis_timeout_s)

    @property
    def is_cluster(self) -> bool:
        return self.target.cluster

    async def _call(self, op: str, aw: Awaitable[T]) -> tuple[bool, T | None]:
        """Run one Redis round trip under the timeout: (True, result) or (False, None) with the error counted."""
        if self._closed:
            if asyncio.iscoroutine(aw):
                aw.close()
            self._stats.redis_errors += 1
            return False, None
        try:
            result = await asyncio.wait_for(aw, self.timeout_s)
        except (asyncio.TimeoutError, TimeoutError, RedisTimeoutError) as exc:  # our bound, or the socket's
            self._stats.timeouts += 1
            self._failed(op, exc)
            return False, None
        except (RedisError, RedisClusterException, OSError) as exc:  # cluster set-up errors are not RedisErrors
            self._failed(op, exc)
            return False, None
        if not self._healthy:
            self._healthy = True
            log.info("redis snapshot pool is reachable again")
        return True, result

    def _failed(self, op: str, exc: BaseException) -> None:
        self._stats.redis_errors += 1
        if self._healthy:  # log the transition, not every failed call (the counters carry the rate)
            self._healthy = False
            log.warning("redis snapshot pool unavailable (%s: %s: %s); snapshots are misses until it returns",
                        op, type(exc).__name__, exc)  # fmt: skip

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
        ok, _ = await self._call("put", self._put_tx(key, value))
        if not ok:
            self._stats.put_failures += 1
            return False
        self._stats.puts += 1
        self._stats.bytes_written += len(value)
        return True

    async def get(self, key: SnapshotKey) -> bytes | None:
        key = _check_key(key)
        ok, value = await self._call("get", self._client.get(key.redis_key()))
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
            await self._call("unlink corrupt", self._client.unlink(key.redis_key()))
            return None
        self._stats.hits += 1
        self._stats.bytes_read += len(value)
        return snap.payload

    async def points(self, namespace: BlockHash, block_hash: BlockHash) -> dict[int, str]:
        _check_dir(namespace, block_hash)
        ok, raw = await self._call("points", self._client.hgetall(directory_key(namespace, block_hash)))
        out: dict[int, str] = {}
        for field, value in (raw or {}).items() if ok else ():
            try:  # a field this module did not write is skipped, not trusted
                tail_len, tail_hex = int(field), value.decode("ascii")
                BlockHash.from_hex(tail_hex)
            except ValueError:
                continue
            if tail_len >= 0 and tail_hex == tail_hex.lower():
                out[tail_len] = tail_hex
        return dict(sorted(out.items()))

    async def delete(self, key: SnapshotKey) -> bool:
        key = _check_key(key)
        aw = self._client.eval(_DELETE_LUA, 2, key.redis_key(), key.directory_key(),
                               str(key.tail_len), key.tail_hash.hex())  # fmt: skip
        ok, n = await self._call("delete", aw)
        return bool(ok and n)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(self._client.aclose(), self.timeout_s)
        except (asyncio.TimeoutError, TimeoutError, RedisError, RedisClusterException, OSError) as exc:
            log.info("closing the redis snapshot pool: %s: %s", type(exc).__name__, exc)


def snapshot_pool_from_config(config: KVStoreConfig) -> SnapshotPool:
    """The pool ``config`` asks for: Redis when ``redis_url`` is set, else the embedded pool."""
    if config.redis_url is None:
        return EmbeddedSnapshotPool.from_config(config)
    return RedisSnapshotPool.from_config(config)
