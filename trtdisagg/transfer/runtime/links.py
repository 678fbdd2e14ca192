"""A zmq socket's connection events, from a monitor: a DEALER's link up and down, a ROUTER's
refused handshakes. Besides messenger.py (its one user) the only module importing zmq.

A link is up once its handshake succeeds (a NULL one too); down when it drops, when a connect is
refused (only the first of zmq's retries is news) or when the handshake fails (another cluster
secret: logged once). A monitor is a PAIR socket with an inproc name of its own (zmq's reaper may
still hold pyzmq's default for a closed socket), stopped before either socket closes (zmq's I/O
thread blocks for good on an event for a closed reader).
"""

from __future__ import annotations

import itertools
import logging
import struct
from collections.abc import Callable
from typing import Final

import attrs
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("trtdisagg.transfer.runtime.messenger")

UP: Final = zmq.EVENT_HANDSHAKE_SUCCEEDED
DOWN: Final = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
HANDSHAKE_FAILED: Final = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_ids = itertools.count()
_Socket = zmq.Socket[bytes]


@attrs.define(eq=False)
class LinkState:
    """A DEALER's events as `on_link(up)` calls, one per change."""

    endpoint: str
    on_link: Callable[[bool], None]
    up: bool | None = None
    refused: bool = False

    def __call__(self, event: int) -> None:
        if event & HANDSHAKE_FAILED and not self.refused:
            self.refused = True
            log.warning("control connection to %s: its handshake failed (wrong cluster_secret?)",
                        self.endpoint)  # fmt: skip
        if event & UP and self.up is not True:
            self.up = True
            self.on_link(True)
        elif event & (DOWN | HANDSHAKE_FAILED) and self.up is not False:
            self.up = False
            self.on_link(False)


def open_monitor(socket: _Socket, events: int) -> _Socket | None:
    """A monitor of `events` on `socket` (open it before the socket connects, so that no event
    is missed), or None (logged) if zmq refuses one."""
    try:
        return socket.get_monitor_socket(events, addr=f"inproc://trtdisagg.monitor.{next(_ids)}")
    except zmq.ZMQError as exc:
        log.warning("no connection events (liveness falls back to probes): %s", exc)
        return None


def stop_monitor(socket: _Socket) -> None:
    """Stop `socket`'s events: before either socket closes (the module docstring says why)."""
    try:
        socket.disable_monitor()
    except zmq.ZMQError as exc:
        log.warning("could not stop a socket monitor: %s", exc)


async def watch(monitor: _Socket, on_event: Callable[[int], None]) -> None:
    """Call `on_event(event)` for each event of `monitor` (a PAIR socket, edge-triggered like
    any zmq FD), until cancelled."""
    fd = int(monitor.getsockopt(zmq.FD))
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
