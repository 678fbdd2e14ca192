"""The transceiver's running totals, copied into the worker's Prometheus metrics at each scrape.

A bridge until the transfer layer exports its own collector: nothing else reads these counters,
and the engine loop never calls this (only `/metrics` does, through `Executor.refresh_gauges`).
"""

from __future__ import annotations

import attrs
from prometheus_client import Counter

from trtdisagg.metrics import WorkerMetrics
from trtdisagg.transfer.transceiver import KvTransceiver


@attrs.define(eq=False, kw_only=True)
class TransferGauges:
    metrics: WorkerMetrics
    transceiver: KvTransceiver
    _synced: dict[str, float] = attrs.field(factory=dict, alias="synced")

    def refresh(self) -> None:
        m, transfer = self.metrics, self.transceiver.statistics()
        self._advance(m.kv_rendezvous, "rendezvous", transfer.rendezvous)
        self._advance(m.control_bad_frames, "bad_frames", transfer.bad_frames)
        self._advance(m.kv_quarantine_expired, "quarantine_expired", transfer.quarantine_expired)
        m.kv_sessions.labels(side="sender").set(transfer.senders)
        m.kv_sessions.labels(side="receiver").set(transfer.receivers)
        m.kv_early_messages.set(transfer.early)
        m.kv_quarantined.set(transfer.quarantined)
        self._advance(m.kv_bounce_transfers, "bounced", transfer.bounced)
        self._advance(m.kv_prepared_writes, "prepared_posts", transfer.prepared_posts)
        self._advance(m.kv_watch_seconds, "watch_s", transfer.watch_s)
        self._advance(m.kv_request_notices, "request_notices", transfer.request_notices)
        self._advance(m.kv_peers_forgotten, "peers_forgotten", transfer.peers_forgotten)
        self._advance(m.kv_peers_dead, "peers_dead", transfer.peers_dead)
        m.control_connections.set(transfer.connections)

    def _advance(self, counter: Counter, name: str, total: float) -> None:
        """Bring a Prometheus counter up to a running total kept by the transceiver."""
        delta = total - self._synced.get(name, 0)
        if delta > 0:
            counter.inc(delta)
            self._synced[name] = total
