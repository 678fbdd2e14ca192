"""TCP ports for servers started seconds later: free now, and outside the kernel's ephemeral range.

A port the kernel picks (bind to port 0, close, hand the number on) is an ephemeral one: until
the server binds it, any client socket of any process on the host may be given it as its local
port, and the server then fails with EADDRINUSE. A Python server takes seconds to import and
bind, so on a busy host that happens. Below the ephemeral range only explicit binds take ports.
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PORTS_BELOW_EPHEMERAL = 12000
_handed_out: set[int] = set()  # by this process: never twice, though freed again meanwhile


def first_ephemeral_port() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def is_free(host: str, port: int) -> bool:
    """Whether a server could bind `host:port` now. An address this host cannot bind at all
    counts as free: the server's own bind then says what is wrong with it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno != errno.EADDRINUSE
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A random port below the ephemeral range that is free on `host` now and that this process
    has not handed out before."""
    high = first_ephemeral_port()
    low = max(1024, high - _PORTS_BELOW_EPHEMERAL)
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(low, high)
        if port not in _handed_out and is_free(host, port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port in [{low}, {high}) on {host}")
