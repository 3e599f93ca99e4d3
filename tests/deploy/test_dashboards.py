"""The Grafana dashboards and the alert rules against what the server exports.

- The checked-in JSON is exactly what deploy/grafana/dashboards.py builds (edit the Python, not the JSON);
  both dashboards are provisioned from the paths the compose file mounts, on the datasource uid it provisions.
- Every metric a dashboard query or an alert names is one the server exports: the names and labels come from
  the real /metrics exposition of ``ServerMetrics`` over the tier statistics of a real TierManager (SSD tier
  + Redis snapshot pool), so a renamed metric or label fails here (the live test evaluates the queries).
- The issue's panels exist: percentiles of TTFT / ITL / end-to-end, tokens in and out, running / waiting /
  loading, finish reasons, errors; cached tokens by tier, hit rate, snapshot hits / misses, replays, SSD
  bytes vs budget, oldest age vs lifetime, refusals, Redis errors and latency, KV bytes per token, bytes
  persisted per turn.
"""

from __future__ import annotations

import json

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flashtier.engine.engine_stats import tier_stats
from flashtier.engine.core.outputs import EngineStats
from flashtier.engine.tiers.manager import TierManager
from flashtier.kvstore.config import KVStoreConfig
from flashtier.server.serving.metrics import ServerMetrics

from ..kvstore.redis_server import free_port
from .promql_queries import DEPLOY, concrete, dashboard_module, dashboard_queries, rule_queries, selections

PROMETHEUS_LABELS = {"job", "instance"}  # added by the scrape


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, set[str]]:
    """Sample name -> label names of one /metrics exposition of a server with both tiers (plus ``up``)."""
    config = KVStoreConfig(ssd_dir=str(tmp_path_factory.mktemp("kv")), ssd_budget_bytes=1 << 20,
                           ssd_segment_bytes=1 << 20,
                           redis_url=f"redis://127.0.0.1:{free_port()}/0")  # never called: no server needed
    tiers = TierManager(config)
    try:
        stats = EngineStats(tiers=tier_stats(tiers))
    finally:
        tiers.close()
    metrics = ServerMetrics("m", stats=lambda: stats)
    metrics.http.labels("POST", "/v1/chat/completions", "200").inc()  # its children appear with traffic
    out: dict[str, set[str]] = {"up": set()}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def test_checked_in_dashboards_are_the_generators_output():
    module = dashboard_module()
    built = module.dashboards()
    assert sorted(built) == sorted(p.name for p in (DEPLOY / "grafana" / "dashboards").glob("*.json"))
    for name, board in built.items():
        text = (DEPLOY / "grafana" / "dashboards" / name).read_text()
        assert text == module.render(board), f"{name} differs from deploy/grafana/dashboards.py: run it"
        assert all(p["datasource"]["uid"] == "prometheus" for p in board["panels"] if p["type"] != "row")
    ids = [p["id"] for board in built.values() for p in board["panels"]]
    assert len(set(json.dumps(b["uid"]) for b in built.values())) == 2 and all(ids)


def test_provisioning_points_at_the_mounted_dashboards():
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "flashtier.yml").read_text())
    assert prov["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["uid"] == "prometheus" and ds["datasources"][0]["url"] == "http://prometheus:9090"


@pytest.mark.parametrize("where, expr", dashboard_queries() + rule_queries())
def test_every_query_names_exported_metrics_and_labels(exported, where, expr):
    sel = selections(concrete(expr))
    assert sel.metrics, where
    labels = set(PROMETHEUS_LABELS)
    for metric, matched in sel.metrics.items():
        assert metric in exported, f"{where}: {metric} is not exported"
        assert matched <= exported[metric] | PROMETHEUS_LABELS, f"{where}: {metric}{{{matched}}}"
        labels |= exported[metric]
    assert sel.grouping <= labels, f"{where}: groups by {sel.grouping - labels}"


def test_a_misspelt_metric_or_label_is_caught(exported):
    sel = selections('sum by (teir) (rate(flashtier_prompt_tokens_cahced_total{tier="ssd"}[1m]))')
    assert "flashtier_prompt_tokens_cahced_total" not in exported
    assert not sel.grouping <= exported["flashtier_prompt_tokens_cached_total"] | PROMETHEUS_LABELS


def test_the_panels_the_issue_asks_for_are_there():
    queries = " ".join(expr for _, expr in dashboard_queries())
    titles = " ".join(where for where, _ in dashboard_queries())
    for metric in ("flashtier_time_to_first_token_seconds_bucket", "flashtier_inter_token_latency_seconds_bucket",
                   "flashtier_e2e_request_latency_seconds_bucket", "flashtier_prompt_tokens_total",
                   "flashtier_generation_tokens_total", "flashtier_num_requests_running",
                   "flashtier_num_requests_waiting", "flashtier_num_requests_loading",
                   "flashtier_request_success_total", "flashtier_prompt_tokens_cached_total",
                   "flashtier_snapshot_lookup_hit_total", "flashtier_snapshot_lookup_miss_total",
                   "flashtier_prompt_tokens_replayed_total", "flashtier_ssd_bytes", "flashtier_ssd_budget_bytes",
                   "flashtier_ssd_oldest_entry_age_seconds", "flashtier_ssd_lifetime_seconds",
                   "flashtier_ssd_admission_refusals_total", "flashtier_snapshot_redis_op_errors_total",
                   "flashtier_snapshot_redis_call_seconds_total", "flashtier_global_kv_bytes_per_token",
                   "flashtier_request_persisted_bytes_bucket"):
        assert metric + "{" in queries, metric
    assert 'kind="replay"' in queries and 'status=~"4..|5.."' in queries
    for quantile in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le) (rate(flashtier_time_to_first_token" in queries
    assert "serving.json" in titles and "kv-tiers.json" in titles
