"""ctx: KV writes that ran below the bandwidth floor `kv_transfer_min_gbps` (peers.md, pain point
20: a transport that fell back to TCP moved KV 100x slower, and nothing said so).

A write is judged only when it is large and long enough for its bandwidth to mean something:
at least `JUDGED_BYTES`, and at least `JUDGED_SECONDS` from its post to its end. Below that the
fixed costs of a write (the post, the poll that sees it end, a busy event loop) outweigh its
bytes, and a healthy link would look slow. A slow write is counted
(`trtdisagg_kv_slow_writes_total`) and logged, at most once a `WARN_EVERY_S` per gen instance, with
the writes since its last warning, so that a link that is slow for good does not flood the log.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Final

import attrs
from prometheus_client import Counter

log = logging.getLogger(__name__)

JUDGED_BYTES: Final = 4 << 20
JUDGED_SECONDS: Final = 1e-3
WARN_EVERY_S: Final = 60.0
# gen instances whose last warning is remembered (instances come and go; the oldest goes first)
MAX_REMEMBERED_PEERS: Final = 1024


@attrs.define(eq=False, kw_only=True)
class SlowWrites:
    min_gbps: float = attrs.field(validator=attrs.validators.gt(0))
    counter: Counter  # trtdisagg_kv_slow_writes_total
    clock: Callable[[], float] = time.monotonic
    # gen instance -> (when it was last warned of, slow writes since then)
    _warned: collections.OrderedDict[str, tuple[float, int]] = attrs.field(
        factory=collections.OrderedDict, alias="warned"
    )

    def observe(self, num_bytes: int, seconds: float, peer: str) -> None:
        """One KV write that ended well: `num_bytes` to gen rank `peer` ("instance#rank") in
        `seconds` from its post to its end."""
        if num_bytes < JUDGED_BYTES or seconds < JUDGED_SECONDS:
            return
        gbps = num_bytes / seconds / 1e9
        if gbps >= self.min_gbps:
            return
        self.counter.inc()
        instance = peer.rpartition("#")[0] or peer
        now = self.clock()
        last, unwarned = self._warned.get(instance, (None, 0))
        if last is not None and now - last < WARN_EVERY_S:
            self._warned[instance] = (last, unwarned + 1)
            return
        log.warning(
            "KV writes to gen %s run below kv_transfer_min_gbps (%g GB/s): %.1f MiB to rank %s "
            "at %.2f GB/s%s. Is UCX on the transport this link should use (UCX_TLS, "
            "UCX_NET_DEVICES), or is the link itself slow?",
            instance, self.min_gbps, num_bytes / (1 << 20), peer.rpartition("#")[2] or "?", gbps,
            f"; {unwarned} more slow writes to it since the last warning" if unwarned else "",
        )  # fmt: skip
        self._warned.pop(instance, None)
        self._warned[instance] = (now, 0)
        while len(self._warned) > MAX_REMEMBERED_PEERS:
            self._warned.popitem(last=False)
