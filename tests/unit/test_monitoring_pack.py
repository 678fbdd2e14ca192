"""deploy/monitoring/: the alert rules and the Grafana dashboard are well formed, and the check
that they read only exported metrics catches what it must (tests/monitoring_pack.py). The check
against real processes is in e2e/test_coordinator_cluster.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from tests import monitoring_pack as pack
from trtdisagg.metrics import WorkerMetrics

TOOL = Path(__file__).resolve().parents[2] / "tools" / "grafana_dashboard.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grafana_dashboard", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dashboard_file_is_what_its_generator_writes() -> None:
    assert pack.DASHBOARD.read_text() == _tool().render(), (
        "run: python tools/grafana_dashboard.py > deploy/monitoring/grafana-dashboard.json"
    )


def test_every_alert_says_how_bad_and_what_it_means() -> None:
    names = []
    for rule in pack.rules():
        names.append(rule["alert"])
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    assert len(names) == len(set(names)) >= 10, names


def test_every_query_parses_and_reads_trtdisagg_series() -> None:
    queries = pack.queries()
    assert len(queries) > 30
    for query in queries:
        found, _ = pack.reads(query.expr)  # raises on a query that does not parse
        assert found and all(r.name.startswith("trtdisagg_") for r in found), query


def test_panels_are_laid_out_on_the_grid_without_overlap() -> None:
    board = pack.dashboard()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_the_check_names_a_missing_metric_and_a_missing_label() -> None:
    worker_only = WorkerMetrics.create().render().decode()
    problems = pack.unknown_reads([worker_only])
    assert any("no metric trtdisagg_coordinator_upstream_errors_total" in p for p in problems)
    assert not any("trtdisagg_requests_waiting" in p for p in problems), problems  # a worker's
    relabelled = worker_only.replace('role="', 'kind="')  # no sample has `role` any more
    bad = "\n".join(
        line for line in relabelled.splitlines() if not line.startswith("trtdisagg_requests_total")
    )
    bad += '\ntrtdisagg_requests_total{kind="ctx",outcome="ok"} 1.0\n'
    problems = pack.unknown_reads([bad])
    assert any("grouped by unknown ['status']" in p for p in problems), problems


@pytest.mark.parametrize(
    ("expr", "names", "grouped"),
    [
        ('sum by (status) (rate(a_total{job="x"}[5m])) / sum(rate(b_total[5m]))',
         {"a_total", "b_total"}, {"status"}),
        ("histogram_quantile(0.99, sum by (le) (rate(h_bucket[5m]))) > 2", {"h_bucket"}, {"le"}),
        ("-(x - y) and on() max_over_time(z[5m:1m])", {"x", "y", "z"}, set()),
    ],
)  # fmt: skip
def test_reads_finds_every_series_and_grouping(
    expr: str, names: set[str], grouped: set[str]
) -> None:
    found, by = pack.reads(expr)
    assert {r.name for r in found} == names
    assert by == grouped
