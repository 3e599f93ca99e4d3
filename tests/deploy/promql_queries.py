"""The PromQL of deploy/: every dashboard query and alert expression, and what each one selects.

``dashboard_queries`` and ``rule_queries`` list (where, expr); ``concrete`` replaces Grafana's variables by
what Prometheus accepts (``$__rate_interval`` -> a range, ``$instance`` -> any); ``selections`` walks the
parsed expression (promql-parser) for the metric names, the label names of their matchers, and the labels
of ``by``/``on``/``ignoring`` clauses; ``operands`` splits an alert condition at its comparisons and
``and``/``unless`` into the expressions that must have data for the alert to be able to fire.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import promql_parser as pq
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPARISONS = {"==", "!=", ">", "<", ">=", "<="}
FILTERS = {"and", "unless"}  # set operators that filter: each side must have data; `or` supplies defaults


def dashboard_module():
    """deploy/grafana/dashboards.py, imported by path (deploy/ is not a package)."""
    spec = importlib.util.spec_from_file_location("flashtier_dashboards", DEPLOY / "grafana" / "dashboards.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def dashboard_queries() -> list[tuple[str, str]]:
    """(dashboard file: panel title, expr) of the checked-in dashboards, variables' queries included."""
    out = []
    for path in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            out += [(f"{path.name}: {panel['title']}", t["expr"]) for t in panel.get("targets") or []]
        out += [(f"{path.name}: ${v['name']}", v["query"]) for v in board["templating"]["list"]]
    return out


def rule_queries() -> list[tuple[str, str]]:
    """(alert name, expr) of deploy/prometheus/rules.yml."""
    groups = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())["groups"]
    return [(rule["alert"], rule["expr"]) for group in groups for rule in group["rules"]]


def concrete(expr: str, rate_range: str = "1m") -> str:
    """A Grafana query as Prometheus takes it: ``label_values(m, l)`` becomes ``m``."""
    expr = expr.replace("$__rate_interval", rate_range).replace('"$instance"', '".*"')
    if expr.startswith("label_values("):
        expr = expr.removeprefix("label_values(").split(",")[0]
    return expr


@dataclass
class Selections:
    metrics: dict[str, set[str]] = field(default_factory=dict)  # metric -> label names in its matchers
    grouping: set[str] = field(default_factory=set)  # by / without / on / ignoring labels


def selections(expr: str) -> Selections:
    out = Selections()

    def visit(node) -> None:
        if isinstance(node, pq.VectorSelector):
            labels = {m.name for m in node.matchers.matchers}
            out.metrics.setdefault(node.name, set()).update(labels)
        elif isinstance(node, pq.AggregateExpr) and node.modifier is not None:
            out.grouping.update(node.modifier.labels)
        elif isinstance(node, pq.BinaryExpr) and node.modifier is not None and node.modifier.matching is not None:
            out.grouping.update(node.modifier.matching.labels)

    pq.walk(pq.parse(expr), pre_visit=visit)
    return out


def operands(expr: str) -> list[str]:
    """The sub-expressions of an alert condition that must return data (number literals left out)."""
    def split(node) -> list:
        while isinstance(node, pq.ParenExpr):
            node = node.expr
        if isinstance(node, pq.BinaryExpr) and (str(node.op) in COMPARISONS or str(node.op) in FILTERS):
            return split(node.lhs) + split(node.rhs)
        return [] if isinstance(node, pq.NumberLiteral) else [node]

    return [str(node) for node in split(pq.parse(expr))]
