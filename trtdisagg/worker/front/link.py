"""One ZeroMQ socket between the engine process and its fronts, driven under Trio.

The engine binds a ROUTER on `ipc://` in a private directory (mode 0700: the filesystem is the
authentication); each front connects one DEALER. A `Link` owns its socket: one pump task
(`run(on_message)`) is the only one that waits on the socket's FD, and hands each message
received to `on_message`, synchronously, in order. Sends are tried at once (`send_nowait`, from
synchronous code on the Trio thread); the rare one that zmq would block is queued for the pump.

pyzmq's FD is edge-triggered (as `transfer/runtime/messenger.py` explains): the pump reads until
`zmq.Again`, then reads `EVENTS` (which re-arms the edge) before it waits; a send may consume
the edge, so it re-reads `EVENTS` and wakes a waiting pump when a message is in.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import attrs
import trio
import zmq

_RETRY_WHILE_BLOCKED_S = 0.005  # a queued send is re-tried this often while zmq refuses it
_Socket = zmq.Socket[bytes]


def open_socket(kind: int, *, identity: bytes | None = None) -> _Socket:
    """A socket of `kind` with no send or receive limit: the peers are this worker's own
    processes, and a bound queue would only move the wait elsewhere."""
    socket: _Socket = zmq.Context.instance().socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        socket.setsockopt(zmq.ROUTING_ID, identity)
    return socket


@attrs.define(eq=False, kw_only=True)
class Link:
    """A socket and its pump (`run`)."""

    socket: _Socket
    _outbox: collections.deque[list[bytes]] = attrs.field(factory=collections.deque, alias="outbox")
    _wait_scope: trio.CancelScope | None = attrs.field(default=None, alias="wait_scope")

    def send_nowait(self, frames: list[bytes]) -> None:
        """Send now, or (zmq would block, or earlier sends wait) queue for the pump, in order."""
        if not self._outbox and self._try_send(frames):
            if self._wait_scope is not None and self._events() & zmq.POLLIN:
                self._wait_scope.cancel()
            return
        self._outbox.append(frames)
        if self._wait_scope is not None:
            self._wait_scope.cancel()

    def _try_send(self, frames: list[bytes]) -> bool:
        try:
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _events(self) -> int:
        return int(self.socket.getsockopt(zmq.EVENTS))

    def _flush(self) -> bool:
        """Send queued messages until zmq blocks; True if some are left."""
        while self._outbox:
            if not self._try_send(self._outbox[0]):
                return True
            self._outbox.popleft()
        return False

    def _drain(self, on_message: Callable[[list[bytes]], None]) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            on_message(frames)

    async def run(self, on_message: Callable[[list[bytes]], None]) -> None:
        """The pump, until cancelled: `on_message` gets each message's frames. The socket stays
        open (`close` closes it), so that the last messages can still be sent once the pump
        stopped."""
        fd = int(self.socket.getsockopt(zmq.FD))
        try:
            while True:
                blocked = self._flush()
                self._drain(on_message)
                if self._events() & zmq.POLLIN:  # also re-arms the FD's edge
                    await trio.lowlevel.checkpoint()
                    continue
                with trio.CancelScope() as self._wait_scope:
                    if blocked:
                        self._wait_scope.deadline = trio.current_time() + _RETRY_WHILE_BLOCKED_S
                    await trio.lowlevel.wait_readable(fd)
                self._wait_scope = None
        finally:
            self._wait_scope = None

    def close(self, *, linger_s: float = 0.0) -> None:
        """Close the socket; zmq keeps sending what it holds for up to `linger_s`."""
        self._flush()
        self.socket.close(linger=int(linger_s * 1000))
