"""A tenant's identity is derived exactly as the server derives it, and the response store deletes one
owner's stored conversations in every backend (memory, disk, a real redis-server on loopback)."""

from __future__ import annotations

import asyncio

import pytest

from flashtier.kvstore.tenant import api_key_tenant, salt_tenant, tag_of_salt, tenant_tag
from flashtier.server.response_store.disk_store import DiskResponseStore
from flashtier.server.response_store.owner import OWNER_DOMAIN, response_owner
from flashtier.server.response_store.redis_store import RedisResponseStore
from flashtier.server.response_store.store import MemoryResponseStore, StoredResponse
from flashtier.server.responses import route
from flashtier.server.serving.state import TENANT_DOMAIN, tenant_salt

from ..kvstore.redis_server import RedisServer


def test_tenant_of_a_key_is_the_servers_per_key_salt_prefix():
    for client_salt in (None, "", "project-1"):
        salt = tenant_salt("sk-abc", client_salt)  # what the engine gets under --cache-isolation per-key
        assert salt_tenant(salt) == api_key_tenant("sk-abc")
        assert tag_of_salt(salt) == tenant_tag(api_key_tenant("sk-abc"))
    assert TENANT_DOMAIN == b"flashtier/tenant/v1\x00"
    assert tag_of_salt("acme") == tenant_tag("acme") != tag_of_salt(None) != tag_of_salt("")
    assert api_key_tenant("sk-abc") != api_key_tenant("sk-abd")


def test_owner_of_a_key_is_the_responses_routes():
    assert OWNER_DOMAIN == route.OWNER_DOMAIN
    import hashlib
    assert response_owner("sk-abc") == hashlib.sha256(route.OWNER_DOMAIN + b"sk-abc").hexdigest()


def records() -> list[StoredResponse]:
    owners = [response_owner("sk-gone"), response_owner("sk-kept"), None, response_owner("sk-gone")]
    return [StoredResponse({"id": f"resp_{n:032x}", "output": []}, [{"role": "user", "content": f"turn {n}"}], o)
            for n, o in enumerate(owners)]


async def exercise(store) -> None:
    for r in records():
        assert await store.put(r)
    assert await store.delete_owner(response_owner("sk-gone")) == 2
    found = [await store.get(r.id) is not None for r in records()]
    assert found == [False, True, True, False]
    assert await store.delete_owner(response_owner("sk-gone")) == 0


@pytest.mark.parametrize("backend", ["memory", "disk"])
def test_delete_owner_local_backends(backend, tmp_path):
    store = MemoryResponseStore() if backend == "memory" else DiskResponseStore(tmp_path)
    asyncio.run(exercise(store))
    if backend == "disk":
        assert not any(b"turn 0" in p.read_bytes() for p in (tmp_path / "responses").iterdir())


def test_delete_owner_redis():
    with RedisServer() as server:
        async def go() -> None:
            store = RedisResponseStore(server.url)
            try:
                await exercise(store)
            finally:
                await store.close()
        asyncio.run(go())
