"""BlockPool: exact block ids and free-queue order, prefix caching, eviction, stats, a random stress run
with check_integrity after every op, and deliberate corruption that the checker must catch.
Also KVStoreConfig, whose pool_blocks() sizes the pool."""

import random

import pytest

from flashtier.kvstore.block_hash import hash_blocks, namespace_hash
from flashtier.kvstore.block_pool import BlockPool, KVBlock
from flashtier.kvstore.config import KVStoreConfig

NS = namespace_hash("pool-test", None)
BS = 4


def chain(n_blocks, start=0):
    return hash_blocks(NS, list(range(start, start + n_blocks * BS)), BS)


def ids(blocks):
    return [b.block_id for b in blocks]


def cached_request(pool, hashes):
    """Allocate len(hashes) blocks and register each under its hash (a finished prefill)."""
    blocks = pool.allocate(len(hashes))
    for b, h in zip(blocks, hashes):
        pool.cache_full_block(b, h)
    return blocks


def test_fresh_pool():
    pool = BlockPool(8)
    assert pool.num_blocks == 8 and pool.num_usable == 7 and pool.num_free == 7
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]  # block 0 is the null block, never free
    assert pool.null_block.is_null and pool.usage == 0.0
    pool.check_integrity()
    with pytest.raises(ValueError, match="null block"):
        BlockPool(1)


def test_allocate_in_lru_order_and_refuse_when_short():
    pool = BlockPool(6)
    a = pool.allocate(3)
    assert ids(a) == [1, 2, 3] and all(b.ref_cnt == 1 and b.block_hash is None for b in a)
    assert pool.num_free == 2 and pool.num_used == 3 and pool.usage == pytest.approx(3 / 5)
    assert pool.allocate(3) is None  # not now; nothing changed
    assert pool.free_block_ids() == [4, 5]
    assert pool.allocate(0) == []
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(-1)
    pool.check_integrity()


def test_free_appends_tail_first():
    pool = BlockPool(11)
    req = pool.allocate(4)  # [1, 2, 3, 4]
    pool.free(req)
    assert pool.free_block_ids() == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    assert all(b.ref_cnt == 0 for b in req)
    pool.check_integrity()


def test_shared_block_is_freed_only_at_zero():
    pool = BlockPool(6)
    a = cached_request(pool, chain(2))
    pool.touch(a[:1])  # a second request shares the first block
    pool.free(a)
    assert a[0].ref_cnt == 1 and a[1].ref_cnt == 0
    assert pool.free_block_ids() == [3, 4, 5, 2]
    pool.free(a[:1])
    assert pool.free_block_ids() == [3, 4, 5, 2, 1]
    pool.check_integrity()


def test_double_free_and_foreign_blocks_raise_without_change():
    pool = BlockPool(6)
    a = pool.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        pool.free([a[0], a[1], a[0]])
    assert [b.ref_cnt for b in a] == [1, 1] and pool.num_free == 3
    with pytest.raises(ValueError, match="does not belong"):
        pool.free([KVBlock(1)])
    with pytest.raises(ValueError, match="does not belong"):
        pool.touch([BlockPool(6).blocks[2]])
    pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free(a[:1])
    pool.check_integrity()


def test_null_block_is_skipped_as_padding():
    pool = BlockPool(4)
    a = pool.allocate(1)
    pool.touch([pool.null_block])
    pool.free([a[0], pool.null_block])
    assert pool.null_block.ref_cnt == 0 and pool.free_block_ids() == [2, 3, 1]
    with pytest.raises(ValueError, match="null block"):
        pool.cache_full_block(pool.null_block, chain(1)[0])
    pool.check_integrity()


def test_match_prefix_is_the_leading_run_and_touch_revives_cached_free_blocks():
    pool = BlockPool(10)
    hashes = chain(4)
    req = cached_request(pool, hashes)  # blocks 1..4
    pool.free(req)
    assert pool.free_block_ids() == [5, 6, 7, 8, 9, 4, 3, 2, 1]

    other = chain(1, start=1000)
    query = hashes[:2] + other + hashes[3:]  # a gap at position 2 ends the run
    hit = pool.match_prefix(query)
    assert ids(hit) == [1, 2]
    assert all(b.ref_cnt == 0 for b in hit)  # match does not touch
    assert pool.stats.queries == 4 and pool.stats.hits == 2

    pool.touch(hit)  # removed from the middle of the queue, in O(1)
    assert [b.ref_cnt for b in hit] == [1, 1]
    assert pool.free_block_ids() == [5, 6, 7, 8, 9, 4, 3]
    assert ids(pool.match_prefix(hashes, count=False)) == [1, 2, 3, 4]
    assert pool.stats.queries == 4  # count=False leaves the stats alone
    pool.check_integrity()


