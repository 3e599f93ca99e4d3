"""deploy/prometheus through Debian's promtool: the config and the rules check, the rules' unit tests
(deploy/prometheus/rules_test.yml: the SSD-guarantee, Redis-down, server-down and 429 alerts, firing and
quiet) pass, and fail once an alert's expression is broken, so they can catch a wrong rule."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"


def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    if binary is None:
        raise RuntimeError("promtool not found on PATH: install Debian's prometheus package (make system)")
    return subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_config_and_rules_check():
    config = promtool("check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr
    assert "SUCCESS" in config.stdout and "rules.yml" in config.stdout  # the rule file is loaded and checked
    rules = promtool("check", "rules", "rules.yml")
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "SUCCESS: 13 rules found" in rules.stdout


def test_rule_unit_tests_pass():
    result = promtool("test", "rules", "rules_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("alert, old, new", [
    ("FlashtierSSDLifetimeAtRisk", "flashtier_ssd_oldest_entry_age_seconds < flashtier_ssd_lifetime_seconds",
     "flashtier_ssd_oldest_entry_age_seconds > flashtier_ssd_lifetime_seconds"),
    ("FlashtierRedisDown", "max_over_time(flashtier_snapshot_redis_down[2m]) == 1",
     "flashtier_snapshot_redis_down == 2"),
    ("FlashtierDown", 'up{job="flashtier"} == 0', 'up{job="flashtier"} == 1'),
])
def test_rule_unit_tests_fail_on_a_broken_rule(tmp_path, alert, old, new):
    rules = (PROM / "rules.yml").read_text()
    assert rules.count(old) == 1
    (tmp_path / "rules.yml").write_text(rules.replace(old, new))
    shutil.copy(PROM / "rules_test.yml", tmp_path)
    result = promtool("test", "rules", "rules_test.yml", cwd=tmp_path)
    assert result.returncode != 0 and f"alertname: {alert}" in result.stdout + result.stderr
