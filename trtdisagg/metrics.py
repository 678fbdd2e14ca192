"""Prometheus metrics (DESIGN.md §9). Each process builds its own registry: no global state."""

from __future__ import annotations

from collections.abc import Callable

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


_LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def event_loop_lag_histogram(registry: CollectorRegistry) -> Histogram:
    """How late the process's Trio loop wakes from a short sleep (see `trtdisagg.loop_lag`)."""
    return Histogram(
        "trtdisagg_event_loop_lag_seconds",
        "Delay of the Trio loop waking from a 100 ms sleep: time some handler held the loop",
        buckets=_LOOP_LAG_BUCKETS,
        registry=registry,
    )


@attrs.define(eq=False, kw_only=True)
class WorkerMetrics:
    registry: CollectorRegistry
    requests_total: Counter
    requests_running: Gauge
    requests_waiting: Gauge
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_latency: Histogram
    kv_total_blocks: Gauge
    kv_free_blocks: Gauge
    kv_reusable_blocks: Gauge
    kv_transfer_bytes: Counter
    kv_transfer_seconds: Histogram
    kv_transfer_descriptors: Counter
    kv_transfer_failures: Counter
    control_bad_frames: Counter
    preemptions: Counter
    step_failures: Counter
    steps: Counter
    step_device_seconds: Counter
    kv_rendezvous: Counter
    kv_sessions: Gauge
    kv_early_messages: Gauge
    kv_quarantined: Gauge
    kv_quarantine_expired: Counter
    kv_bounce_transfers: Counter
    kv_prepared_writes: Counter
    kv_watch_seconds: Counter
    kv_request_notices: Counter
    kv_peers_forgotten: Counter
    kv_peers_dead: Counter
    kv_sends_released: Counter
    control_connections: Gauge
    faults_injected: Counter
    event_loop_lag: Histogram

    @classmethod
    def create(cls) -> WorkerMetrics:
        r = CollectorRegistry()
        p = "trtdisagg_"
        return cls(
            registry=r,
            requests_total=Counter(
                p + "requests", "Finished requests", ["role", "status"], registry=r
            ),
            requests_running=Gauge(p + "requests_running", "Requests holding KV", registry=r),
            requests_waiting=Gauge(p + "requests_waiting", "Requests queued", registry=r),
            time_to_first_token=Histogram(
                p + "time_to_first_token_seconds",
                "Arrival to first token",
                buckets=_LATENCY_BUCKETS,
                registry=r,
            ),
            inter_token_latency=Histogram(
                p + "inter_token_latency_seconds",
                "Time between output tokens",
                buckets=_LATENCY_BUCKETS,
                registry=r,
            ),
            e2e_latency=Histogram(
                p + "e2e_request_latency_seconds",
                "Arrival to last token",
                buckets=_LATENCY_BUCKETS,
                registry=r,
            ),
            kv_total_blocks=Gauge(p + "kv_cache_total_blocks", "KV blocks in the pool", registry=r),
            kv_free_blocks=Gauge(p + "kv_cache_free_blocks", "KV blocks free", registry=r),
            kv_reusable_blocks=Gauge(
                p + "kv_cache_reusable_blocks", "Cached prefix blocks, evictable", registry=r
            ),
            kv_transfer_bytes=Counter(p + "kv_transfer_bytes", "KV bytes moved", registry=r),
            kv_transfer_seconds=Histogram(
                p + "kv_transfer_seconds",
                "KV transfer duration per request",
                buckets=_LATENCY_BUCKETS,
                registry=r,
            ),
            kv_transfer_descriptors=Counter(
                p + "kv_transfer_descriptors", "NIXL descriptors submitted", registry=r
            ),
            kv_transfer_failures=Counter(
                p + "kv_transfer_failures", "Failed KV transfers", registry=r
            ),
            control_bad_frames=Counter(
                p + "control_bad_frames", "Malformed control-plane frames dropped", registry=r
            ),
            preemptions=Counter(p + "preemptions", "Requests preempted for KV space", registry=r),
            step_failures=Counter(
                p + "step_failures",
                "Model steps that raised; the requests in them failed with a 500",
                registry=r,
            ),
            steps=Counter(p + "steps", "Model steps run", registry=r),
            step_device_seconds=Counter(
                p + "step_device_seconds",
                "Device time of the model steps' forward and sampling (CUDA events; on CPU the "
                "forward's wall time): its rate is the device's busy fraction",
                registry=r,
            ),
            kv_rendezvous=Counter(
                p + "kv_rendezvous", "Rendezvous round trips with ctx instances", registry=r
            ),
            kv_sessions=Gauge(
                p + "kv_sessions", "Transfer sessions held by the transceiver", ["side"], registry=r
            ),
            kv_early_messages=Gauge(
                p + "kv_early_messages",
                "Transfer keys whose REQUEST_DATA or CANCEL waits for a session",
                registry=r,
            ),
            kv_quarantined=Gauge(
                p + "kv_quarantined_requests",
                "Ended (failed or cancelled) transfers whose blocks stay pinned: a write may land",
                registry=r,
            ),
            control_connections=Gauge(
                p + "control_connections",
                "Open control-plane connections (DEALERs) to peers",
                registry=r,
            ),
            kv_bounce_transfers=Counter(
                p + "kv_bounce_transfers",
                "KV transfers through the staging (bounce) buffers, sends and receives",
                registry=r,
            ),
            kv_prepared_writes=Counter(
                p + "kv_prepared_writes",
                "KV writes prepared while their prefill ran and posted when the KV was ready",
                registry=r,
            ),
            kv_watch_seconds=Counter(
                p + "kv_watch_seconds",
                "Seconds the transceiver spun its event loop watching for a peer's next move "
                "(a core busy; only while the executor ran no step)",
                registry=r,
            ),
            kv_request_notices=Counter(
                p + "kv_request_notices",
                "REQUEST_DATA that ctx took from a transfer-agent notification, ahead of its "
                "ZMQ copy (context_first, on workers that watch for requests)",
                registry=r,
            ),
            kv_peers_forgotten=Counter(
                p + "kv_peers_forgotten",
                "Peer instances forgotten as gone (unanswered probes, or another instance at "
                "their endpoint), their transfer agents unloaded",
                registry=r,
            ),
            kv_peers_dead=Counter(
                p + "kv_peers_dead",
                "Peer instances forgotten because their process ended (their control connection "
                "dropped and stayed down, or another instance took their endpoint); what waited "
                "on them failed at once",
                registry=r,
            ),
            kv_sends_released=Counter(
                p + "kv_sends_released",
                "context_only requests whose KV the coordinator released before any gen took "
                "it (the gen leg was refused, unreachable, or its client left)",
                registry=r,
            ),
            kv_quarantine_expired=Counter(
                p + "kv_quarantine_expired",
                "gen blocks freed without ctx's answer, a second kv_transfer_timeout_ms late",
                registry=r,
            ),
            faults_injected=Counter(
                p + "faults_injected",
                "Faults injected for tests (TRTDISAGG_FAULTS)",
                ["action", "message"],
                registry=r,
            ),
            event_loop_lag=event_loop_lag_histogram(r),
        )

    def render(self, refresh: Callable[[], None] | None = None) -> bytes:
        if refresh is not None:
            refresh()
        return generate_latest(self.registry)
