"""The evidence reading of benchmarks/returning_turn_bench.py (benchmarks/_turn_evidence.py): /metrics samples from
the server's real registry before and after a turn, usage built by the server's own ``usage_dict``, the checks
that a turn took its path (each wrong path detected), the budget fit and the prompts."""

import pytest

from _turn_evidence import evidence, fit_prompt, moved, problems, prompt_ids, scrape

from flashtier.engine.core.outputs import CacheUsage, EngineStats, ResumeInfo
from flashtier.server.serving.state import usage_dict

BLOCK_BYTES, SNAPSHOT_BYTES = 56_960, 11_929_319  # real geometry: one 64-token block; one snapshot payload


def _registry_turn(tiers_after: dict[str, float], cached: dict[str, int], kind: str, queue_s: float):
    """(before, after) scrapes of a real ServerMetrics around one turn that moved these counters."""
    from prometheus_client import generate_latest

    from flashtier.server.serving.metrics import ServerMetrics

    tiers = {"ssd_blocks_written": 40.0, "ssd_bytes_read": 0.0, "ssd_bytes": 1e6}
    m = ServerMetrics("flashtier tiny", stats=lambda: EngineStats(tiers=dict(tiers)))  # a name with a space
    m.queue_time.observe(0.5)  # an earlier request
    before = scrape(generate_latest(m.registry).decode())
    tiers.update(tiers_after)
    for tier, n in cached.items():
        m.cached[tier].inc(n)
    m.resumes[kind].inc()
    m.queue_time.observe(queue_s)
    m.ttft.observe(0.25)
    return before, scrape(generate_latest(m.registry).decode())


def _hit(**over) -> tuple[dict, dict]:
    """A 100K-token hit: 1,562 SSD blocks, the 32-token tail from the snapshot, then ``over`` applied."""
    ssd = 1562 * 64
    cache = CacheUsage(cached_tokens=ssd + 32, ssd_tokens=ssd, snapshot_tokens=32, decoder_tokens=128,
                       computed_tokens=100)
    usage = usage_dict(100_100, 1, 0, over.pop("cache", cache), over.pop("resume", ResumeInfo("exact")))
    delta = {"flashtier_ssd_blocks_loaded_total": 1562.0, "flashtier_snapshot_lookup_hit_total": 1.0,
             "flashtier_ssd_bytes_read_total": 1562.0 * BLOCK_BYTES, "flashtier_request_queue_time_seconds_sum": 0.05}
    delta.update(over)
    return usage, delta


def test_a_turn_read_from_the_server_registry():
    """The counters one turn moved, with labels (model label dropped) and histogram sums; buckets left out."""
    restored = 1562 * BLOCK_BYTES
    before, after = _registry_turn({"ssd_blocks_loaded": 1562, "ssd_bytes_read": restored,
                                    "snapshot_bytes_read": SNAPSHOT_BYTES, "snapshot_lookup_hit": 1},
                                   {"ssd": 99_968, "snapshot": 32}, "exact", queue_s=0.05)
    d = moved(before, after)
    assert d == {"flashtier_prompt_tokens_cached_total{tier=snapshot}": 32.0,
                 "flashtier_prompt_tokens_cached_total{tier=ssd}": 99_968.0,
                 "flashtier_request_queue_time_seconds_sum": 0.05, "flashtier_resumes_total{kind=exact}": 1.0,
                 "flashtier_snapshot_bytes_read_total": float(SNAPSHOT_BYTES),
                 "flashtier_snapshot_lookup_hit_total": 1.0, "flashtier_ssd_blocks_loaded_total": 1562.0,
                 "flashtier_ssd_bytes_read_total": float(restored), "flashtier_time_to_first_token_seconds_sum": 0.25}
    assert before["flashtier_ssd_blocks_written_total"] == 40.0 and "flashtier_ssd_blocks_written_total" not in d
    usage, _ = _hit()
    ev = evidence(usage, d)
    assert ev["restored_bytes"] == restored + SNAPSHOT_BYTES and ev["queue_s"] == 0.05
    assert ev["restore_GBps"] == round((restored + SNAPSHOT_BYTES) / 0.05 / 1e9, 3)  # 2.018
    assert (ev["ssd"], ev["snapshot"], ev["hbm"], ev["resume"]["kind"]) == (99_968, 32, 0, "exact")
    assert problems("hit", ev) == []


