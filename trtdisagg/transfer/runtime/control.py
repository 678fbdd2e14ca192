"""ControlPlane: one rank's ROUTER and its DEALERs to peers, owned in one place.

Every message received (on the ROUTER, with the label its sender proved when secured, or on a
DEALER) goes to `deliver` (the driver). `send` puts a message on the DEALER to an endpoint,
opened on first use and kept until `drop`; messages to a DEALER being opened wait in order. A
DEALER reports its link going up or down (`on_link`: liveness.py tells a peer that ended from
one that stalled). Suppressed warnings about peers are counted out every `WARNINGS_FLUSH_S`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Final, Protocol

import attrs
import trio

from trtdisagg.security.keys import PeerLabel
from trtdisagg.transfer.protocol.wire import Message
from trtdisagg.transfer.runtime.messenger import MessengerStatistics

log = logging.getLogger(__name__)

WARNINGS_FLUSH_S: Final = 10.0


class ControlRouter(Protocol):
    endpoint: str

    async def receive_message(self) -> tuple[bytes, Message, PeerLabel | None]: ...
    def send_message_nowait(self, identity: bytes, message: Message) -> None: ...
    def statistics(self) -> MessengerStatistics: ...
    def flush_warnings(self) -> None: ...


class ControlDealer(Protocol):
    async def receive_message(self) -> Message: ...
    async def send_message(self, message: Message) -> None: ...
    def send_message_nowait(self, message: Message) -> None: ...
    def statistics(self) -> MessengerStatistics: ...
    def flush_warnings(self) -> None: ...


DealerOpener = Callable[..., AbstractAsyncContextManager[ControlDealer]]
# message, ROUTER identity and the label it proved (None: unsecured), the DEALER's endpoint
Deliver = Callable[[Message, bytes | None, PeerLabel | None, str], None]


@attrs.define(eq=False, kw_only=True)
class ControlPlane:
    router: ControlRouter
    deliver: Deliver
    on_link: Callable[[str, bool], None]
    connect: DealerOpener  # open_dealer (trtdisagg/faults/ wraps it when armed)
    _nursery: trio.Nursery | None = None
    _dealers: dict[str, ControlDealer] = attrs.Factory(dict)
    _scopes: dict[str, trio.CancelScope] = attrs.Factory(dict)
    _queued: dict[str, list[Message]] = attrs.Factory(dict)  # (`send`)
    _closed_bad_frames: int = 0

    @property
    def connections(self) -> int:
        return len(self._dealers)

    @property
    def bad_frames(self) -> int:
        """Frames dropped as malformed (since start), on every socket."""
        dealers = sum(dealer.statistics().bad_frames for dealer in self._dealers.values())
        return self.router.statistics().bad_frames + self._closed_bad_frames + dealers

    @property
    def refused(self) -> dict[str, int]:
        """What the ROUTER refused (since start): connections that failed their handshake, and
        messages of connections that proved no member's label (messenger.py)."""
        stats = self.router.statistics()
        return {"handshake": stats.handshakes_refused, "unauthenticated": stats.refused}

    async def _flush_warnings(self) -> None:
        while True:
            await trio.sleep(WARNINGS_FLUSH_S)
            self.router.flush_warnings()
            for dealer in self._dealers.values():
                dealer.flush_warnings()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._flush_warnings)
            task_status.started()
            while True:
                identity, message, peer = await self.router.receive_message()
                self.deliver(message, identity, peer, "")

    def reply(self, identity: bytes, message: Message) -> None:
        # never blocks: a ROUTER drops the replies of a peer that does not read (messenger.py)
        self.router.send_message_nowait(identity, message)

    def send(self, endpoint: str, message: Message) -> None:
        """Send on the DEALER to `endpoint` now, or queue it in order (the DEALER is being opened,
        or its outbox is full)."""
        dealer = self._dealers.get(endpoint)
        if dealer is not None and endpoint not in self._queued:
            with contextlib.suppress(trio.WouldBlock):
                dealer.send_message_nowait(message)
                return
        queue = self._queued.setdefault(endpoint, [])
        queue.append(message)
        if len(queue) == 1:
            assert self._nursery is not None, "the transceiver is not running"
            self._nursery.start_soon(self._flush, endpoint)

    def drop(self, endpoint: str) -> None:
        """Close the DEALER to `endpoint` (a peer that is gone, or never answered)."""
        scope = self._scopes.get(endpoint)
        if scope is not None:
            scope.cancel()

    async def _flush(self, endpoint: str) -> None:
        queue = self._queued[endpoint]
        try:
            dealer = self._dealers.get(endpoint)
            if dealer is None:
                assert self._nursery is not None
                dealer = await self._nursery.start(self._hold, endpoint)
            while queue:
                await dealer.send_message(queue[0])
                queue.pop(0)
        except Exception as exc:  # a peer we cannot reach must not take the service down
            log.warning("messages to %s dropped: %s", endpoint, exc)
        finally:
            del self._queued[endpoint]

    async def _hold(self, endpoint: str, *, task_status: trio.TaskStatus[ControlDealer]) -> None:
        """Own the DEALER to `endpoint` until the service ends or it is dropped."""
        with trio.CancelScope() as scope:
            self._scopes[endpoint] = scope
            try:
                on_link = functools.partial(self.on_link, endpoint)
                async with self.connect(endpoint, on_link=on_link) as dealer:
                    self._dealers[endpoint] = dealer
                    task_status.started(dealer)
                    while True:
                        self.deliver(await dealer.receive_message(), None, None, endpoint)
            finally:
                gone = self._dealers.pop(endpoint, None)
                if gone is not None:
                    self._closed_bad_frames += gone.statistics().bad_frames
                self._scopes.pop(endpoint, None)
