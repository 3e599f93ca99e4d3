"""RedisResponseStore: the response store in the configured Redis (``--redis-url``), shared by every
server that uses it, surviving restarts of the server.

    SET ft:resp:<id> <record JSON> PX <ttl ms>        put
    GET ft:resp:<id>                                  get (absent or expired: None)
    DEL ft:resp:<id>                                  delete

Redis expires the records itself. Every call runs under ``asyncio.wait_for(timeout_s)`` with client
retries off, behind the snapshot pool's ``CircuitBreaker``: after a timeout or a connection error calls
are skipped (answered as a failure at once) for a back-off, then one call probes. A failure or a skip is
counted and logged once (responses/store.py) and never raised: the request is answered, the response is
not stored, and a later ``previous_response_id`` to it is a 404. A record that does not decode is a
counted corrupt miss. The ``redis.asyncio`` client connects on the event loop that first uses it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError

from flashtier.kvstore.circuit_breaker import CircuitBreaker, Permit
from flashtier.kvstore.redis_url import parse_redis_url
from flashtier.server.response_store.store import DEFAULT_TTL_S, ResponseStore, StoredResponse, is_response_id

__all__ = ["KEY_PREFIX", "RedisResponseStore"]

KEY_PREFIX = "ft:resp:"
_FAILURES = (asyncio.TimeoutError, TimeoutError, RedisError, RedisClusterException, OSError)


class RedisResponseStore(ResponseStore):
    backend = "redis"

    def __init__(self, url: str, *, ttl_s: float = DEFAULT_TTL_S, timeout_s: float = 1.0,
                 prefix: str = KEY_PREFIX) -> None:
        super().__init__(ttl_s)
        target = parse_redis_url(url)
        common: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                      decode_responses=False)
        self._client: Redis | RedisCluster = (
            RedisCluster.from_url(target.url, **common) if target.cluster
            else Redis.from_url(target.url, retry=Retry(NoBackoff(), 0), **common))
        self.timeout_s = timeout_s
        self.prefix = prefix
        self.ttl_ms = max(1, round(self.ttl_s * 1000))
        self.breaker = CircuitBreaker(base_s=1.0, max_s=30.0)

    async def _call(self, op: str, make: Callable[[], Awaitable[Any]]) -> tuple[bool, Any]:
        """(True, result) or (False, None) with the failure (or the skip) counted."""
        permit = self.breaker.allow()
        if permit is Permit.SKIP:
            self.stats.errors[op] += 1
            return False, None
        try:
            result = await asyncio.wait_for(make(), self.timeout_s)
        except _FAILURES as exc:
            self.breaker.failed(probe=permit is Permit.PROBE)
            self._failed(op, exc)
            return False, None
        except BaseException:  # cancelled: no verdict on Redis
            if permit is Permit.PROBE:
                self.breaker.release()
            raise
        self.breaker.succeeded()
        self._ok(op)
        return True, result

    async def put(self, record: StoredResponse) -> bool:
        data = record.to_json()
        ok, _ = await self._call("put", lambda: self._client.set(self.prefix + record.id, data, px=self.ttl_ms))
        return ok

    async def get(self, response_id: str) -> StoredResponse | None:
        if not is_response_id(response_id):
            return None
        ok, raw = await self._call("get", lambda: self._client.get(self.prefix + response_id))
        if not ok or raw is None:
            return None
        try:
            return StoredResponse.from_json(raw)
        except ValueError:
            self.stats.errors["corrupt"] += 1
            return None

    async def delete(self, response_id: str) -> bool:
        if not is_response_id(response_id):
            return False
        ok, n = await self._call("delete", lambda: self._client.delete(self.prefix + response_id))
        return bool(ok and n)

    async def delete_owner(self, owner: str) -> int:
        """SCAN the records (``prefix*``), GET each, DEL those of ``owner``. Redis errors are raised (not
        counted as misses): a deletion must not look done when it is not."""
        removed = 0
        async for key in self._client.scan_iter(match=self.prefix + "*", count=500):
            raw = await self._client.get(key)
            if raw is None:
                continue
            if await asyncio.to_thread(_record_owner, raw) != owner:  # parsing: off the event loop
                continue
            removed += await self._client.delete(key)
        return removed

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._client.aclose(), self.timeout_s)
        except _FAILURES:
            pass  # closing a client whose server is gone: nothing left to release


def _record_owner(raw: bytes) -> str | None:
    """The owner of a stored record; None for one that does not parse (nobody's). Any thread."""
    try:
        return StoredResponse.from_json(raw).owner
    except ValueError:
        return None
