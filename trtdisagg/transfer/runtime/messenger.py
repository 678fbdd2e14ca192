"""Messenger: Trio-native ZeroMQ ROUTER (bind) and DEALER (connect); the only module using zmq.

With a cluster secret (trtdisagg/security/) a ROUTER is a CURVE server that checks each message's
connection first (`PeerVerifier`): one that proved no member's label is dropped and counted; a
DEALER is a CURVE client of its rank's `label`. Without, plain TCP (loopback only).
`ZMQ_MAXMSGSIZE` caps every frame.

Each socket has ONE pump task, the only one that waits on its FD. pyzmq's FD is edge-triggered:
the pump tries with NOBLOCK, and on `zmq.Again` reads `EVENTS` (which re-arms the edge) before
it waits; a send may consume the edge, so it re-reads EVENTS and wakes a waiting pump. Received
messages are decoded (wire.py) into a bounded inbox (full: they stay queued in zmq). A DEALER
queues a send that zmq would block on; a ROUTER drops it, counted (`overflowed`): waiting for a
peer that does not read would hold every other peer's replies behind it. A malformed message is
counted and dropped: the pump never dies of peer input; any other zmq error crashes its nursery.
"""

from __future__ import annotations

import collections
import itertools
import logging
import struct
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Final

import attrs
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from trtdisagg.ratelimit import LogRateLimit, log_limited
from trtdisagg.security.keys import PeerLabel
from trtdisagg.security.secret import ClusterSecret
from trtdisagg.security.sockets import (
    configure_curve_client,
    configure_curve_server,
    configure_unsecured,
    connection_claims,
)
from trtdisagg.security.verify import PeerVerifier
from trtdisagg.transfer.errors import ProtocolError
from trtdisagg.transfer.protocol.wire import Message, decode, encode

log = logging.getLogger(__name__)

_RETRY_WHILE_BLOCKED_S = 0.005  # re-try a blocked send this often (ROUTER reports no edge for it)
_Socket = zmq.Socket[bytes]
_Context = zmq.Context[_Socket]
UP: Final = zmq.EVENT_HANDSHAKE_SUCCEEDED
DOWN: Final = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
HANDSHAKE_FAILED: Final = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)  # fmt: skip
_monitor_ids = itertools.count()


@attrs.define(kw_only=True)
class MessengerStatistics:
    bad_frames: int = 0  # dropped for a wrong frame count or an undecodable payload
    unroutable: int = 0  # ROUTER replies to an identity that is not connected
    overflowed: int = 0  # ROUTER replies dropped: that peer's queue was full (it does not read)
    refused: int = 0  # secured ROUTER: messages from connections that proved no member's label
    handshakes_refused: int = 0  # secured ROUTER: peers without the cluster secret, cut off


