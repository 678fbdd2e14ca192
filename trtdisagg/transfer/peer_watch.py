"""The I/O around PeerLiveness (transfer/liveness.py): probe the peer instances that went
silent, and have the transceiver forget those that are gone (part of its shell)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

import attrs
import trio

from trtdisagg.transfer.errors import TransferLayerError
from trtdisagg.transfer.protocol.liveness import Gone, PeerLiveness
from trtdisagg.transfer.protocol.wire import PROTOCOL_VERSION, Message, RequestInstanceInfo

log = logging.getLogger(__name__)


@attrs.define(eq=False, kw_only=True)
class PeerWatch:
    liveness: PeerLiveness
    clock: Callable[[], float]
    _send: Callable[[str, Message], Awaitable[None]]  # on the dealer to an endpoint
    _forget: Callable[[Gone], None]  # forget one peer instance, and unload its agents
    forgotten: int = 0  # peer instances forgotten as gone (since start)
    dead: int = 0  # ... of which had ended (`Gone.dead`)
    probes: int = 0  # probes sent (since start)

    async def run(self) -> None:
        watch = self.liveness
        period = min(watch.idle_s, watch.answer_s, watch.relink_s) / 4
        async with trio.open_nursery() as nursery:
            while True:
                await trio.sleep(period)
                now = self.clock()
                for gone in watch.gone(now):
                    watch.forget(gone.instance)
                    self.forgotten += 1
                    self.dead += gone.dead
                    log.warning("peer instance %s is gone (%s)", gone.instance, gone.reason)
                    self._forget(gone)
                for _instance, endpoint in self.liveness.to_probe(now):
                    self.probes += 1
                    nursery.start_soon(self._probe, endpoint)

    async def _probe(self, endpoint: str) -> None:
        """REQUEST_INSTANCE_INFO to a silent peer's rank 0; its answer, if any, reaches
        `PeerLiveness.answered` through the dispatch. A send that cannot even be queued within
        the answer time counts as unanswered."""
        with trio.move_on_after(self.liveness.answer_s), contextlib.suppress(TransferLayerError):
            await self._send(endpoint, RequestInstanceInfo(protocol_version=PROTOCOL_VERSION))
