"""Tier fault counters on /metrics: labelled families from ``name{label=value}`` keys, and the whole path
from a real TierManager (SSD writes failing with ENOSPC, a stopped redis-server behind the snapshot pool)
through engine_stats.tier_stats to the Prometheus exposition, old names included."""

import errno
import os
import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flashtier.engine.engine_stats import split_tier_key, tier_key, tier_stats
from flashtier.engine.core.outputs import EngineStats
from flashtier.engine.tiers.manager import TierManager
from flashtier.kvstore.block_hash import BlockHash, namespace_hash
from flashtier.kvstore.circuit_breaker import CircuitBreaker
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.snapshot.key import SnapshotKey
from flashtier.server.serving.metrics import ServerMetrics

from ..kvstore.redis_server import RedisServer


def scrape(tiers: dict[str, float]) -> tuple[dict, dict]:
    """(samples keyed by (name, labels without model_name), family name -> type) of one exposition."""
    metrics = ServerMetrics("m", stats=lambda: EngineStats(tiers=tiers))
    samples, types = {}, {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return samples, types


def test_tier_keys_round_trip():
    assert tier_key("ssd_write_errors", cause="io") == "ssd_write_errors{cause=io}"
    assert split_tier_key("ssd_write_errors{cause=io}") == ("ssd_write_errors", (("cause", "io"),))
    assert split_tier_key(tier_key("x", a="1", b="2")) == ("x", (("a", "1"), ("b", "2")))
    assert split_tier_key("ssd_bytes") == ("ssd_bytes", ())
    assert split_tier_key("odd{novalue}") == ("odd{novalue}", ())


def test_labelled_keys_become_one_family_and_gauges_stay_gauges():
    samples, types = scrape({"ssd_write_errors{cause=disk_full}": 3.0, "ssd_write_errors{cause=io}": 1.0,
                             "ssd_write_errors{other=x}": 9.0,  # another label set: left out
                             "snapshot_redis_down": 1.0, "ssd_segments": 4.0, "ssd_read_errors": 2.0})  # fmt: skip
    assert samples[("flashtier_ssd_write_errors_total", (("cause", "disk_full"),))] == 3
    assert samples[("flashtier_ssd_write_errors_total", (("cause", "io"),))] == 1
    assert not any(labels == (("other", "x"),) for _, labels in samples)
    assert samples[("flashtier_snapshot_redis_down", ())] == 1 and samples[("flashtier_ssd_segments", ())] == 4
    assert samples[("flashtier_ssd_read_errors_total", ())] == 2
    assert types["flashtier_ssd_write_errors"] == "counter" and types["flashtier_snapshot_redis_down"] == "gauge"


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert predicate()


def test_a_real_tier_manager_exports_its_faults_by_cause(tmp_path, monkeypatch):
    redis = RedisServer().start()
    config = KVStoreConfig(ssd_dir=str(tmp_path / "kv"), ssd_budget_bytes=1 << 20, ssd_segment_bytes=1 << 16,
                           redis_url=redis.url, redis_timeout_s=0.2)  # fmt: skip
    tm = TierManager(config)
    try:
        blocks = [BlockHash(bytes([i]) * 16) for i in range(4)]
        assert tm.ssd.put(blocks[0], b"x" * 100).ok and tm.ssd.flush()
        real_pwrite = os.pwrite

        def full(*args):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "pwrite", full)
        assert [tm.ssd.put(b, b"y" * 100).ok for b in blocks[1:]] == [False] * 3
        monkeypatch.setattr(os, "pwrite", real_pwrite)
        ns = namespace_hash("metrics-test", None)
        redis.stop()
        tm.snapshots.breaker = CircuitBreaker(base_s=30.0, max_s=30.0)  # no probe during the test, however slow
        for salt in range(3):  # the first put fails, the breaker skips the next two
            tm.put_snapshot(SnapshotKey.for_tail(ns, ns, [salt]), b"payload")
            wait_for(lambda n=salt + 1: tm.snapshots.stats().put_failures == n)
        samples, types = scrape(tier_stats(tm))
    finally:
        tm.close()
        redis.close()
    assert samples[("flashtier_ssd_write_errors_total", (("cause", "disk_full"),))] == 3
    assert samples[("flashtier_ssd_write_errors_total", (("cause", "io"),))] == 0
    assert samples[("flashtier_ssd_write_errors_total", (("cause", "unwritable"),))] == 0
    assert samples[("flashtier_ssd_admission_refusals_total", ())] == 0
    assert samples[("flashtier_ssd_read_errors_total", ())] == 0
    assert samples[("flashtier_ssd_entries", ())] == 1 and samples[("flashtier_ssd_segments", ())] == 1
    for name in ("torn_bytes", "compactions", "refreshes", "writer_dropped", "corrupt_records", "hits"):
        assert samples[(f"flashtier_ssd_{name}_total", ())] == 0, name
    assert samples[("flashtier_snapshot_redis_op_errors_total", (("op", "put"),))] == 1
    assert samples[("flashtier_snapshot_redis_skipped_total", (("op", "put"),))] == 2
    assert samples[("flashtier_snapshot_redis_op_timeouts_total", (("op", "get"),))] == 0
    assert samples[("flashtier_snapshot_redis_breaker_opens_total", ())] == 1
    assert samples[("flashtier_snapshot_redis_down", ())] == 1
    assert samples[("flashtier_snapshot_put_failures_total", ())] == 3
    assert samples[("flashtier_snapshot_redis_errors_total", ())] == 1
    assert samples[("flashtier_snapshot_puts_total", ())] == 3  # the engine side: puts it asked for
    assert types["flashtier_ssd_oldest_entry_age_seconds"] == "gauge" and types["flashtier_ssd_bytes"] == "gauge"