class _Pump:
    """A socket and the one task that touches it (the module docstring)."""

    frames = 1  # per message: the ROUTER's have its sender's identity first
    drop_when_full = False  # a message zmq would block on is dropped (counted), never queued

    def __init__(self, socket: _Socket, endpoint: str, *, queue_size: int,
                 verifier: PeerVerifier | None) -> None:  # fmt: skip
        self.socket = socket
        self.endpoint = endpoint
        self.verifier = verifier
        self.outbox: collections.deque[list[bytes]] = collections.deque()
        self.queue_size = queue_size
        self.inbox_send, self.inbox = trio.open_memory_channel[
            tuple[bytes, Message, PeerLabel | None]  # (ROUTER identity, message, proven label)
        ](queue_size)
        self.space = trio.lowlevel.ParkingLot()
        self.wait_scope: trio.CancelScope | None = None
        self.inbox_full = False
        self.warnings = LogRateLimit(lines=5, interval_s=60.0)
        self.counts = MessengerStatistics()  # (`refused` is the verifier's)

    def has_room(self, count: int) -> bool:
        """Whether `count` messages would be taken now without waiting."""
        return len(self.outbox) + count <= self.queue_size

    def wake(self) -> None:
        if self.wait_scope is not None:
            self.wait_scope.cancel()

    def warn(self, who: Hashable, message: str, *args: object) -> None:
        log_limited(log, self.warnings, who, time.monotonic(), message, *args)

    def flush_warnings(self) -> None:
        """Log how many warnings about quiet peers were suppressed (call it now and then)."""
        now = time.monotonic()
        for who, count in self.warnings.flush(now):
            log.warning("%d more bad control messages from %s", count, who)
        if self.verifier is not None:
            self.verifier.flush_warnings(now)

    def _send_nowait(self, frames: list[bytes]) -> None:
        """Send now, or queue for the pump, from synchronous code on the socket's Trio thread:
        trio.WouldBlock (nothing sent or queued) when the outbox is full."""
        if not self.outbox and self._try_send(frames):
            if self.wait_scope is not None and self._events() & zmq.POLLIN:
                self.wake()  # the send consumed the FD's edge: the pump must look again
            return
        if not self.has_room(1):
            raise trio.WouldBlock
        self.outbox.append(frames)
        self.wake()

    def _try_send(self, frames: list[bytes]) -> bool:
        """One NOBLOCK send; False if zmq would block (nothing sent)."""
        try:
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            if not self.drop_when_full:
                return False
            if not self.counts.overflowed:
                log.warning("a control-plane peer does not read its replies; dropping them")
            self.counts.overflowed += 1
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.counts.unroutable += 1
        return True

    def _events(self) -> int:
        return int(self.socket.getsockopt(zmq.EVENTS))

    async def _receive(self) -> tuple[bytes, Message, PeerLabel | None]:
        received = await self.inbox.receive()
        if self.inbox_full:
            self.wake()
        return received

    def _flush(self) -> bool:
        """Send queued messages until zmq blocks; True if blocked with messages left."""
        while self.outbox:
            if not self._try_send(self.outbox[0]):
                return True
            self.outbox.popleft()
            self.space.unpark()
        return False

    def _drain(self) -> None:
        """Receive until zmq is empty or the inbox is full (then `inbox_full`; zmq keeps the rest
        queued and `_receive` wakes us when there is room)."""
        self.inbox_full, stats = False, self.inbox_send.statistics
        while stats().current_buffer_used < stats().max_buffer_size:
            peer = None
            try:
                if self.verifier is None:
                    frames = self.socket.recv_multipart(flags=zmq.NOBLOCK)
                else:  # uncopied frames keep their connection's properties
                    raw = self.socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    peer = self.verifier.admit(connection_claims(raw[-1]), time.monotonic())
                    if peer is None:
                        continue  # refused: counted and logged, nothing else looks at it
                    frames = [frame.bytes for frame in raw]
            except zmq.Again:
                return
            # who sent it, for log lines: the label it proved, its identity, or where we dialled
            who = peer.text if peer else frames[0].hex() if self.frames == 2 else self.endpoint
            try:
                if len(frames) != self.frames:
                    raise ProtocolError(f"{len(frames)} frames, not {self.frames}")
                message = decode(frames[-1])
            except ProtocolError as exc:
                self.counts.bad_frames += 1
                self.warn(who, "dropped a message from %s: %s", who, exc)
                continue
            self.inbox_send.send_nowait((frames[0] if self.frames == 2 else b"", message, peer))
        self.inbox_full = True

    async def run(self) -> None:
        fd = int(self.socket.getsockopt(zmq.FD))
        while True:
            blocked = self._flush()
            self._drain()
            events = self._events()  # also re-arms the FD's edge
            readable = events & zmq.POLLIN and not self.inbox_full
            if readable or (self.outbox and not blocked and events & zmq.POLLOUT):
                await trio.lowlevel.checkpoint()
                continue
            # Nothing to do until the FD signals, `send`/`receive` wake us, or (blocked) a retry.
            with trio.CancelScope() as self.wait_scope:
                if blocked:
                    self.wait_scope.deadline = trio.current_time() + _RETRY_WHILE_BLOCKED_S
                await trio.lowlevel.wait_readable(fd)
            self.wait_scope = None

    def statistics(self) -> MessengerStatistics:
        refused = self.verifier.statistics().refused if self.verifier is not None else 0
        return attrs.evolve(self.counts, refused=refused)


class Router(_Pump):
    """A bound ROUTER: receive (identity, message, peer) from DEALERs, send back by identity."""

    frames = 2
    drop_when_full = True

    def handshake_failed(self, _event: int) -> None:
        self.counts.handshakes_refused += 1
        self.warn("handshake", "refused a control connection: its handshake failed (a peer"
                  " without the cluster secret)")  # fmt: skip

    async def receive_message(self) -> tuple[bytes, Message, PeerLabel | None]:
        return await self._receive()

    def send_message_nowait(self, identity: bytes, message: Message) -> None:
        self._send_nowait([identity, encode(message)])


class Dealer(_Pump):
    """A connected DEALER: send messages to its ROUTER, receive what the ROUTER sends back."""

    async def receive_message(self) -> Message:
        return (await self._receive())[1]

    async def send_message(self, message: Message) -> None:
        # Cancellation is checked before sending, but the scheduling round every async call owes
        # comes after it (as in trio's own Lock.acquire): the message leaves a round earlier.
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self.has_room(1):
            await self.space.park()
        self._send_nowait([encode(message)])
        await trio.lowlevel.cancel_shielded_checkpoint()

    def send_message_nowait(self, message: Message) -> None:
        self._send_nowait([encode(message)])


@contextmanager
def _socket(kind: int, context: _Context | None, high_water_mark: int) -> Iterator[_Socket]:
    socket = (context or zmq.Context.instance()).socket(kind)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, high_water_mark)
        socket.setsockopt(zmq.RCVHWM, high_water_mark)
        yield socket
    finally:
        socket.close(linger=0)


