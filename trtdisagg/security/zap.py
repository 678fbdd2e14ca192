"""The ZAP handler: libzmq asks it about every client of a CURVE control ROUTER. A Trio task.

ZAP (ZeroMQ RFC 27) is how libzmq lets an application authenticate connections: a CURVE server
socket with a ZAP domain (`sockets.configure_curve_server`) sends one request per handshake to
whatever is bound at `inproc://zeromq.zap.01` in its context, and admits the client only on a
"200" reply. The request names the mechanism, the client's IP address and, for CURVE, the
client's 32-byte public key; it carries nothing else about the client (no label, no routing id:
its "identity" frame is the server socket's own routing id). So this handler cannot know whom a
key belongs to. It admits every CURVE client that got this far, which means the client already
knew the cluster's server public key, and sets the connection's User-Id to the client's z85
public key. The ROUTER's reader then checks each message's User-Id against its label
(`verify.py`); that is where a key that does not match its label is refused.

Anything else is refused (400): another mechanism, another domain, a malformed request. A
request without a routing envelope cannot be answered and is dropped. `answer_zap` is the pure
decision; `serve_zap` is the shell.

Lifecycle: `await nursery.start(serve_zap)` once per zmq context, before any CURVE
ROUTER of that context binds, in a nursery that outlives those ROUTERs. It binds a ROUTER at
the ZAP endpoint (ZapUnavailable if something else holds it: one handler per context, and libzmq
frees the name only some time after the previous handler's socket closes), answers until
cancelled, then closes its socket; from then on every new handshake on that context fails
(ZAP enforcement), while connections already made stay up.

Pyzmq's `zmq.auth` offers a thread and an asyncio authenticator, neither of which fits Trio; its
base `Authenticator` needs a REP socket that it answers with blocking sends, and admits NULL
clients by default. The protocol is a handful of frames each way, so this module speaks it
directly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

import attrs
import trio
import zmq
from zmq.utils import z85

from trtdisagg.ratelimit import LogRateLimit, log_limited
from trtdisagg.security.sockets import ZAP_DOMAIN

log = logging.getLogger(__name__)

ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
ZAP_VERSION: Final = b"1.0"
_CURVE_KEY_BYTES: Final = 32


class ZapUnavailable(RuntimeError):
    """The ZAP endpoint of this context is taken (another handler, or one that just closed)."""


@attrs.frozen(kw_only=True)
class ZapAnswer:
    """The decision on one ZAP request: the reply's frames (envelope included), or None when
    the request cannot be answered at all."""

    reply: tuple[bytes, ...] | None
    accepted: bool
    reason: str


def answer_zap(frames: Sequence[bytes], *, domain: bytes = ZAP_DOMAIN) -> ZapAnswer:
    """The answer to one ZAP request as a ROUTER receives it: a routing id and an empty
    delimiter, then version, request id, domain, address, identity, mechanism, credentials."""
    # The ROUTER puts the one routing id in front of libzmq's empty delimiter.
    if len(frames) < 2 or not frames[0] or frames[1]:
        return ZapAnswer(reply=None, accepted=False, reason="no routing envelope")
    envelope, body = tuple(frames[:2]), frames[2:]
    if len(body) < 6:
        request_id = body[1] if len(body) > 1 else b""
        return _refuse(envelope, request_id, "malformed request")
    version, request_id, asked_domain, _address, _identity, mechanism, *credentials = body
    if version != ZAP_VERSION:
        return _refuse(envelope, request_id, "unsupported ZAP version")
    if asked_domain != domain:
        return _refuse(envelope, request_id, "unknown domain")
    if mechanism != b"CURVE":
        return _refuse(envelope, request_id, "CURVE only")
    if len(credentials) != 1 or len(credentials[0]) != _CURVE_KEY_BYTES:
        return _refuse(envelope, request_id, "malformed CURVE credentials")
    user_id = z85.encode(credentials[0])
    reply = (*envelope, ZAP_VERSION, request_id, b"200", b"OK", user_id, b"")
    return ZapAnswer(reply=reply, accepted=True, reason="OK")


def _refuse(envelope: tuple[bytes, ...], request_id: bytes, reason: str) -> ZapAnswer:
    reply = (*envelope, ZAP_VERSION, request_id, b"400", reason.encode(), b"", b"")
    return ZapAnswer(reply=reply, accepted=False, reason=reason)


@attrs.frozen(kw_only=True)
class ZapStatistics:
    accepted: int
    refused: int
    unanswerable: int


@attrs.define(eq=False, kw_only=True)
class ZapHandler:
    """What `serve_zap` hands to `task_status.started`: its counts."""

    domain: bytes
    _accepted: int = attrs.field(default=0, init=False)
    _refused: int = attrs.field(default=0, init=False)
    _unanswerable: int = attrs.field(default=0, init=False)
    _warnings: LogRateLimit = attrs.field(
        factory=lambda: LogRateLimit(lines=5, interval_s=60.0), init=False
    )

    def answer(self, frames: Sequence[bytes]) -> tuple[bytes, ...] | None:
        answer = answer_zap(frames, domain=self.domain)
        if answer.accepted:
            self._accepted += 1
        elif answer.reply is None:
            self._unanswerable += 1
        else:
            self._refused += 1
        if not answer.accepted:
            # Only our own sockets' handshakes reach this endpoint: a refusal means a socket
            # of this process is set up wrongly, not an attack, but it is still bounded.
            log_limited(log, self._warnings, answer.reason, trio.current_time(),
                        "ZAP refused a connection: %s", answer.reason)  # fmt: skip
        return answer.reply

    def statistics(self) -> ZapStatistics:
        return ZapStatistics(
            accepted=self._accepted, refused=self._refused, unanswerable=self._unanswerable
        )


_Context = zmq.Context[zmq.Socket[bytes]]


async def serve_zap(
    context: _Context | None = None,
    *,
    domain: bytes = ZAP_DOMAIN,
    task_status: trio.TaskStatus[ZapHandler] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer ZAP requests of `context`'s sockets (default: `zmq.Context.instance()`, the
    messenger's default) until cancelled (module docstring)."""
    socket: zmq.Socket[bytes] = (context or zmq.Context.instance()).socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.bind(ZAP_ENDPOINT)
    except zmq.ZMQError as exc:
        socket.close(linger=0)
        raise ZapUnavailable(f"cannot bind {ZAP_ENDPOINT}: {exc}") from None
    try:
        handler = ZapHandler(domain=domain)
        task_status.started(handler)
        await _answer_forever(socket, handler)
    finally:
        socket.close(linger=0)


async def _answer_forever(socket: zmq.Socket[bytes], handler: ZapHandler) -> None:
    # The FD is edge-triggered: wait on it only after a NOBLOCK receive found nothing AND a
    # fresh read of EVENTS (which re-arms the edge) shows nothing either.
    fd = int(socket.getsockopt(zmq.FD))
    while True:
        try:
            frames = socket.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            if not int(socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                await trio.lowlevel.wait_readable(fd)
            continue
        reply = handler.answer(frames)
        if reply is not None:
            # A ROUTER never blocks a send: a reply to a handshake that is gone is dropped.
            socket.send_multipart(list(reply), flags=zmq.NOBLOCK)
        await trio.lowlevel.checkpoint()
