"""Writes deploy/monitoring/grafana-dashboard.json: the Grafana dashboard of a trtdisagg cluster.

The panels are declared below (row, title, unit, help, queries); this script lays them out and
prints Grafana's JSON model. Series are selected by the scrape jobs of
deploy/monitoring/prometheus.yaml. After changing a panel:

    python tools/grafana_dashboard.py > deploy/monitoring/grafana-dashboard.json

`make test` checks that the file is this script's output, that every query parses as PromQL, and
that every metric it reads is one the processes export (tests/monitoring_pack.py).
"""

from __future__ import annotations

import json
from typing import Any, Final

COORD: Final = 'job="trtdisagg-coordinator"'
WORKERS: Final = 'job=~"trtdisagg-(ctx|gen)", instance=~"$instance"'
CTX: Final = 'job="trtdisagg-ctx", instance=~"$instance"'
GEN: Final = 'job="trtdisagg-gen", instance=~"$instance"'


Query = tuple[str, str]  # PromQL, legend
Panel = tuple[str, str, str, list[Query]]  # title, unit, description, queries


def rate(metric: str, selector: str, legend: str, by: str = "") -> Query:
    """The per-second rate of a counter, summed (by `by`)."""
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{{{selector}}}[5m]))", legend


def quantiles(metric: str, selector: str, by: str = "") -> list[Query]:
    """p50 and p99 of a histogram (per `by`)."""
    group = f"{by}, le" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    return [
        (f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[5m])))",
         f"{legend}p{round(q * 100)}")
        for q in (0.5, 0.99)
    ]  # fmt: skip


def pool_in_use() -> Query:
    free, cached, total = (
        f"trtdisagg_kv_cache_{name}_blocks{{{WORKERS}}}" for name in ("free", "reusable", "total")
    )
    return f"1 - ({free} + {cached}) / {total}", "{{instance}}"


