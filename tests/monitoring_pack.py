"""The monitoring pack (deploy/monitoring/): its queries, the metrics and labels they read, and a
check of those against what processes export. PromQL is parsed by `promql_parser`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import promql_parser as promql
import yaml
from prometheus_client.parser import text_string_to_metric_families

PACK = Path(__file__).resolve().parent.parent / "deploy" / "monitoring"
RULES = PACK / "alerts.yaml"
DASHBOARD = PACK / "grafana-dashboard.json"
# Labels Prometheus adds (job, instance) or that are part of a histogram's series (le).
SCRAPE_LABELS = frozenset({"job", "instance", "le"})
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


@attrs.frozen
class Query:
    where: str  # "alert X" or "panel Y"
    expr: str


def rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def queries() -> list[Query]:
    """Every PromQL expression of the pack; the dashboard's `$instance` as Grafana's "All"."""
    out = [Query(f"alert {rule['alert']}", rule["expr"]) for rule in rules()]
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$instance", ".*")
            out.append(Query(f"panel {panel['title']!r}", expr))
    return out


@attrs.frozen
class Read:
    """A series a query reads: its name, the labels it matches on, the labels it groups by."""

    name: str
    labels: frozenset[str]


def reads(expr: str) -> tuple[list[Read], set[str]]:
    """The series `expr` reads, and every label an aggregation in it groups by."""
    found: list[Read] = []
    grouped: set[str] = set()
    for node in _walk(promql.parse(expr)):
        if isinstance(node, promql.VectorSelector):
            labels = frozenset(m.name for m in node.matchers.matchers)
            found.append(Read(name=node.name, labels=labels))
        elif isinstance(node, promql.AggregateExpr) and node.modifier is not None:
            grouped.update(node.modifier.labels)
    return found, grouped


def _walk(node: Any) -> Iterator[Any]:
    yield node
    children: Iterable[Any] = ()
    if isinstance(node, promql.BinaryExpr):
        children = (node.lhs, node.rhs)
    elif isinstance(node, promql.AggregateExpr):
        children = (node.expr,) if node.param is None else (node.expr, node.param)
    elif isinstance(node, promql.Call):
        children = node.args
    elif isinstance(node, promql.MatrixSelector):
        children = (node.vector_selector,)
    elif isinstance(node, promql.ParenExpr | promql.UnaryExpr | promql.SubqueryExpr):
        children = (node.expr,)
    for child in children:
        yield from _walk(child)


def exported(texts: Iterable[str]) -> dict[str, frozenset[str] | None]:
    """Series name -> its label names, for every metric family in `texts` (Prometheus text
    exposition); None for a series declared but not sampled yet (a labelled counter none has
    counted): its labels are unknown."""
    series: dict[str, set[str] | None] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for suffix in SUFFIXES.get(family.type, ("",)):
                series.setdefault(family.name + suffix, None)
            for sample in family.samples:
                series[sample.name] = (series.get(sample.name) or set()) | set(sample.labels)
    return {name: None if labels is None else frozenset(labels) for name, labels in series.items()}


def unknown_reads(texts: Iterable[str]) -> list[str]:
    """What the pack reads that the processes behind `texts` do not export: a metric, a label it
    matches on, or a label it groups by (the series' own and the scrape's are known; a series not
    sampled yet has labels unknown, and is checked by name only)."""
    have = exported(texts)
    problems = []
    for query in queries():
        found, grouped = reads(query.expr)
        known: set[str] | None = set(SCRAPE_LABELS)
        for read in found:
            if read.name not in have:
                problems.append(f"{query.where}: no metric {read.name}")
                continue
            labels = have[read.name]
            if labels is None:
                known = None
                continue
            if known is not None:
                known |= labels
            if not read.labels <= labels | SCRAPE_LABELS:
                problems.append(f"{query.where}: {read.name} has no label "
                                f"{sorted(read.labels - labels - SCRAPE_LABELS)}")  # fmt: skip
        if known is not None and not grouped <= known:
            problems.append(f"{query.where}: grouped by unknown {sorted(grouped - known)}")
    return problems