def test_touching_a_free_uncached_block_is_refused():
    pool = BlockPool(4)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(ValueError, match="uncached"):
        pool.touch(a)
    pool.check_integrity()


def test_reuse_evicts_cached_free_blocks_lru_first():
    pool = BlockPool(5)
    h = chain(4)
    req = cached_request(pool, h)  # blocks 1..4 hold h0..h3
    pool.free(req)  # queue: 4, 3, 2, 1 (tail first)
    new = pool.allocate(2)
    assert ids(new) == [4, 3] and all(b.block_hash is None for b in new)
    assert pool.get_cached_block(h[3]) is None and pool.get_cached_block(h[2]) is None
    assert ids(pool.match_prefix(h)) == [1, 2]  # the head of the prefix survives
    assert pool.stats.evictions == 2 and pool.num_cached == 2
    pool.check_integrity()


def test_cache_full_block_duplicates_and_errors():
    pool = BlockPool(6)
    h0, h1 = chain(2)
    a, b = pool.allocate(2)
    assert pool.cache_full_block(a, h0) is True
    assert pool.cache_full_block(a, h0) is True  # idempotent
    assert pool.cache_full_block(b, h0) is False  # duplicate: the indexed block stays canonical
    assert b.block_hash is None and pool.get_cached_block(h0) is a
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_full_block(a, h1)
    pool.free([b])
    with pytest.raises(ValueError, match="is free"):
        pool.cache_full_block(b, h1)
    pool.free([a])
    assert pool.free_block_ids() == [3, 4, 5, 2, 1]
    assert ids(pool.allocate(4)) == [3, 4, 5, 2]  # the unhashed duplicate goes before the cached block
    assert pool.get_cached_block(h0) is a
    pool.check_integrity()


def test_caching_disabled():
    pool = BlockPool(4, enable_caching=False)
    a = pool.allocate(2)
    assert pool.cache_full_block(a[0], chain(1)[0]) is False
    assert pool.match_prefix(chain(1)) == [] and pool.num_cached == 0
    pool.check_integrity()


def test_evict_cached_and_reset_prefix_cache():
    pool = BlockPool(8)
    h = chain(4)
    req = cached_request(pool, h)
    pool.free(req)  # queue: 5, 6, 7, 4, 3, 2, 1
    assert pool.evict_cached(2) == [h[3], h[2]]
    assert pool.free_block_ids() == [5, 6, 7, 4, 3, 2, 1]  # order kept, only hashes dropped
    assert pool.num_cached == 2 and pool.stats.evictions == 2
    assert pool.evict_cached(0) == []
    pool.check_integrity()

    held = pool.allocate(1)
    assert pool.reset_prefix_cache() is False and pool.num_cached == 2  # a block is in use
    pool.free(held)
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached == 0 and pool.match_prefix(h) == [] and pool.stats.evictions == 2
    pool.check_integrity()


# ---- randomized stress ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [1234, 7, 99])
def test_random_ops_keep_every_invariant(seed):
    """Thousands of random allocate / free / touch / cache / match / evict ops; audit after every one."""
    rng = random.Random(seed)
    pool = BlockPool(24)
    prompts = [[rng.randrange(3) for _ in range(BS * 6)] for _ in range(5)]  # tiny alphabet: many shared prefixes
    chains = [hash_blocks(NS, p, BS) for p in prompts]
    requests = []  # (blocks, chain, n_cached): what a manager would hold per running request
    ops = 0
    for _ in range(4000):
        op = rng.random()
        if op < 0.35:  # admit: prefix hit, touch, allocate the rest
            c = chains[rng.randrange(len(chains))][: rng.randint(1, 6)]
            hit = pool.match_prefix(c)
            need = len(c) - len(hit) + rng.randint(0, 1)  # maybe a partial tail block
            pool.touch(hit)
            new = pool.allocate(need)
            if new is None:
                pool.free(hit)
            else:
                requests.append([hit + new, c, len(hit)])
        elif op < 0.55 and requests:  # a prefill step completes some full blocks
            r = requests[rng.randrange(len(requests))]
            blocks, c, done = r
            upto = rng.randint(done, len(c))
            for k in range(done, upto):
                pool.cache_full_block(blocks[k], c[k])
            r[2] = upto
        elif op < 0.85 and requests:  # finish or abort
            pool.free(requests.pop(rng.randrange(len(requests)))[0])
        elif op < 0.92:
            pool.evict_cached(rng.randint(0, 3))
        elif op < 0.94:  # sometimes drain first, so the reset can succeed
            if rng.random() < 0.3:
                while requests:
                    pool.free(requests.pop()[0])
            idle = pool.num_used == 0
            assert pool.reset_prefix_cache() is idle
            assert pool.num_cached == 0 or not idle
        else:  # a second holder of a random in-use prefix (n > 1 sharing)
            if requests:
                blocks, c, done = requests[rng.randrange(len(requests))]
                pool.touch(blocks[:done])
                requests.append([list(blocks[:done]), c[:done], done])
        pool.check_integrity()
        ops += 1
        holders = {}
        for blocks, _, _ in requests:
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        assert all(b.ref_cnt == holders.get(b.block_id, 0) for b in pool.blocks[1:])
    for blocks, _, _ in requests:
        pool.free(blocks)
    pool.check_integrity()
    assert pool.num_used == 0 and pool.num_free == pool.num_usable
    assert ops == 4000 and pool.stats.hits > 0 and pool.stats.evictions > 0


