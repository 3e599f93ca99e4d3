"""The response store: what ``previous_response_id``, ``item_reference`` and ``GET /v1/responses/{id}`` read.

One record per stored response (``StoredResponse``): the response object as it was returned, and the
conversation before its output (the earlier turns and this request's input items, references resolved;
instructions are not part of it). The next turn's conversation is ``input_items + response["output"]``:
one read, however long the chain. A record lives ``--response-store-ttl`` (default 24 h) after it was
written; ``DELETE`` removes it at once.

Backends (``open_response_store``):

    --redis-url set   RedisResponseStore   key ft:resp:<id>, SET ... PX ttl (responses/store_redis.py)
    else, a KV dir    DiskResponseStore    <kv-dir>/responses/<id>.json, atomic writes (responses/store_disk.py)
    --no-kv-persist   MemoryResponseStore  this process only (lost at a restart), bounded

Failure behaviour, every backend: a store that cannot be read or written never fails a request. ``put``
answers False, ``get`` None (the response is then simply unknown: 404), ``delete`` False; each failure
is counted in ``stats`` and logged once when the backend starts failing (and once when it recovers).
Only ids this server makes (``resp_`` + 32 hex digits) are looked up: any other id is unknown at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from flashtier.server.config.settings import ServerSettings

__all__ = ["MemoryResponseStore", "ResponseStore", "StoredResponse", "is_response_id", "open_response_store"]

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 24 * 3600.0
_ID = re.compile(r"^resp_[0-9a-f]{32}$")


def is_response_id(value: str) -> bool:
    """True for the ids this server makes (the only ones a backend may turn into a key or a file name)."""
    return bool(_ID.match(value))


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as returned
    input_items: list[dict[str, Any]]  # the conversation before the output (instructions excluded)
    owner: str | None = None  # the tenant that may read it (responses/route.py); None: any client

    @property
    def id(self) -> str:
        return self.response["id"]

    def conversation(self) -> list[dict[str, Any]]:
        """The input items of a turn that continues this response."""
        return [*self.input_items, *self.response.get("output", [])]

    def to_json(self) -> bytes:
        return json.dumps({"v": 1, "response": self.response, "input_items": self.input_items, "owner": self.owner},
                          ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes) -> StoredResponse:
        """ValueError for anything that is not a record this module wrote."""
        data = json.loads(raw)
        if (not isinstance(data, dict) or data.get("v") != 1 or not isinstance(data.get("response"), dict)
                or not isinstance(data.get("input_items"), list)
                or not isinstance(data.get("owner"), (str, type(None)))):
            raise ValueError("not a stored response record")
        return cls(data["response"], data["input_items"], data.get("owner"))


@dataclass
class StoreStats:
    """Counters, by operation (put | get | delete)."""

    ops: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)


class ResponseStore:
    """The interface, and the failure bookkeeping the backends share; see the module doc."""

    backend = "none"

    def __init__(self, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError(f"the response store TTL must be > 0, got {ttl_s!r}")
        self.ttl_s = float(ttl_s)
        self.stats = StoreStats()
        self._failing = False

    async def put(self, record: StoredResponse) -> bool:
        raise NotImplementedError

    async def get(self, response_id: str) -> StoredResponse | None:
        raise NotImplementedError

    async def delete(self, response_id: str) -> bool:
        raise NotImplementedError

    async def delete_owner(self, owner: str) -> int:
        """Remove every record of ``owner`` (server/response_store/owner.py), gone from the backend's storage
        when it returns; the number removed. Failure: OSError / the backend's error, raised (an operator's
        deletion must not look done when it is not)."""
        raise NotImplementedError

    async def close(self) -> None:
        return None

    def _failed(self, op: str, exc: BaseException) -> None:
        """Count a failure; log it when the backend was working until now."""
        self.stats.errors[op] += 1
        if not self._failing:
            self._failing = True
            logger.warning("response store (%s) is failing (%s: %s: %s); responses are answered but not "
                           "stored or found until it recovers", self.backend, op, type(exc).__name__, exc)

    def _ok(self, op: str) -> None:
        self.stats.ops[op] += 1
        if self._failing:
            self._failing = False
            logger.warning("response store (%s) works again", self.backend)


class MemoryResponseStore(ResponseStore):
    """In this process only, at most `max_entries` records (the oldest go first). Never fails."""

    backend = "memory"

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_entries: int = 10_000) -> None:
        super().__init__(ttl_s)
        self.max_entries = max_entries
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    async def put(self, record: StoredResponse) -> bool:
        self._records[record.id] = (time.monotonic() + self.ttl_s, record.to_json())
        self._records.move_to_end(record.id)
        while len(self._records) > self.max_entries:
            self._records.popitem(last=False)
        self._ok("put")
        return True

    async def get(self, response_id: str) -> StoredResponse | None:
        self._ok("get")
        entry = self._records.get(response_id)
        if entry is None:
            return None
        if entry[0] <= time.monotonic():
            del self._records[response_id]
            return None
        return StoredResponse.from_json(entry[1])

    async def delete(self, response_id: str) -> bool:
        self._ok("delete")
        return self._records.pop(response_id, None) is not None

    async def delete_owner(self, owner: str) -> int:
        """The records are parsed on a worker thread (the loop only copies the references), then the
        owner's are removed on the loop; a record replaced meanwhile is kept (it is a new one)."""
        items = list(self._records.items())
        gone = await asyncio.to_thread(_owned_by, items, owner)
        removed = 0
        for rid, entry in gone:
            if self._records.get(rid) is entry:
                del self._records[rid]
                removed += 1
        return removed


def _owned_by(items: list[tuple[str, tuple[float, bytes]]], owner: str) -> list[tuple[str, tuple[float, bytes]]]:
    """The entries whose record belongs to ``owner`` (unparseable ones are nobody's). Any thread."""
    out = []
    for rid, entry in items:
        try:
            if StoredResponse.from_json(entry[1]).owner == owner:
                out.append((rid, entry))
        except ValueError:
            continue
    return out


def open_response_store(settings: ServerSettings) -> ResponseStore:
    """The backend `settings` ask for (see the module doc). Touches nothing yet: the disk backend creates
    its directory at the first write, the Redis one connects at the first call."""
    # imported here: both backends import this module
    from flashtier.server.response_store.disk_store import DiskResponseStore
    from flashtier.server.response_store.redis_store import RedisResponseStore

    ttl = settings.response_store_ttl_s
    if settings.kvstore.redis_url:
        return RedisResponseStore(settings.kvstore.redis_url, ttl_s=ttl)
    if settings.kvstore.ssd_dir:
        return DiskResponseStore(settings.kvstore.ssd_dir, ttl_s=ttl)
    return MemoryResponseStore(ttl_s=ttl)
