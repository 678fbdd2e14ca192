"""Control-plane endpoint strings from peers and clients: only the plain `tcp://host:port`. Pure.

zmq reads more into an endpoint than an address (`tcp://src;dst` binds a source address first,
`*` is a wildcard) and raises on forms it cannot parse. Endpoints arrive from untrusted places (a
client's `ctx_info_endpoint`, a peer's RankInfo), so each is checked here before zmq sees it.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final

_DNS_LABEL: Final = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def is_tcp_endpoint(value: str) -> bool:
    """`tcp://host:port` with an IPv4 address, a bracketed IPv6 address or a DNS name, and a
    port in [1, 65536); nothing else."""
    head, sep, port = value.rpartition(":")
    if not (sep and head.startswith("tcp://") and port.isdigit() and len(port) <= 5):
        return False
    if not 0 < int(port) < 65536:
        return False
    host = head.removeprefix("tcp://")
    if host.startswith("[") and host.endswith("]"):
        return _ip_version(host[1:-1]) == 6
    if _ip_version(host) == 4:
        return True
    labels = host.split(".")
    return len(host) <= 253 and all(_DNS_LABEL.fullmatch(label) for label in labels)


def _ip_version(text: str) -> int | None:
    try:
        return ipaddress.ip_address(text).version
    except ValueError:
        return None