@asynccontextmanager
async def open_router(bind: str = "tcp://127.0.0.1:0", *, secret: ClusterSecret | None = None,
                      context: _Context | None = None, queue_size: int = 1024,
                      high_water_mark: int = 1000) -> AsyncIterator[Router]:  # fmt: skip
    """Bind a ROUTER to `bind` (port 0 or `*`: any free port, then read `router.endpoint`); with
    `secret` a CURVE server, whose context must run a ZAP task (`security.zap.serve_zap`).
    `queue_size` bounds the inbox (and a DEALER's outbox); `high_water_mark` is zmq's, per peer."""
    with _socket(zmq.ROUTER, context, high_water_mark) as socket:
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if secret is not None:
            configure_curve_server(socket, secret)
        else:
            configure_unsecured(socket)
        socket.bind(bind)
        endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        verifier = PeerVerifier(secret=secret) if secret is not None else None
        router = Router(socket, endpoint, queue_size=queue_size, verifier=verifier)
        # A secured ROUTER counts the handshakes it refused (peers without the cluster secret).
        refusals = router.handshake_failed if secret is not None else None
        async with _running(router, HANDSHAKE_FAILED, refusals):
            yield router


@asynccontextmanager
async def open_dealer(
    endpoint: str, *, secret: ClusterSecret | None = None, label: PeerLabel | None = None,
    context: _Context | None = None, queue_size: int = 1024, high_water_mark: int = 1000,
    on_link: Callable[[bool], None] | None = None,
) -> AsyncIterator[Dealer]:  # fmt: skip
    """Connect a DEALER to a ROUTER's `endpoint` (zmq connects in the background); with `secret`
    as a CURVE client speaking for `label` (required then). `on_link(up)` is told each time the
    link comes up or goes down (`LinkState`)."""
    with _socket(zmq.DEALER, context, high_water_mark) as socket:
        if secret is None:
            configure_unsecured(socket)
        elif label is None:
            raise ValueError("a CURVE dealer needs the label of the rank it speaks for")
        else:
            configure_curve_client(socket, secret, label)
        events = LinkState(endpoint, on_link) if on_link is not None else None
        dealer = Dealer(socket, endpoint, queue_size=queue_size, verifier=None)
        async with _running(dealer, UP | DOWN | HANDSHAKE_FAILED, events, endpoint):
            yield dealer


@asynccontextmanager
async def _running(pump: _Pump, events: int, on_event: Callable[[int], None] | None,
                   connect: str | None = None) -> AsyncIterator[None]:  # fmt: skip
    """Run `pump` while the body runs, with `on_event` told of its socket's `events`, then
    connect to `connect` if given (once the monitor is open: no event is missed). The body's own
    exception leaves unwrapped."""
    try:
        async with trio.open_nursery() as nursery:
            if on_event is not None:
                await nursery.start(_watch, pump.socket, events, on_event)
            if connect is not None:
                pump.socket.connect(connect)
            nursery.start_soon(pump.run)
            yield
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


@attrs.define(eq=False)
class LinkState:
    """A DEALER's monitor events as `on_link(up)` calls, one per change: up once its handshake
    succeeds (a NULL one too); down when it drops, when a connect is refused (only the first of
    zmq's retries is news) or when the handshake fails (another cluster secret: logged once)."""

    endpoint: str
    on_link: Callable[[bool], None]
    up: bool | None = None
    refused: bool = False

    def __call__(self, event: int) -> None:
        if event & HANDSHAKE_FAILED and not self.refused:
            self.refused = True
            log.warning("control connection to %s: its handshake failed (wrong cluster_secret?)",
                        self.endpoint)  # fmt: skip
        up = bool(event & UP)
        if up != self.up:
            self.up = up
            self.on_link(up)


async def _watch(
    socket: _Socket, events: int, on_event: Callable[[int], None], *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:  # fmt: skip
    """Call `on_event(event)` for each of `socket`'s `events`, read from a monitor (edge-triggered
    like any zmq FD); started once the monitor is open, or once zmq refused one (logged)."""
    # a PAIR socket with an inproc name of its own: zmq's reaper may still hold pyzmq's default
    # name for a closed socket
    address = f"inproc://trtdisagg.monitor.{next(_monitor_ids)}"
    try:
        monitor = socket.get_monitor_socket(events, addr=address)
    except zmq.ZMQError as exc:
        log.warning("no connection events (liveness falls back to probes): %s", exc)
        task_status.started()
        return
    task_status.started()
    fd = int(monitor.getsockopt(zmq.FD))
    try:
        while True:
            try:
                frames = monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                if not int(monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # re-arms the edge
                    await trio.lowlevel.wait_readable(fd)
                continue
            try:
                event = parse_monitor_message(frames)["event"]
            except (ValueError, IndexError, struct.error):
                continue  # not an event zmq would send
            on_event(event)
            await trio.lowlevel.checkpoint()
    finally:
        # before either socket closes: zmq's I/O thread blocks for good on an event for a
        # closed reader
        try:
            socket.disable_monitor()
        except zmq.ZMQError as exc:
            log.warning("could not stop a socket monitor: %s", exc)
        monitor.close(linger=0)
