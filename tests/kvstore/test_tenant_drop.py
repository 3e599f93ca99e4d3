"""Deleting a tenant below the engine: the HBM prefix index (``BlockPool.drop_tenant``), the snapshot pools
(``delete_namespaces``: embedded, and a real redis-server on loopback), and which namespaces a tenant owns
(engine/tenant_registry.py)."""

from __future__ import annotations

import asyncio

import pytest

from flashtier.engine.tenant_registry import TenantNamespaces
from flashtier.kvstore.block_hash import hash_blocks, namespace_hash, replayed_namespace
from flashtier.kvstore.block_pool import BlockPool, TenantDrop
from flashtier.kvstore.snapshot.key import SnapshotKey
from flashtier.kvstore.snapshot.pool import EmbeddedSnapshotPool
from flashtier.kvstore.snapshot.redis_pool import RedisSnapshotPool
from flashtier.kvstore.tenant import api_key_tenant, tenant_tag

from .redis_server import RedisServer

A, B = tenant_tag("acme"), tenant_tag("other")


def _cached(pool: BlockPool, salt: str, tag: bytes | None, n: int, seed: int):
    """``n`` allocated blocks cached under a chain of namespace ``salt`` for tenant ``tag`` (still in use)."""
    hashes = hash_blocks(namespace_hash("fp", salt), list(range(seed, seed + 4 * n)), 4)
    blocks = pool.allocate(n)
    for b, h in zip(blocks, hashes):
        assert pool.cache_full_block(b, h, tag)
    return blocks, hashes


def test_drop_tenant_removes_only_that_tenants_cached_blocks_and_spares_blocks_in_use():
    pool = BlockPool(32)
    a_free, a_hashes = _cached(pool, "acme", A, 4, 0)
    a_used, a_used_hashes = _cached(pool, "acme", A, 3, 100)
    b_blocks, b_hashes = _cached(pool, "other", B, 4, 0)
    unknown, unknown_hashes = _cached(pool, "legacy", None, 2, 0)
    pool.free(a_free)
    pool.free(b_blocks)
    assert len(pool.match_prefix(a_hashes)) == 4  # a hit before: the deletion below can fail
    before_free = pool.num_free
    assert pool.drop_tenant(A) == TenantDrop(free_blocks=4, in_use_blocks=3)
    pool.check_integrity()
    assert pool.match_prefix(a_hashes) == [] and pool.match_prefix(a_used_hashes) == []
    assert pool.match_prefix(b_hashes) == b_blocks and pool.match_prefix(unknown_hashes) == unknown
    assert pool.num_free == before_free  # nothing freed or allocated: only hashes went
    assert [b.ref_cnt for b in a_used] == [1, 1, 1] and all(b.block_hash is None for b in a_used)
    assert pool.stats.tenant_drops == 7 and pool.stats.evictions == 0
    pool.free(a_used)  # the running request finishes: its blocks are plain free space
    pool.check_integrity()
    assert pool.match_prefix(a_used_hashes) == []
    assert pool.drop_tenant(A) == TenantDrop(0, 0)
    with pytest.raises(ValueError):
        pool.touch(a_used)  # uncached free blocks can no longer be shared


def test_reuse_of_a_dropped_hash_by_another_block_is_fine():
    pool = BlockPool(8)
    blocks, hashes = _cached(pool, "acme", A, 2, 0)
    pool.drop_tenant(A)
    again = pool.allocate(2)
    for b, h in zip(again, hashes):  # the tenant's next request caches the same prefix anew
        assert pool.cache_full_block(b, h, A)
    pool.free(blocks)
    pool.check_integrity()
    assert pool.match_prefix(hashes) == again


def _key(ns: str, i: int) -> SnapshotKey:
    root = namespace_hash("fp", ns)
    return SnapshotKey.for_tail(root, hash_blocks(root, list(range(i, i + 4)), 4)[0], [1, 2])


def test_embedded_pool_deletes_every_snapshot_of_the_namespaces():
    pool = EmbeddedSnapshotPool(300.0, 1 << 20)

    async def go():
        for i in range(3):
            assert await pool.put(_key("acme", i), b"a" * 10)
            assert await pool.put(_key("other", i), b"b" * 10)
        ns = {namespace_hash("fp", "acme"), replayed_namespace(namespace_hash("fp", "acme"))}
        assert await pool.delete_namespaces(ns) == 3
        pool.check_integrity()
        assert [await pool.get(_key("acme", i)) for i in range(3)] == [None] * 3
        assert [await pool.get(_key("other", i)) for i in range(3)] == [b"b" * 10] * 3
        assert await pool.points(_key("acme", 0).namespace, _key("acme", 0).block_hash) == {}
        with pytest.raises(ValueError):
            await pool.delete_namespaces(["not a hash"])
        await pool.close()
        with pytest.raises(RuntimeError):
            await pool.delete_namespaces(ns)

    asyncio.run(go())


def test_redis_pool_deletes_points_and_directories_of_the_namespaces():
    with RedisServer() as server:
        client = server.client()

        async def go():
            pool = RedisSnapshotPool(server.url, timeout_s=5.0)
            try:
                for i in range(600):  # more than one UNLINK batch for one namespace
                    assert await pool.put(_key("acme", i), b"a")
                for i in range(3):
                    assert await pool.put(_key("other", i), b"b")
                assert await pool.delete_namespaces({namespace_hash("fp", "acme")}) == 600
                assert [await pool.get(_key("other", i)) for i in range(3)] == [b"b"] * 3
                assert await pool.get(_key("acme", 7)) is None
            finally:
                await pool.close()

        asyncio.run(go())
        acme = namespace_hash("fp", "acme").hex()
        left = [k.decode() for k in client.scan_iter(count=1000)]
        assert not [k for k in left if acme in k]  # no point and no directory of the namespace remains
        assert len([k for k in left if k.startswith("ft:snap:")]) == 3
        assert len([k for k in left if k.startswith("ft:snapdir:")]) == 3


def test_redis_pool_deletion_raises_when_redis_is_gone():
    with RedisServer() as server:
        url = server.url
        server.stop()

        async def go():
            pool = RedisSnapshotPool(url, timeout_s=1.0)
            try:
                with pytest.raises(Exception) as info:
                    await pool.delete_namespaces({namespace_hash("fp", "acme")})
                assert not isinstance(info.value, AssertionError)
            finally:
                await pool.close()

        asyncio.run(go())


def test_tenant_namespaces_cover_computed_and_recorded_salts():
    reg = TenantNamespaces()
    hexa = api_key_tenant("key-a")
    salted = namespace_hash("fp", f"{hexa}\x00s1")
    reg.record(f"{hexa}\x00s1", salted)
    reg.record(f"{hexa}\x00", namespace_hash("fp", f"{hexa}\x00"))  # computable: not recorded
    reg.record("acme", namespace_hash("fp", "acme"))
    got = reg.namespaces("fp", hexa)
    assert {salted, namespace_hash("fp", f"{hexa}\x00"), replayed_namespace(salted)} <= got
    assert namespace_hash("fp", "acme") not in got
    assert namespace_hash("fp", "acme") in reg.namespaces("fp", "acme")
    assert reg.namespaces("fp", None) >= {namespace_hash("fp", None)}
    reg.forget(hexa)
    assert salted not in reg.namespaces("fp", hexa)
