"""``persisted_bytes`` counts only what became durable: fsynced SSD records and snapshots an
out-of-process pool (Redis) confirmed (every payload byte, replay tail included); nothing for an
embedded pool or with the SSD tier off."""

import torch

from flashtier.engine.kv.manager import CachedBlock
from flashtier.engine.core.request import Request
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.tiers.snapshot_codec import payload_size
from flashtier.engine.tiers.client import TierClient
from flashtier.engine.tiers.manager import TierManager
from flashtier.kvstore.block_hash import hash_blocks
from flashtier.kvstore.config import KVStoreConfig

from ..kvstore.redis_server import RedisServer
from .scheduler_harness import NAMESPACE, Harness, prompt_of


def _written(tmp_path, *, ssd: bool, redis_url: str | None = None) -> tuple[int, int]:
    h = Harness(block_size=8)
    cfg = KVStoreConfig(block_size=8, num_blocks=32, ssd_dir=str(tmp_path / "ssd") if ssd else None,
                        redis_url=redis_url)
    tiers = TierManager(cfg)
    client = TierClient(tiers, h.kvm)
    req = Request("p", prompt_of(24), SamplingParams(), namespace=NAMESPACE)
    seq = h.scheduler.new_sequence(req, 0)
    assert h.kvm.ensure_blocks(seq.kv, 25)
    seq.kv.tokens = prompt_of(25)
    hc, dim = h.spec.stream_shape  # a full replay tail: the snapshot's largest part in the real geometry
    seq.kv.tail_x, seq.kv.tail_pre = torch.ones(h.spec.window, hc, dim), torch.ones(h.spec.window, hc)
    hashes = hash_blocks(NAMESPACE, prompt_of(24), 8)
    client.write_through(req, [CachedBlock(b, hh) for b, hh in zip(seq.kv.table.ids, hashes)])
    seq.hashes = hashes
    client.snapshot(req, seq)
    tiers.close()  # flushes the writer and waits for pending puts
    return req.persisted.value, h.kvm.layout.block_bytes


def test_ssd_blocks_count_once_durable_and_embedded_snapshots_never(tmp_path):
    value, block_bytes = _written(tmp_path, ssd=True)
    assert value == 3 * block_bytes


def test_nothing_is_persisted_without_the_ssd_tier(tmp_path):
    assert _written(tmp_path, ssd=False)[0] == 0


def test_redis_snapshots_count_when_redis_confirmed(tmp_path):
    server = RedisServer().start()
    try:
        value, block_bytes = _written(tmp_path, ssd=False, redis_url=server.url)
        spec = Harness(block_size=8).spec
        absent = len(spec.partial_order) * 2 * spec.head_dim * 4  # no ratio-2 group is pending
        assert value == payload_size(spec, block_bytes).total - absent  # rings, replay tail, tail block
    finally:
        server.stop()
