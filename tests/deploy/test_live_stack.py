"""The stack for real: `flashtier serve` (demo model, SSD tier, a real redis-server) scraped by a real
Prometheus running deploy/prometheus/prometheus.yml and rules.yml; then the operator tools on its directory.

Traffic (block size 16, an HBM pool of 36 blocks, so one long prompt pushes a conversation out of HBM)::

    A                   cold
    A + reply + 20      snapshot hit (its blocks in HBM, the tail from its Redis snapshot)
    B (520 tokens)      cold, evicts A's blocks from HBM
    A + ... + 20        SSD hit (A's blocks read back from the SSD tier) and a snapshot hit
    FLUSHALL, A + ...   bounded replay (no snapshot left)
    a 404 and a 400     the error panels' series

Then every query of both dashboards (Grafana's variables made concrete) and every operand of every alert
(rules.py's conditions split at comparisons and and/unless) is evaluated through Prometheus' HTTP API: each
must return at least one series and no NaN. Prometheus must have loaded and evaluated all 13 rules.

The tools: while the server runs, `flashtier kv stats` (the real entry point) refuses its directory naming
its pid; once it is stopped, `kv stats` counts the entries the server reported, `kv verify` passes, finds
a byte flipped in a live record, and `kv wipe --all` empties the tier.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from flashtier.kvstore.ssd.record import HEADER_BYTES
from flashtier.server.cli import main

from ..kvstore.redis_server import RedisServer
from .prometheus_server import PrometheusServer
from .promql_queries import concrete, dashboard_queries, operands, rule_queries
from .serve_process import ServeProcess

pytestmark = pytest.mark.slow


def chunk(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128000, (n,), generator=g).tolist()


@dataclass
class Stack:
    server: ServeProcess
    redis: RedisServer
    prometheus: PrometheusServer
    kv_dir: Path
    usages: dict[str, dict]


def drive(server: ServeProcess, redis: RedisServer) -> dict[str, dict]:
    """The traffic of the module doc; returns each turn's usage."""
    usages = {}
    client = redis.client()

    def turn(name: str, prompt: list[int], **kw) -> list[int]:
        got = server.complete(prompt, **kw)
        usages[name] = got["usage"]
        return prompt + got["choices"][0]["token_ids"]

    def snapshots_stored() -> None:  # snapshot puts are asynchronous
        deadline = time.monotonic() + 10
        while client.dbsize() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)

    a = turn("cold", chunk(100, 1))
    snapshots_stored()
    a = turn("snapshot", a + chunk(20, 2))
    turn("evict", chunk(520, 3), max_tokens=1)
    before = client.dbsize()
    a = turn("ssd", a + chunk(20, 4))
    # the "ssd" turn's snapshot put is asynchronous: let it land before the flush, or it lands after it and the
    # "replay" turn finds an exact snapshot (seen on a loaded machine)
    deadline = time.monotonic() + 10
    while client.dbsize() <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    client.flushall()
    turn("replay", a + chunk(20, 5))
    client.close()
    assert httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert httpx.post(server.url + "/v1/completions", content=b"{not json",
                      headers={"content-type": "application/json"}).status_code == 400
    return usages


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stack")
    kv_dir = tmp / "kv"
    redis = RedisServer().start()
    server = prometheus = None
    try:
        server = ServeProcess(tmp, "--kv-dir", str(kv_dir), "--redis-url", redis.url, "--block-size", "16",
                              "--num-blocks", "36", "--max-num-batched-tokens", "1024")
        prometheus = PrometheusServer(tmp).start(f"127.0.0.1:{server.port}")
        prometheus.wait_for('up{job="flashtier"} == 1', lambda r: len(r) == 1)
        usages = drive(server, redis)
        # scraped after the last turn: the replay is counted
        prometheus.wait_for('sum(flashtier_resumes_total{kind="replay"})', lambda r: r and float(r[0]["value"][1]) >= 1)
        time.sleep(1.5)  # one more scrape and one more rule evaluation
        yield Stack(server, redis, prometheus, kv_dir, usages)
    finally:
        for proc in (prometheus, server, redis):
            if proc is not None:
                proc.stop()
        redis.close()