def test_scrape_rejects_a_value_that_is_not_a_number():
    assert scrape('flashtier_x_total{model_name="m"} 3\nother_metric 1\n') == {"flashtier_x_total": 3.0}
    with pytest.raises(ValueError):
        scrape('flashtier_x_total{model_name="m"} three')


def _miss(**over) -> tuple[dict, dict]:
    cache = CacheUsage(cached_tokens=99_968, ssd_tokens=99_968, decoder_tokens=128,
                       approximate_replay_tokens=128, computed_tokens=260)
    usage = usage_dict(100_100, 1, 0, over.pop("cache", cache), over.pop("resume", ResumeInfo("replay", 99_968)))
    delta = {"flashtier_ssd_blocks_loaded_total": 1562.0, "flashtier_snapshot_lookup_none_total": 1.0}
    delta.update(over)
    return usage, delta


@pytest.mark.parametrize("turn,make,want", [
    ("hit", lambda: _hit(), None),
    ("hit", lambda: _hit(resume=ResumeInfo("replay", 99_968)), "resume kind 'replay'"),
    ("hit", lambda: _hit(cache=CacheUsage(cached_tokens=100_000, hbm_tokens=99_968, snapshot_tokens=32)),
     "tokens from HBM"),
    ("hit", lambda: _hit(flashtier_ssd_blocks_loaded_total=0.0), "no SSD restore"),
    ("hit", lambda: _hit(flashtier_snapshot_lookup_hit_total=0.0), "no snapshot lookup hit"),
    ("miss", lambda: _miss(), None),
    ("miss", lambda: _miss(resume=ResumeInfo("exact")), "resume kind 'exact'"),
    ("miss", lambda: _miss(flashtier_snapshot_lookup_hit_total=1.0), "snapshot hits 1.0"),
    ("miss", lambda: _miss(cache=CacheUsage()), "no SSD restore"),
    ("cold", lambda: (usage_dict(100_000, 1, 0, CacheUsage(computed_tokens=100_000), ResumeInfo()), {}), None),
    ("cold", lambda: (usage_dict(100_000, 1, 0, CacheUsage(cached_tokens=64), ResumeInfo()), {}), "64 cached"),
], ids=["hit", "hit-replayed", "hit-from-hbm", "hit-no-ssd", "hit-no-snapshot", "miss", "miss-exact",
        "miss-snapshot-hit", "miss-nothing-cached", "cold", "cold-cached"])
def test_each_wrong_path_is_reported(turn, make, want):
    found = problems(turn, evidence(*make()))
    if want is None:
        assert found == []
    else:
        assert any(want in p for p in found), found


def test_fit_prompt():
    # 1,000 tok/s and 300 s fit 200,000 tokens with the 1.5x margin: 100K stays
    assert fit_prompt(100_000, 1000.0, 300.0, 64, floor=129) == 100_000
    # 100 s fit 66,666 -> 66,624 in whole 64-token blocks
    assert fit_prompt(100_000, 1000.0, 100.0, 64, floor=129) == 66_624
    assert fit_prompt(100_000, 1000.0, -5.0, 64, floor=129) == 129  # no time left: the floor
    assert fit_prompt(100_000, 1000.0, 150.0, 64, floor=129) == 100_000  # exactly fits


def test_prompt_ids():
    ids = prompt_ids(5000, seed=1)
    assert ids == prompt_ids(5000, seed=1) and ids[:100] == prompt_ids(100, seed=1)  # a prefix of the longer
    assert ids != prompt_ids(5000, seed=2)
    assert min(ids) >= 1000 and max(ids) < 100_000
