"""Which interface UCX may use: the one holding the worker's address (pure choice, real read)."""

from __future__ import annotations

import ipaddress

from trtdisagg.membership.interfaces import choose_devices, local_interfaces

A = ipaddress.ip_address
INTERFACES = {
    "lo": frozenset({A("127.0.0.1"), A("::1")}),
    "eth0": frozenset({A("198.18.0.2"), A("fd00::2")}),
    "docker0": frozenset({A("172.17.0.1")}),
}


def test_the_interface_holding_the_address_peers_use() -> None:
    assert choose_devices("198.18.0.2", None, INTERFACES).devices == "eth0"
    assert choose_devices("0.0.0.0", "198.18.0.2", INTERFACES).devices == "eth0"
    assert choose_devices("::", "fd00::2", INTERFACES).devices == "eth0"
    assert (
        choose_devices("0.0.0.0", "ctx.example", INTERFACES, resolved=A("198.18.0.2")).devices
        == "eth0"
    )
    assert choose_devices("127.0.0.1", None, INTERFACES).devices == "lo"
    assert choose_devices("localhost", None, INTERFACES).devices == "lo"


def test_nothing_to_restrict_to_says_why() -> None:
    everywhere = choose_devices("0.0.0.0", None, INTERFACES)
    assert everywhere.devices is None and "binds every interface" in everywhere.reason
    elsewhere = choose_devices("0.0.0.0", "203.0.113.9", INTERFACES)  # a NAT'd address
    assert elsewhere.devices is None and "no local interface holds 203.0.113.9" in elsewhere.reason
    unknown = choose_devices("ctx.example", None, INTERFACES)
    assert unknown.devices is None and "could not be resolved" in unknown.reason


def test_local_interfaces_reads_this_namespace() -> None:
    found = local_interfaces()
    assert A("127.0.0.1") in found["lo"]
