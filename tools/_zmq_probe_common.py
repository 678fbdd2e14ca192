"""Raw pyzmq and hand-made ZMTP helpers for tools/probe_zmq_security.py: fresh contexts whose
sockets all close, CURVE sockets, a poll loop that answers ZAP, and a NULL client written by
hand (a peer that libzmq's own sockets would not let us be)."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import zmq
from zmq.utils.monitor import parse_monitor_message

ZAP = "inproc://zeromq.zap.01"
EVENT_NAMES = {
    getattr(zmq, n): n[6:] for n in dir(zmq) if n.startswith("EVENT_") and n != "EVENT_ALL"
}
Socket = zmq.Socket[bytes]


def rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@contextmanager
def context() -> Iterator[Callable[[int], Socket]]:
    """A fresh context and a socket factory; every socket is closed at the end."""
    ctx: zmq.Context[Socket] = zmq.Context()
    made: list[Socket] = []

    def make(kind: int) -> Socket:
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        made.append(s)
        return s

    try:
        yield make
    finally:
        for s in made:
            s.close(linger=0)
        ctx.term()


def curve_router(
    make: Callable[[int], Socket], secret: bytes, public: bytes, **opts: int | bytes
) -> tuple[Socket, str]:
    router = make(zmq.ROUTER)
    router.curve_server = True
    router.curve_secretkey = secret
    router.curve_publickey = public
    for name, value in opts.items():
        router.setsockopt(getattr(zmq, name), value)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return router, f"tcp://127.0.0.1:{port}"


def curve_dealer(
    make: Callable[[int], Socket], server_public: bytes, keys: tuple[bytes, bytes] | None = None
) -> Socket:
    dealer = make(zmq.DEALER)
    public, secret = keys or zmq.curve_keypair()
    dealer.curve_serverkey = server_public
    dealer.curve_publickey = public
    dealer.curve_secretkey = secret
    return dealer


def pump(
    sockets: dict[str, Socket],
    seconds: float,
    *,
    zap_code: bytes = b"200",
    until: Callable[[dict[str, list[object]]], bool] | None = None,
) -> dict[str, list[object]]:
    """Poll `sockets` (names: zap, router, dealer, monitors m:*), answering ZAP with
    `zap_code`; returns what each produced."""
    seen: dict[str, list[object]] = {name: [] for name in sockets}
    poller = zmq.Poller()
    for s in sockets.values():
        poller.register(s, zmq.POLLIN)
    by_socket = {s: name for name, s in sockets.items()}
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (until and until(seen)):
        for s, _ in poller.poll(20):
            name = by_socket[s]
            if name == "zap":
                request = s.recv_multipart()
                seen[name].append(request)
                user = b"zap-user" if zap_code == b"200" else b""
                text = b"OK" if zap_code == b"200" else b"denied"
                s.send_multipart([*request[:2], b"1.0", request[3], zap_code, text, user, b""])
            elif name.startswith("m:"):
                seen[name].append(EVENT_NAMES[parse_monitor_message(s.recv_multipart())["event"]])
            else:
                seen[name].append(s.recv_multipart(copy=False))
    return seen


def prop(frame: zmq.Frame, name: str) -> object:
    try:
        return frame.get(name)
    except (zmq.ZMQError, UnicodeDecodeError) as exc:
        return f"<{type(exc).__name__}: {exc}>"


def greeting(mechanism: bytes) -> bytes:
    return b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + mechanism.ljust(20, b"\0") + bytes(32)


def zmtp_property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def raw_null_client(
    port: int, props: list[tuple[bytes, bytes]], *, pipelined: bool = False
) -> socket.socket:
    """A hand-made ZMTP 3.0 NULL client that sends one message, "hello". `pipelined`: its
    greeting, READY and message in one write, without waiting for the server's."""
    s = socket.create_connection(("127.0.0.1", port))
    ready = b"\x05READY" + b"".join(zmtp_property(k, v) for k, v in props)
    command = bytes([0x04, len(ready)]) + ready
    if pipelined:
        s.sendall(greeting(b"NULL") + command + b"\x00\x05hello")
        return s
    s.settimeout(5)
    s.sendall(greeting(b"NULL"))
    got = b""
    while len(got) < 64:
        got += s.recv(64 - len(got))
    s.sendall(command)
    got = b""
    while b"\x05READY" not in got:  # the server's, sent once ZAP (if asked) said yes
        more = s.recv(4096)
        if not more:
            return s  # the server ended the handshake
        got += more
    s.sendall(b"\x00\x05hello")
    return s