# ---- the checker must be able to fail ---------------------------------------------------------------
def _busy_pool():
    pool = BlockPool(8)
    req = cached_request(pool, chain(3))  # blocks 1..3 cached in use
    other = pool.allocate(2)  # blocks 4, 5 in use, unhashed
    pool.free(req[2:])  # block 3: cached free
    pool.check_integrity()
    return pool, req, other


def _ref_zero_not_queued(pool, req, other):
    other[0].ref_cnt = 0


def _queued_but_referenced(pool, req, other):
    req[2].ref_cnt = 1


def _negative_ref(pool, req, other):
    other[0].ref_cnt = -1


def _hash_not_indexed(pool, req, other):
    other[0].block_hash = chain(1, start=500)[0]


def _index_points_elsewhere(pool, req, other):
    pool._index[req[0].block_hash] = req[1]


def _same_hash_on_two_blocks(pool, req, other):
    other[1].block_hash = req[0].block_hash


def _broken_back_link(pool, req, other):
    req[2].prev_free = pool.blocks[6]


def _stale_queue_length(pool, req, other):
    pool._free._len += 1


def _null_block_used(pool, req, other):
    pool.null_block.ref_cnt = 1


def _block_id_mismatch(pool, req, other):
    pool.blocks[7].block_id = 6


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_ref_zero_not_queued, "ref_cnt 0 but is not in the free queue"),
        (_queued_but_referenced, "but is linked in the free queue"),
        (_negative_ref, "negative ref_cnt"),
        (_hash_not_indexed, "the index does not map it"),
        (_index_points_elsewhere, "which carries"),
        (_same_hash_on_two_blocks, "the index does not map it"),
        (_broken_back_link, "does not point back"),
        (_stale_queue_length, "len"),
        (_null_block_used, "null block is not idle"),
        (_block_id_mismatch, r"blocks\[7\] has block_id 6"),
    ],
)
def test_check_integrity_catches_corruption(corrupt, message):
    pool, req, other = _busy_pool()
    corrupt(pool, req, other)
    with pytest.raises(RuntimeError, match=message):
        pool.check_integrity()


# ---- KVStoreConfig ----------------------------------------------------------------------------------
def test_config_defaults_and_pool_sizing():
    cfg = KVStoreConfig()
    assert cfg.block_size == 64 and not cfg.ssd_enabled and cfg.ssd_lifetime_s == 72 * 3600
    assert cfg.pool_blocks(56960, available_bytes=56960 * 100) == 90  # 0.9 of the available bytes
    assert KVStoreConfig(num_blocks=17).pool_blocks(56960) == 17
    assert KVStoreConfig(hbm_budget_bytes=56960 * 10 + 5).pool_blocks(56960) == 10
    with pytest.raises(ValueError, match="available_bytes"):
        cfg.pool_blocks(56960)
    with pytest.raises(ValueError, match="at least 2"):
        KVStoreConfig(hbm_budget_bytes=1000).pool_blocks(56960)
    with pytest.raises(AttributeError):
        cfg.block_size = 128  # frozen


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": 60}, "multiple of 8"),
        ({"block_size": 0}, "multiple of 8"),
        ({"num_blocks": 1}, "null block"),
        ({"num_blocks": 10, "hbm_budget_bytes": 10}, "only one"),
        ({"hbm_utilization": 1.5}, "hbm_utilization"),
        ({"ssd_segment_bytes": 2 << 30, "ssd_budget_bytes": 1 << 30}, "ssd_segment_bytes"),
        ({"ssd_refresh_age_s": 80 * 3600.0}, "ssd_refresh_age_s"),
        ({"snapshot_ttl_s": 0}, "snapshot_ttl_s"),
        ({"ssd_dir": ""}, "ssd_dir"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVStoreConfig(**kwargs)