INST: Final = "{{instance}}"
# fmt: off
ROWS: Final[list[tuple[str, list[Panel]]]] = [
    ("Service (coordinator)", [
        ("Requests by status", "reqps", "Client requests the coordinator finished, by status.",
         [rate("trtdisagg_requests_total", COORD, "{{status}}", "status")]),
        ("Time to first token", "s", "Arrival at the coordinator to the first token relayed.",
         quantiles("trtdisagg_time_to_first_token_seconds", COORD)),
        ("End-to-end latency", "s", "Arrival at the coordinator to the answer complete.",
         quantiles("trtdisagg_e2e_request_latency_seconds", COORD)),
        ("Requests in flight", "short", "Client requests the coordinator is serving.",
         [(f"sum(trtdisagg_requests_running{{{COORD}}})", "in flight")]),
        ("Workers by state", "short",
         "Servers in rotation, unhealthy, or healthy but unable to pair, as a front end sees them.",
         [(f"max by (role, state) (trtdisagg_coordinator_servers{{{COORD}}})",
           "{{role}} {{state}}")]),
        ("Upstream errors", "ops", "Failed calls to workers, by role and kind.",
         [rate("trtdisagg_coordinator_upstream_errors_total", COORD, "{{role}} {{kind}}",
               "role, kind")]),
        ("Recoveries", "ops",
         "Legs retried elsewhere, answers resumed on another gen, phase deadlines missed.",
         [rate("trtdisagg_coordinator_retries_total", COORD, "retries"),
          rate("trtdisagg_coordinator_migrations_total", COORD, "resumed: {{reason}}", "reason"),
          rate("trtdisagg_coordinator_deadline_misses_total", COORD, "missed: {{phase}}",
               "phase")]),
    ]),
    ("Workers", [
        ("Output tokens per second", "short",
         "Tokens each worker sent after a request's first (its inter-token intervals).",
         [rate("trtdisagg_inter_token_latency_seconds_count", WORKERS, INST, "instance")]),
        ("Device busy", "percentunit",
         "Seconds of model steps on the device per second of wall time (CUDA events).",
         [rate("trtdisagg_step_device_seconds_total", WORKERS, INST, "instance")]),
        ("Requests running and waiting", "short", "Requests holding KV, and requests queued.",
         [(f"trtdisagg_requests_running{{{WORKERS}}}", f"{INST} running"),
          (f"trtdisagg_requests_waiting{{{WORKERS}}}", f"{INST} waiting")]),
        ("KV pool in use", "percentunit",
         "Blocks neither free nor cached; near 1 with requests waiting, the pool is too small.",
         [pool_in_use()]),
        ("Time to first token per worker", "s", "At each worker (ctx: its prefill).",
         quantiles("trtdisagg_time_to_first_token_seconds", WORKERS, "instance")),
        ("Inter-token latency", "s", "At each gen worker.",
         quantiles("trtdisagg_inter_token_latency_seconds", GEN, "instance")),
        ("Preemptions and failed steps", "ops",
         "Requests preempted for KV space; failed model steps (each fails its requests).",
         [rate("trtdisagg_preemptions_total", WORKERS, f"{INST} preempted", "instance"),
          rate("trtdisagg_step_failures_total", WORKERS, f"{INST} failed steps", "instance")]),
    ]),
    ("KV transfer", [
        ("KV moved", "Bps", "Bytes ctx wrote into gen's blocks.",
         [rate("trtdisagg_kv_transfer_bytes_total", CTX, INST, "instance")]),
        ("KV write time", "s", "One write of a request's KV, post to end, at ctx.",
         quantiles("trtdisagg_kv_transfer_seconds", CTX, "instance")),
        ("Transfer failures and slow writes", "ops",
         "Failed transfers (both sides); ctx writes under kv_transfer_min_gbps.",
         [rate("trtdisagg_kv_transfer_failures_total", WORKERS, f"{INST} failed", "instance"),
          rate("trtdisagg_kv_slow_writes_total", CTX, f"{INST} slow", "instance")]),
        ("Transfer sessions", "short",
         "Sessions held, and ended ones whose blocks a write may still reach (quarantined).",
         [(f"sum by (instance, side) (trtdisagg_kv_sessions{{{WORKERS}}})", f"{INST} {{{{side}}}}"),
          (f"trtdisagg_kv_quarantined_requests{{{WORKERS}}}", f"{INST} quarantined")]),
    ]),
    ("Control plane", [
        ("Refused and malformed messages", "ops",
         "Control messages refused (by reason) and frames that did not parse.",
         [rate("trtdisagg_control_refused_total", WORKERS, f"{INST} {{{{reason}}}}",
               "instance, reason"),
          rate("trtdisagg_control_bad_frames_total", WORKERS, f"{INST} bad frames", "instance")]),
        ("Peers", "ops", "Peer instances forgotten as gone, and of those, the ones that died.",
         [rate("trtdisagg_kv_peers_forgotten_total", WORKERS, f"{INST} forgotten", "instance"),
          rate("trtdisagg_kv_peers_dead_total", WORKERS, f"{INST} dead", "instance")]),
        ("Event loop lag", "s", "How late each process's Trio loop wakes: time a handler held it.",
         quantiles("trtdisagg_event_loop_lag_seconds", 'job=~"trtdisagg-.*"', "instance")),
    ]),
]
# fmt: on

PANELS_PER_ROW: Final = 3
WIDTH, HEIGHT = 24 // PANELS_PER_ROW, 8


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for row_title, row in ROWS:
        row_position = {"h": 1, "w": 24, "x": 0, "y": y}
        panels.append({"type": "row", "title": row_title, "collapsed": False, "panels": [],
                       "id": len(panels) + 1, "gridPos": row_position})  # fmt: skip
        y += 1
        for i, (title, unit, description, queries) in enumerate(row):
            x = (i % PANELS_PER_ROW) * WIDTH
            if i and not i % PANELS_PER_ROW:
                y += HEIGHT
            panels.append({
                "type": "timeseries", "title": title, "description": description,
                "id": len(panels) + 1,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": HEIGHT, "w": WIDTH, "x": x, "y": y},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {"expr": expr, "legendFormat": legend, "refId": chr(ord("A") + k),
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for k, (expr, legend) in enumerate(queries)
                ],
            })  # fmt: skip
        y += HEIGHT
    return {
        "title": "trtdisagg", "uid": "trtdisagg", "schemaVersion": 39, "version": 1,
        "editable": True, "tags": ["trtdisagg"], "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource",
             "query": "prometheus"},
            {"name": "instance", "label": "Worker", "type": "query", "includeAll": True,
             "multi": True, "allValue": ".*", "refresh": 2,
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": 'label_values(trtdisagg_kv_cache_total_blocks{job=~"trtdisagg-(ctx|gen)"}, '
                      "instance)"},
        ]},
        "panels": panels,
    }  # fmt: skip


def render() -> str:
    return json.dumps(dashboard(), indent=1) + "\n"


if __name__ == "__main__":
    print(render(), end="")
