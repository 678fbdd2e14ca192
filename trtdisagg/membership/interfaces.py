"""Which network interface carries a worker's address, and keeping UCX on it.

UCX's tcp transport uses every interface that is up and has an address, and offers all of
them to its peers. A host usually has some that lead nowhere the peer is: docker0 carries
172.17.0.1/16 on every host, so two hosts each see the other's docker0 address in their own
subnet, UCX takes it as reachable, and loading the peer's agent fails (``Destination is
unreachable``, NIXL_ERR_BACKEND). A worker knows which interface its peers reach it on: the
one holding its bind address (`host`), or `advertise_host` when it binds every interface. So
UCX is restricted to that one (``UCX_NET_DEVICES``) before the NIXL agent is created (UCX reads
its environment then); the loopback device when the worker binds to loopback, which also keeps
UCX from listening on external addresses for a worker meant to be local.

A ``UCX_NET_DEVICES`` the user set is kept. An address no local interface holds (a NAT'd or
DNS name for the host) leaves UCX unrestricted, with a warning.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import logging
import os
import socket
from collections.abc import Mapping, MutableMapping

import attrs
import trio

from trtdisagg.membership.records import is_wildcard_host

log = logging.getLogger(__name__)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@attrs.frozen(kw_only=True)
class UcxDevices:
    """What to set ``UCX_NET_DEVICES`` to (None: leave it), and why."""

    devices: str | None
    reason: str


def _address(text: str) -> Address | None:
    try:
        return ipaddress.ip_address(text.strip("[]").split("%")[0])
    except ValueError:
        return None


def choose_devices(
    host: str,
    advertise_host: str | None,
    interfaces: Mapping[str, frozenset[Address]],
    *,
    resolved: Address | None = None,
) -> UcxDevices:
    """Which device UCX may use for a worker bound to `host` that peers reach at
    `advertise_host`. `interfaces`: every local interface's addresses; `resolved`: the address
    a DNS name among the two resolved to. Pure."""
    name = advertise_host if is_wildcard_host(host) else host
    if name is None:
        return UcxDevices(devices=None, reason=f"host {host} binds every interface")
    address = _address(name) if name != "localhost" else ipaddress.ip_address("127.0.0.1")
    address = address or resolved
    if address is None:
        return UcxDevices(devices=None, reason=f"{name} could not be resolved")
    if address.is_loopback:
        return UcxDevices(devices="lo", reason=f"{name} is loopback")
    holders = sorted(i for i, addresses in interfaces.items() if address in addresses)
    if not holders:
        return UcxDevices(devices=None, reason=f"no local interface holds {address} ({name})")
    return UcxDevices(devices=holders[0], reason=f"{holders[0]} holds {address} ({name})")


class _Sockaddr(ctypes.Structure):
    _fields_ = (("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26))


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = (
    ("next", ctypes.POINTER(_Ifaddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_Sockaddr)),
    ("netmask", ctypes.POINTER(_Sockaddr)),
    ("ifu", ctypes.c_void_p),
    ("data", ctypes.c_void_p),
)


def local_interfaces() -> dict[str, frozenset[Address]]:
    """Every interface of this network namespace and its IPv4/IPv6 addresses (getifaddrs(3))."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found: dict[str, set[Address]] = {}
    try:
        node = head
        while node:
            entry = node.contents
            name = (entry.name or b"").decode(errors="replace")
            found.setdefault(name, set())
            if entry.addr:
                raw = bytes(entry.addr.contents.data)
                family = entry.addr.contents.family
                # sockaddr_in: port (2), address (4); sockaddr_in6: port (2), flow (4), address
                if family == socket.AF_INET:
                    found[name].add(ipaddress.IPv4Address(raw[2:6]))
                elif family == socket.AF_INET6:
                    found[name].add(ipaddress.IPv6Address(raw[6:22]))
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return {name: frozenset(addresses) for name, addresses in found.items()}


def confine_ucx(
    host: str, advertise_host: str | None, environ: MutableMapping[str, str] = os.environ
) -> str | None:
    """Set ``UCX_NET_DEVICES`` to the interface peers reach this worker on, unless the user set
    it. Blocking (getifaddrs, DNS): start-up only. The device set, or None."""
    if "UCX_NET_DEVICES" in environ:
        log.info("UCX_NET_DEVICES=%s (as set)", environ["UCX_NET_DEVICES"])
        return None
    resolved = None
    name = advertise_host if is_wildcard_host(host) else host
    if name is not None and _address(name) is None and name != "localhost":
        try:  # a DNS name: the address it stands for here
            resolved = _address(str(socket.getaddrinfo(name, None)[0][4][0]))
        except OSError:
            resolved = None
    choice = choose_devices(host, advertise_host, local_interfaces(), resolved=resolved)
    if choice.devices is None:
        log.warning("UCX may use every interface: %s", choice.reason)
        return None
    environ["UCX_NET_DEVICES"] = choice.devices
    log.info("UCX restricted to %s: %s (UCX_NET_DEVICES)", choice.devices, choice.reason)
    return choice.devices


async def confine_ucx_to_interface(host: str, advertise_host: str | None) -> str | None:
    """`confine_ucx` off the event loop; call before the NIXL agent is created."""
    return await trio.to_thread.run_sync(confine_ucx, host, advertise_host)
