"""Listening sockets and hypercorn serving, shared by every HTTP front end (the coordinator's
processes and the worker's front processes)."""

from __future__ import annotations

import socket

import hypercorn.config
import trio

from trtdisagg.api.hypercorn_serve import serve
from trtdisagg.errors import StartupError


def bind_socket(host: str, port: int, *, reuse_port: bool, listen: bool = True) -> socket.socket:
    """A TCP socket bound to (host, port); IPv4 when the name has an IPv4 address.

    Raises:
        StartupError: the address cannot be resolved or bound (names both).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise StartupError(f"cannot resolve {host}: {exc}") from None
    family, _, _, _, address = next((i for i in infos if i[0] == socket.AF_INET), infos[0])
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        if listen:
            sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


async def serve_http(
    app: object,
    sock: socket.socket,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve an ASGI app with hypercorn on a bound, listening socket (ownership moves here)."""
    config = hypercorn.config.Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.graceful_timeout = 1.0
    # Longer than any client pool's idle expiry (ours: KEEPALIVE_EXPIRY), so a pooled
    # connection is never reused just as the server closes it.
    config.keep_alive_timeout = 75
    await serve(app, config, task_status=task_status)
