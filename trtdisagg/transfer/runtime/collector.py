"""The transceiver's counters, and the Prometheus collector that reads them (DESIGN.md §9).

`build_transceiver` (worker/transfer_setup.py) registers one `TransferCollector` on the worker's
registry; every scrape reads the driver's `statistics()` and its `WriteTally` then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs
from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


@attrs.frozen(kw_only=True)
class TransceiverStatistics:
    rendezvous: int  # gen's rendezvous with ctx instances (since start)
    senders: int
    receivers: int
    bad_frames: int
    quarantined: int = 0  # sessions over (failed, cancelled) whose blocks a write may still reach
    quarantine_expired: int = 0  # gen quarantines ended by the second timeout, not by ctx
    early: int = 0  # transfer keys with REQUEST_DATA or CANCEL waiting for their session
    bounced: int = 0  # transfers that went through the staging buffers (sends and receives)
    connections: int = 0  # open DEALERs to peers' control endpoints
    probes: int = 0  # liveness probes sent to silent peer instances (liveness.py)
    peers_forgotten: int = 0  # peer instances forgotten as gone (liveness.py)
    peers_dead: int = 0  # ... of which had ended: what waited on them failed at once
    # control messages dropped or refused, by reason (protocol/side.py, and the socket's
    # `unauthenticated`)
    refused: dict[str, int] = attrs.Factory(dict)


class WriteTally:
    """KV writes that ended well: bytes, descriptors, and a histogram of their seconds (in no
    registry: the transceiver's collector yields them). `watch(bytes, seconds, peer)` also sees
    each (the worker's bandwidth floor, worker/slow_writes.py)."""

    def __init__(self, watch: Callable[[int, float, str], None] | None = None) -> None:
        self._watch = watch
        p = "trtdisagg_"
        self.bytes = Counter(p + "kv_transfer_bytes", "KV bytes moved", registry=None)
        self.descriptors = Counter(p + "kv_transfer_descriptors", "NIXL descriptors submitted",
                                   registry=None)  # fmt: skip
        self.seconds = Histogram(p + "kv_transfer_seconds", "KV transfer duration per request",
                                 buckets=SECONDS_BUCKETS, registry=None)  # fmt: skip

    def count(self, num_bytes: int, num_descriptors: int, seconds: float, peer: str) -> None:
        """A write of `num_bytes` to gen rank `peer` ("instance#rank") took `seconds`."""
        self.bytes.inc(num_bytes)
        self.descriptors.inc(num_descriptors)
        self.seconds.observe(seconds)
        if self._watch is not None:
            self._watch(num_bytes, seconds, peer)


# Metrics read from `TransceiverStatistics` at each scrape: (field, name, kind, help).
_READ = (
    ("bad_frames", "control_bad_frames", "counter", "Malformed control-plane frames dropped"),
    ("rendezvous", "kv_rendezvous", "counter", "Rendezvous round trips with ctx instances"),
    ("early", "kv_early_messages", "gauge",
     "Transfer keys whose REQUEST_DATA or CANCEL waits for a session"),
    ("quarantined", "kv_quarantined_requests", "gauge",
     "Ended (failed or cancelled) transfers whose blocks stay pinned: a write may land"),
    ("quarantine_expired", "kv_quarantine_expired", "counter",
     "gen blocks freed without ctx's answer, a second kv_transfer_timeout_ms late"),
    ("connections", "control_connections", "gauge",
     "Open control-plane connections (DEALERs) to peers"),
    ("bounced", "kv_bounce_transfers", "counter",
     "KV transfers through the staging (bounce) buffers, sends and receives"),
    ("probes", "kv_peer_probes", "counter",
     "Liveness probes sent to peer instances silent for peer_probe_ms"),
    ("peers_forgotten", "kv_peers_forgotten", "counter",
     "Peer instances forgotten as gone (unanswered probes, or another instance at their "
     "endpoint), their transfer agents unloaded"),
    ("peers_dead", "kv_peers_dead", "counter",
     "Peer instances forgotten because their process ended (their control connection dropped "
     "and stayed down, or another instance took their endpoint); what waited on them failed "
     "at once"),
)  # fmt: skip
_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


class TransferCollector(Collector):
    """The transfer metrics of one worker, read from its transceiver at each scrape."""

    def __init__(self, statistics: Callable[[], TransceiverStatistics], tally: WriteTally) -> None:
        self._statistics = statistics
        self._tally = tally

    def collect(self) -> Iterator[Metric]:
        p, stats, tally = "trtdisagg_", self._statistics(), self._tally
        for metric in (tally.bytes, tally.descriptors, tally.seconds):
            yield from metric.collect()
        sessions = GaugeMetricFamily(
            p + "kv_sessions", "Transfer sessions held by the transceiver", labels=["side"]
        )
        sessions.add_metric(["sender"], stats.senders)
        sessions.add_metric(["receiver"], stats.receivers)
        yield sessions
        refused = CounterMetricFamily(
            p + "control_refused", "Control messages dropped: an unauthenticated connection, a"
            " sender that is not who it names, another peer's session, a peer over its limit",
            labels=["reason"],
        )  # fmt: skip
        for reason, count in sorted(stats.refused.items()):
            refused.add_metric([reason], count)
        yield refused
        for field, name, kind, doc in _READ:
            yield _FAMILIES[kind](p + name, doc, value=getattr(stats, field))
