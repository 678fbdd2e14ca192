"""The transceiver's counters: `KvTransceiver.statistics()` and its `WriteTally`.

The worker's `TransferCollector` (trtdisagg/metrics.py) reads them at every scrape.
"""

from __future__ import annotations

import bisect

import attrs

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
    prepared: int = 0  # writes prepared before their KV was ready and not yet posted
    prepared_posts: int = 0  # writes posted from such a preparation (since start)
    # peer instances watched for being gone (liveness.py), and forgotten as gone
    peers_watched: int = 0
    peers_forgotten: int = 0
    peers_dead: int = 0  # ... of which had ended: what waited on them failed at once
    peer_probes: int = 0
    # control messages dropped or refused, by reason (protocol/side.py, and the socket's
    # `unauthenticated`)
    refused: dict[str, int] = attrs.Factory(dict)


@attrs.define(eq=False)
class WriteTally:
    """KV writes that ended well: bytes, descriptors, and a histogram of their seconds."""

    num_bytes: int = 0
    num_descriptors: int = 0
    seconds_sum: float = 0.0
    buckets: list[int] = attrs.Factory(lambda: [0] * (len(SECONDS_BUCKETS) + 1))

    def count(self, num_bytes: int, num_descriptors: int, seconds: float) -> None:
        self.num_bytes += num_bytes
        self.num_descriptors += num_descriptors
        self.seconds_sum += seconds
        self.buckets[bisect.bisect_left(SECONDS_BUCKETS, seconds)] += 1