def test_the_traffic_hit_every_tier(stack):
    tiers = {name: u["flashtier"]["cached_tokens_by_tier"] for name, u in stack.usages.items()}
    assert tiers["snapshot"]["snapshot"] > 0 and tiers["snapshot"]["hbm"] > 0, tiers
    assert tiers["ssd"]["ssd"] > 0 and tiers["ssd"]["snapshot"] > 0, tiers
    assert stack.usages["replay"]["flashtier"]["resume"]["kind"] == "replay"


def no_data(result: list[dict]) -> bool:
    """No series, or a NaN among them (e.g. a ratio of two rates that are both 0)."""
    values = [float(sample["value"][1]) for sample in result]
    return not values or any(math.isnan(v) for v in values)


def test_every_dashboard_query_and_alert_operand_returns_data(stack):
    assert no_data(stack.prometheus.query("flashtier_no_such_metric"))  # the check can fail
    assert no_data(stack.prometheus.query("sum(rate(flashtier_num_preemptions_total[1m])) / 0 * 0"))
    exprs = [(where, concrete(expr)) for where, expr in dashboard_queries()]
    exprs += [(f"{alert} operand", op) for alert, expr in rule_queries() for op in operands(expr)]
    failures = []
    for where, expr in exprs:
        result = stack.prometheus.query(expr)
        if no_data(result):
            failures.append(f"{where}: {expr} -> {result}")
    assert not failures, "\n".join(failures)
    assert len(exprs) > 70  # 65 dashboard queries and 15 alert operands when written


def test_prometheus_loads_and_evaluates_every_rule(stack):
    rules = stack.prometheus.rules()
    assert len(rules) == len(rule_queries()) == 13
    assert all(rule["health"] == "ok" and not rule.get("lastError") for rule in rules), rules
    firing = [rule["name"] for rule in rules if rule["state"] == "firing"]
    assert firing == []  # `for:` alerts cannot fire this soon; the others (SSD write errors, corrupt records) must not


def test_kv_tools_refuse_the_live_directory(stack):
    entry_point = Path(sys.executable).with_name("flashtier")  # the console script an operator runs
    command = [str(entry_point)] if entry_point.exists() else [sys.executable, "-m", "flashtier.server.cli"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([*command, "kv", "stats", "--kv-dir", str(stack.kv_dir)], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"flashtier: error: --kv-dir {stack.kv_dir} is held by a running flashtier server "
                             f"(pid {stack.server.pid}); stop it first (flashtier kv never works on a live SSD "
                             "tier)\n")


def test_kv_stats_verify_and_wipe_on_the_servers_directory(stack, capsys):
    reported = stack.prometheus.query("flashtier_ssd_entries")[0]["value"][1]
    stack.server.stop()
    assert main(["kv", "stats", "--kv-dir", str(stack.kv_dir), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == int(reported) > 0 and stats["segments"] >= 1
    assert stats["young_bytes"] == stats["live_bytes"] and stats["ages"][0]["entries"] == stats["entries"]
    assert main(["kv", "verify", "--kv-dir", str(stack.kv_dir), "--json"]) == 0
    clean = json.loads(capsys.readouterr().out)
    assert clean["bad"] == [] and clean["records"] >= stats["entries"]
    segment = sorted(stack.kv_dir.glob("*.seg"))[0]
    with open(segment, "r+b") as f:
        f.seek(HEADER_BYTES + 100)  # inside the first record's payload
        byte = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert main(["kv", "verify", "--kv-dir", str(stack.kv_dir), "--json"]) == 1
    bad = json.loads(capsys.readouterr().out)["bad"]
    assert len(bad) == 1 and bad[0]["offset"] == 0 and bad[0]["reason"] == "record payload checksum mismatch"
    assert main(["kv", "wipe", "--kv-dir", str(stack.kv_dir), "--all", "--yes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records_removed"] == clean["records"]
    assert main(["kv", "stats", "--kv-dir", str(stack.kv_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 0
