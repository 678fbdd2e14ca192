"""The control plane with a test's faults: a ROUTER and DEALERs whose typed sends may be dropped,
duplicated or delayed (spec.py). Tests only: `worker/transfer_setup.py` wraps the transceiver's
sockets in these only when faults are armed (TRTDISAGG_FAULTS).

A delayed message is sent by a task of the wrapper's own nursery, so it never holds up the sender
and is dropped with the socket. `send_message_nowait` draws its fault only once the message can
be taken, so a `trio.WouldBlock` leaves the plan untouched.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import trio

from trtdisagg.faults.spec import FaultAction, FaultInjector
from trtdisagg.security.keys import PeerLabel
from trtdisagg.transfer.protocol.wire import MESSAGE_TAGS, Message
from trtdisagg.transfer.runtime.messenger import (
    Dealer,
    MessengerStatistics,
    Router,
    open_dealer,
)

log = logging.getLogger(__name__)


class _Faults:
    """Decides, for one socket, how each message is sent."""

    def __init__(self, injector: FaultInjector, nursery: trio.Nursery) -> None:
        self._injector = injector
        self._nursery = nursery

    async def send(self, message: Message, send: Callable[[Message], Awaitable[None]]) -> None:
        action, seconds = self._draw(message)
        if action is FaultAction.DROP:
            return
        if action is FaultAction.DELAY:
            self._nursery.start_soon(self._later, seconds, send, message)
            return
        await send(message)
        if action is FaultAction.DUPLICATE:
            await send(message)

    def send_nowait(self, message: Message, send: Callable[[Message], None]) -> None:
        action, seconds = self._draw(message)
        if action is FaultAction.DELAY:

            async def later(message: Message) -> None:
                send(message)

            self._nursery.start_soon(self._later, seconds, later, message)
        elif action is not FaultAction.DROP:
            send(message)
            if action is FaultAction.DUPLICATE:
                send(message)

    def _draw(self, message: Message) -> tuple[FaultAction | None, float]:
        tag = MESSAGE_TAGS[type(message)]
        fault = self._injector.message(tag)
        if fault is None:
            return None, 0.0
        log.info("injected fault: %s %s", fault.action.value, tag)
        return fault.action, fault.seconds

    @staticmethod
    async def _later(
        seconds: float, send: Callable[[Message], Awaitable[None]], message: Message
    ) -> None:
        await trio.sleep(seconds)
        await send(message)


class FaultyRouter:
    """A ROUTER whose replies follow the fault plan."""

    def __init__(self, router: Router, faults: _Faults) -> None:
        self._router = router
        self._faults = faults
        self.endpoint = router.endpoint

    async def receive_message(self) -> tuple[bytes, Message, PeerLabel | None]:
        return await self._router.receive_message()

    def send_message_nowait(self, identity: bytes, message: Message) -> None:
        if not self._router.has_room(2):  # a duplicate too, or no fault is drawn
            raise trio.WouldBlock
        self._faults.send_nowait(message, lambda m: self._router.send_message_nowait(identity, m))

    def statistics(self) -> MessengerStatistics:
        return self._router.statistics()

    def flush_warnings(self) -> None:
        self._router.flush_warnings()


class FaultyDealer:
    """A DEALER whose sends follow the fault plan."""

    def __init__(self, dealer: Dealer, faults: _Faults) -> None:
        self._dealer = dealer
        self._faults = faults
        self.endpoint = dealer.endpoint

    async def receive_message(self) -> Message:
        return await self._dealer.receive_message()

    async def send_message(self, message: Message) -> None:
        await self._faults.send(message, self._dealer.send_message)

    def send_message_nowait(self, message: Message) -> None:
        if not self._dealer.has_room(2):  # a duplicate too, or no fault is drawn
            raise trio.WouldBlock
        self._faults.send_nowait(message, self._dealer.send_message_nowait)

    def statistics(self) -> MessengerStatistics:
        return self._dealer.statistics()

    def flush_warnings(self) -> None:
        self._dealer.flush_warnings()


@asynccontextmanager
async def faulty_router(router: Router, injector: FaultInjector) -> AsyncIterator[FaultyRouter]:
    async with trio.open_nursery() as nursery:
        yield FaultyRouter(router, _Faults(injector, nursery))
        nursery.cancel_scope.cancel()


def faulty_dealers(
    injector: FaultInjector,
    connect: Callable[..., AbstractAsyncContextManager[Dealer]] = open_dealer,
) -> Callable[..., AbstractAsyncContextManager[FaultyDealer]]:
    """`connect` (an `open_dealer`, maybe with its security bound) whose dealers follow the
    fault plan."""

    @asynccontextmanager
    async def open_faulty(
        endpoint: str, *, on_link: Callable[[bool], None] | None = None
    ) -> AsyncIterator[FaultyDealer]:
        async with connect(endpoint, on_link=on_link) as dealer, trio.open_nursery() as nursery:
            yield FaultyDealer(dealer, _Faults(injector, nursery))
            nursery.cancel_scope.cancel()

    return open_faulty
