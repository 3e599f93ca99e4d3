"""flashtier's Grafana dashboards, "Serving" and "KV tiers", defined once, with grafana-foundation-sdk.

    python deploy/grafana/dashboards.py     writes deploy/grafana/dashboards/{serving,kv-tiers}.json

The JSON files are checked in (Grafana's provisioning reads them); tests/deploy/test_dashboards.py fails
when they differ from what this file builds, and ties every query to a metric the server exports
(server/serving/metrics.py); tests/deploy/test_live_stack.py evaluates every query on a real Prometheus
scraping a real server. Every selector filters on the ``instance`` variable; rates use Grafana's
``$__rate_interval``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as enums
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableOption, VariableRefresh

OUT = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="prometheus")  # provisioning/datasources/prometheus.yml
RATE = "$__rate_interval"
ERROR_STATUS = 'status=~"4..|5.."'
REPLAY = 'kind="replay"'


def sel(metric: str, *matchers: str) -> str:
    """``metric{instance=~"$instance", matchers...}``."""
    return metric + "{" + ", ".join(['instance=~"$instance"', *matchers]) + "}"


def rate(metric: str, *matchers: str) -> str:
    return f"rate({sel(metric, *matchers)}[{RATE}])"


def quantiles(histogram: str, by: str = "le") -> list[tuple[str, str]]:
    """p50 / p90 / p99 of a histogram over all selected servers."""
    return [(f"histogram_quantile({q}, sum by ({by}) ({rate(histogram + '_bucket')}))", f"p{round(q * 100)}")
            for q in (0.5, 0.9, 0.99)]


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    description: str = ""
    kind: str = "timeseries"  # timeseries | stat
    width: int = 8


@dataclass(frozen=True)
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


SERVING = [
    Row("Latency", [
        Panel("Time to first token", "s", quantiles("flashtier_time_to_first_token_seconds"),
              "From the server's receipt of a request to its first token."),
        Panel("Inter-token latency", "s", quantiles("flashtier_inter_token_latency_seconds"),
              "Time between consecutive outputs of a request."),
        Panel("End-to-end latency", "s", quantiles("flashtier_e2e_request_latency_seconds")),
        Panel("Queue time", "s", quantiles("flashtier_request_queue_time_seconds"),
              "Time a request waited before it was first scheduled."),
    ]),
    Row("Throughput", [
        Panel("Tokens per second", "short", [
            (f"sum({rate('flashtier_prompt_tokens_total')})", "prompt (in)"),
            (f"sum({rate('flashtier_generation_tokens_total')})", "generated (out)"),
        ]),
        Panel("Requests", "short", [
            (f"sum({sel('flashtier_num_requests_running')})", "running"),
            (f"sum({sel('flashtier_num_requests_waiting')})", "waiting"),
            (f"sum({sel('flashtier_num_requests_loading')})", "loading (tier reads)"),
        ]),
        Panel("HBM KV cache usage", "percentunit", [(f"max by (instance) ({sel('flashtier_kv_cache_usage_perc')})",
                                                      "{{instance}}")]),
        Panel("Request rate by route", "reqps", [(f"sum by (route) ({rate('flashtier_http_requests_total')})",
                                                  "{{route}}")]),
    ]),
    Row("Outcomes", [
        Panel("Finish reasons", "short", [(f"sum by (finished_reason) ({rate('flashtier_request_success_total')})",
                                           "{{finished_reason}}")]),
        Panel("Errors by status", "reqps", [
            (f"sum by (status, route) ({rate('flashtier_http_requests_total', ERROR_STATUS)})",
             "{{status}} {{route}}"),
        ], "400 invalid request, 401 key, 404 unknown model or route, 413 body too large, 429 queue full, 5xx."),
        Panel("Preemptions", "short", [(f"sum({rate('flashtier_num_preemptions_total')})", "preemptions/s")]),
        Panel("Engine ready", "short", [(f"min({sel('flashtier_engine_ready')})", "ready")], kind="stat", width=6),
    ]),
]

KV_TIERS = [
    Row("Prompt tokens by source", [
        Panel("Cached prompt tokens by tier", "short", [
            (f"sum by (tier) ({rate('flashtier_prompt_tokens_cached_total')})", "{{tier}}"),
            (f"sum({rate('flashtier_prompt_tokens_computed_total')})", "computed"),
            (f"sum({rate('flashtier_prompt_tokens_replayed_total')})", "replayed"),
        ], "Tokens per second served from HBM, SSD or a window snapshot, computed, or recomputed by replay."),
        Panel("Cache hit rate", "percentunit", [
            (f"sum by (tier) ({rate('flashtier_prompt_tokens_cached_total')}) / ignoring (tier) group_left "
             f"sum({rate('flashtier_request_prompt_tokens_sum')})", "{{tier}}"),
            (f"sum({rate('flashtier_prompt_tokens_cached_total')}) / "
             f"sum({rate('flashtier_request_prompt_tokens_sum')})", "all tiers"),
            (f"sum({rate('flashtier_prefix_cache_hits_total')}) / sum({rate('flashtier_prefix_cache_queries_total')})",
             "HBM prefix cache (engine)"),
        ], "Share of prompt tokens served from each tier."),
        Panel("Resumes by kind", "short", [(f"sum by (kind) ({rate('flashtier_resumes_total')})", "{{kind}}")],
              "exact: snapshot or full history; replay: bounded replay (approximate window); cold."),
    ]),
    Row("Snapshots and replay", [
        Panel("Snapshot lookups", "short", [
            (f"sum({rate('flashtier_snapshot_lookup_' + outcome + '_total')})", outcome)
            for outcome in ("hit", "miss", "none", "error")
        ], "hit: a usable snapshot; miss: listed but gone; none: no candidate; error: the pool failed."),
        Panel("Snapshot pool gets", "short", [
            (f"sum({rate('flashtier_snapshot_' + what + '_total')})", what)
            for what in ("hits", "misses", "errors", "corrupt")
        ]),
        Panel("Bounded replays", "short", [(f"sum({rate('flashtier_resumes_total', REPLAY)})",
                                            "replays/s")]),
        Panel("Replayed prompt tokens", "short", [(f"sum({rate('flashtier_prompt_tokens_replayed_total')})",
                                                   "tokens/s")]),
    ]),
    Row("SSD tier", [
        Panel("SSD bytes used vs budget", "bytes", [
            (f"sum by (instance) ({sel('flashtier_ssd_bytes')})", "used {{instance}}"),
            (f"max by (instance) ({sel('flashtier_ssd_budget_bytes')})", "budget {{instance}}"),
        ]),
        Panel("Oldest entry age vs lifetime", "s", [
            (f"max by (instance) ({sel('flashtier_ssd_oldest_entry_age_seconds')})", "oldest {{instance}}"),
            (f"max by (instance) ({sel('flashtier_ssd_lifetime_seconds')})", "lifetime {{instance}}"),
        ], "Refusing writes while the oldest entry is younger than the lifetime breaks the guarantee."),
        Panel("Admission refusals and write errors", "short", [
            (f"sum({rate('flashtier_ssd_admission_refusals_total')})", "refused (budget full)"),
            (f"sum by (cause) ({rate('flashtier_ssd_write_errors_total')})", "write errors: {{cause}}"),
        ]),
        Panel("SSD entries", "short", [(f"sum by (instance) ({sel('flashtier_ssd_entries')})", "{{instance}}")]),
        Panel("SSD I/O", "Bps", [
            (f"sum({rate('flashtier_ssd_bytes_written_total')})", "written"),
            (f"sum({rate('flashtier_ssd_bytes_read_total')})", "read"),
        ]),
        Panel("SSD hits, expirations, damage", "short", [
            (f"sum({rate('flashtier_ssd_' + what + '_total')})", what)
            for what in ("hits", "misses", "expirations", "corrupt_records", "compactions")
        ]),
    ]),
    Row("Redis", [
        Panel("Redis errors and timeouts", "short", [
            (f"sum by (op) ({rate('flashtier_snapshot_redis_op_errors_total')})", "errors {{op}}"),
            (f"sum by (op) ({rate('flashtier_snapshot_redis_op_timeouts_total')})", "timeouts {{op}}"),
        ]),
        Panel("Redis mean latency", "s", [
            (f"sum({rate('flashtier_snapshot_redis_call_seconds_total')}) / "
             f"sum({rate('flashtier_snapshot_redis_calls_total')})", "mean round trip"),
        ], "Mean duration of the snapshot pool's Redis calls (timeouts count at the timeout)."),
        Panel("Redis down", "short", [(f"max by (instance) ({sel('flashtier_snapshot_redis_down')})",
                                       "{{instance}}")], "1 while the circuit breaker is open.", width=8),
    ]),
    Row("Bytes", [
        Panel("Global KV bytes per token", "bytes", [(f"max({sel('flashtier_global_kv_bytes_per_token')})",
                                                      "bytes/token")], "890 for V4.1-Flash.", kind="stat"),
        Panel("Bytes persisted per turn", "bytes", [
            *quantiles("flashtier_request_persisted_bytes"),
            (f"sum({rate('flashtier_request_persisted_bytes_sum')}) / "
             f"sum({rate('flashtier_request_persisted_bytes_count')})", "mean"),
        ], "Bytes a request wrote to the persistent tiers (SSD blocks, Redis snapshots).", width=16),
    ]),
]


def _panel(p: Panel, panel_id: int):
    if p.kind == "timeseries":
        legend = (common.VizLegendOptions().display_mode(enums.LegendDisplayMode.LIST)
                  .placement(enums.LegendPlacement.BOTTOM).show_legend(True))
        tooltip = common.VizTooltipOptions().mode(enums.TooltipDisplayMode.MULTI).sort(enums.SortOrder.DESCENDING)
        builder = timeseries.Panel().legend(legend).tooltip(tooltip)
    else:
        builder = stat.Panel().reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    builder = builder.id(panel_id).title(p.title).unit(p.unit).datasource(DATASOURCE).height(8).span(p.width)
    if p.description:
        builder = builder.description(p.description)
    for i, (expr, legend) in enumerate(p.targets):
        builder = builder.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(65 + i)))
    return builder


def build(title: str, uid: str, rows: list[Row]) -> dict:
    """One dashboard as the JSON-ready dict Grafana's provisioning loads."""
    instance = (dashboard.QueryVariable("instance").label("instance").datasource(DATASOURCE)
                .query("label_values(flashtier_server_info, instance)").multi(True).include_all(True)
                .all_value(".*").refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
                .current(VariableOption(selected=True, text="All", value="$__all")))
    board = (dashboard.Dashboard(title).uid(uid).tags(["flashtier"]).refresh("30s").time("now-3h", "now")
             .timezone("browser").with_variable(instance))
    panel_id = 1
    for row in rows:
        board = board.with_row(dashboard.Row(row.title).id(panel_id))
        panel_id += 1
        for p in row.panels:
            board = board.with_panel(_panel(p, panel_id))
            panel_id += 1
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def dashboards() -> dict[str, dict]:
    """File name -> dashboard."""
    return {"serving.json": build("flashtier: Serving", "flashtier-serving", SERVING),
            "kv-tiers.json": build("flashtier: KV tiers", "flashtier-kv-tiers", KV_TIERS)}


def render(board: dict) -> str:
    return json.dumps(board, indent=2, sort_keys=True) + "\n"


def queries(board: dict) -> list[str]:
    """Every PromQL expression of a built dashboard (panels and variables)."""
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets") or []]
    return exprs + [v["query"] for v in board.get("templating", {}).get("list", [])]


def main() -> int:
    OUT.mkdir(exist_ok=True)
    for name, board in dashboards().items():
        (OUT / name).write_text(render(board))
        print(f"wrote {OUT / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
