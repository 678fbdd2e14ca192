"""Prometheus metrics (DESIGN.md §9). Each process builds its own registry: no global state.

The KV transfer counters are not here: the transceiver's collector serves them on the same
registry (transfer/runtime/collector.py).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


_LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def event_loop_lag_histogram(
    registry: CollectorRegistry, *, name: str = "trtdisagg_event_loop_lag_seconds"
) -> Histogram:
    """How late the process's Trio loop wakes from a short sleep (see `trtdisagg.loop_lag`)."""
    return Histogram(
        name,
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
    prompt_tokens: Counter
    prefill_tokens: Counter
    kv_total_blocks: Gauge
    kv_free_blocks: Gauge
    kv_reusable_blocks: Gauge
    kv_transfer_failures: Counter
    preemptions: Counter
    step_failures: Counter
    steps: Counter
    step_device_seconds: Counter
    prefill_steps: Counter
    prefill_step_device_seconds: Counter
    kv_sends_released: Counter
    kv_slow_writes: Counter
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
            prompt_tokens=Counter(
                p + "prompt_tokens",
                "Prompt tokens of the requests taken in (a prompt with n choices counts once)",
                registry=r,
            ),
            prefill_tokens=Counter(
                p + "prefill_tokens",
                "Prompt tokens computed by prefill (neither prefix-cached nor received as KV)",
                registry=r,
            ),
            kv_total_blocks=Gauge(p + "kv_cache_total_blocks", "KV blocks in the pool", registry=r),
            kv_free_blocks=Gauge(p + "kv_cache_free_blocks", "KV blocks free", registry=r),
            kv_reusable_blocks=Gauge(
                p + "kv_cache_reusable_blocks", "Cached prefix blocks, evictable", registry=r
            ),
            kv_transfer_failures=Counter(
                p + "kv_transfer_failures", "Failed KV transfers", registry=r
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
            # Steps that carry prompt tokens cost a decode step's weight reads plus the prompt's
            # FLOPs; the decode-only steps' mean is the rest of the two totals.
            prefill_steps=Counter(
                p + "prefill_steps",
                "Model steps that computed prompt tokens (alone or beside decode rows)",
                registry=r,
            ),
            prefill_step_device_seconds=Counter(
                p + "prefill_step_device_seconds",
                "The device time (as trtdisagg_step_device_seconds) of those steps",
                registry=r,
            ),
            kv_sends_released=Counter(
                p + "kv_sends_released",
                "context_only requests whose KV the coordinator released before any gen took "
                "it (the gen leg was refused, unreachable, or its client left)",
                registry=r,
            ),
            kv_slow_writes=Counter(
                p + "kv_slow_writes",
                "ctx: KV writes below cache_transceiver_config.kv_transfer_min_gbps (of those "
                "large and long enough to judge: worker/slow_writes.py)",
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
