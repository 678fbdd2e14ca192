"""The coordinator's Prometheus metrics (DESIGN.md §9 names), in a per-process registry.

In a fleet every front-end process counts what it served and routed itself, in files of the
directory the supervisor names in ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess
mode), and `render` adds them up: a scrape of the public port, whichever front end takes it,
shows the fleet's totals.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any, Final

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from trtdisagg.metrics import CONTENT_TYPE as CONTENT_TYPE
from trtdisagg.metrics import event_loop_lag_histogram

ROLE = "coordinator"
MULTIPROCESS_DIR_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip


@attrs.define(eq=False, kw_only=True)
class CoordinatorMetrics:
    registry: CollectorRegistry
    requests_total: Counter
    """``{role="coordinator", status}``; status: ok | error | aborted (client went away)."""
    requests_running: Gauge
    time_to_first_token: Histogram
    e2e_latency: Histogram
    router_decisions: Counter
    """``{router, server}``: one per server chosen, by the process that chose it."""
    retries: Counter
    local_prefill: Counter
    """Requests served by gen alone (conditional disaggregation)."""
    router_prompt_tokens: Counter
    """``{role, router}``: prompt tokens of the requests routed by a router that reads them."""
    router_matched_tokens: Counter
    """``{role, router}``: of those, the ones already cached on the chosen server. Their ratio
    is the KV-aware routing hit rate; a router whose block table never fills shows 0 here
    instead of falling back to load-only routing unseen (TRT-LLM#14882)."""
    upstream_errors: Counter
    ctx_releases: Counter
    """``{outcome}``: ctx KV released because no gen took it; released | not_held | failed."""
    deadline_misses: Counter
    """``{phase, server}``: a worker missed a phase deadline (ctx_first_token, gen_first_token,
    inter_token) and left rotation until its next good health check."""
    migrations: Counter
    streams_led: Counter
    """``{reason}``: answers resumed on another gen after a leg failed: unreachable (the
    connection broke), failed (an error mid-stream), deadline (it stalled)."""
    event_loop_lag: Histogram

    @classmethod
    def create(cls) -> CoordinatorMetrics:
        r = CollectorRegistry()
        p = "trtdisagg_"
        return cls(
            registry=r,
            requests_total=Counter(
                p + "requests", "Finished client requests", ["role", "status"], registry=r
            ),
            requests_running=Gauge(
                p + "requests_running", "Client requests in flight", registry=r,
                multiprocess_mode="livesum",
            ),
            time_to_first_token=Histogram(
                p + "time_to_first_token_seconds", "Arrival to first token relayed",
                buckets=_LATENCY_BUCKETS, registry=r,
            ),
            e2e_latency=Histogram(
                p + "e2e_request_latency_seconds", "Arrival to answer complete",
                buckets=_LATENCY_BUCKETS, registry=r,
            ),
            router_decisions=Counter(
                p + "router_decisions", "Servers chosen by routers", ["router", "server"],
                registry=r,
            ),
            retries=Counter(
                p + "coordinator_retries", "Request legs retried on another server", registry=r
            ),
            local_prefill=Counter(
                p + "coordinator_local_prefill",
                "Requests prefilled on gen itself (conditional disaggregation)", registry=r,
            ),
            router_prompt_tokens=Counter(
                p + "router_prompt_tokens",
                "Prompt tokens of requests routed by prompt-aware routers", ["role", "router"],
                registry=r,
            ),
            router_matched_tokens=Counter(
                p + "router_matched_tokens",
                "Prompt tokens found cached on the server the router chose", ["role", "router"],
                registry=r,
            ),
            upstream_errors=Counter(
                p + "coordinator_upstream_errors", "Failed calls to workers", ["role", "kind"],
                registry=r,
            ),
            ctx_releases=Counter(
                p + "coordinator_ctx_releases",
                "ctx KV holds ended early because no gen leg took the KV", ["outcome"],
                registry=r,
            ),
            deadline_misses=Counter(
                p + "coordinator_deadline_misses",
                "Phase deadlines missed by a worker", ["phase", "server"], registry=r,
            ),
            migrations=Counter(
                p + "coordinator_migrations",
                "Answers resumed on another generation server", ["reason"], registry=r,
            ),
            streams_led=Counter(
                p + "coordinator_streams_led",
                "Streams that began with ctx's first tokens, before gen sent any", registry=r,
            ),
            event_loop_lag=event_loop_lag_histogram(r),
        )  # fmt: skip

    def finished(self, status: str) -> None:
        self.requests_total.labels(role=ROLE, status=status).inc()

    def render(self, cluster: Mapping[str, Any] | None = None) -> bytes:
        """The exposition; with `cluster` (`/cluster_info` of the front end that answers), also
        how many servers of each role it has in rotation, unhealthy, or healthy but unpaired."""
        directory = os.environ.get(MULTIPROCESS_DIR_ENV)
        if directory is None:
            text = generate_latest(self.registry)
        else:
            fleet = CollectorRegistry()
            MultiProcessCollector(fleet, path=directory)
            text = generate_latest(fleet)
        if cluster is None:
            return text
        servers = CollectorRegistry()
        servers.register(_ServerCounts(cluster))
        return text + generate_latest(servers)


class _ServerCounts(Collector):
    """`trtdisagg_coordinator_servers{role, state}` from one front end's `/cluster_info`."""

    def __init__(self, cluster: Mapping[str, Any]) -> None:
        self._cluster = cluster

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "trtdisagg_coordinator_servers",
            "Workers this front end knows, by role and state: serving (in rotation), unhealthy, "
            "unpaired (healthy, but no server of the other role can exchange KV with it)",
            labels=["role", "state"],
        )
        lists, unhealthy = self._cluster["server_lists"], self._cluster["unhealthy"]
        for role in ("context", "generation"):
            unpaired = sum(
                1 for s in self._cluster["servers"] if s["role"] == role and s.get("unpaired")
            )
            family.add_metric([role, "serving"], len(lists.get(role) or []))
            family.add_metric([role, "unhealthy"], len(unhealthy.get(role) or []))
            family.add_metric([role, "unpaired"], unpaired)
        yield family
