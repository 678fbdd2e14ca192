"""Hosts on one machine: network namespaces on a bridge, made for a test and always removed.

Each host is a namespace with one veth interface (``eth0``) on a bridge in the root namespace,
addressed in a /24 of 198.18.0.0/15 (RFC 2544 benchmarking space, never routed). The bridge
holds ``.1``, so the test process, etcd and anything else in the root namespace reach every
host. Hosts may also get a second interface on a subnet that leads nowhere they share, as every
host's docker0 carries 172.17.0.1/16: each ends in a namespace of its own.

Names carry a random tag, so two runs on one machine do not collide, and everything made is
removed on the way out, the processes in the namespaces first, whatever happened in between.
Needs root (CAP_NET_ADMIN); `require_root()` skips a test otherwise, saying so.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import pytest

from tests.procs import REPO


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the test makes network namespaces (ip netns) and veth pairs")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@attrs.frozen
class Host:
    name: str
    namespace: str
    address: str
    """Its address on the shared bridge."""


@attrs.frozen
class Network:
    tag: str
    bridge: str
    gateway: str
    """The bridge's address: the root namespace (the test, etcd) as the hosts see it."""
    hosts: dict[str, Host]

    def veth(self, host: str) -> str:
        """The root-namespace end of `host`'s interface (its counters count the host's traffic)."""
        return f"v{self.tag}{host}"[:15]

    def tx_bytes(self, host: str) -> int:
        """Bytes `host` has sent on the shared network (its veth end received them)."""
        return int(Path(f"/sys/class/net/{self.veth(host)}/statistics/rx_bytes").read_text())

    def popen(
        self, host: str, args: Sequence[str], *, log_path: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """`python -m trtdisagg ARGS` inside `host` (`ip netns exec` execs it: same pid)."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        command = ["ip", "netns", "exec", self.hosts[host].namespace,
                   sys.executable, "-m", "trtdisagg", *args]  # fmt: skip
        with open(log_path, "ab") as log_file:
            return subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO, env=full_env
            )


def _free_subnet() -> int:
    """A third octet for 198.18.X.0/24 that no interface here uses yet."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    choices = [x for x in range(256) if f" 198.18.{x}." not in used and f" 198.19.{x}." not in used]
    return random.choice(choices)


@contextlib.contextmanager
def network(names: Sequence[str], *, stray: Sequence[str] = ()) -> Iterator[Network]:
    """Hosts `names` on one bridge; those in `stray` also get an interface ``stray0`` in one
    subnet (198.19.X.0/24) that reaches none of the others."""
    require_root()
    tag = secrets.token_hex(2)
    subnet = _free_subnet()
    bridge = f"br{tag}"
    hosts = {
        name: Host(name=name, namespace=f"td{tag}{name}", address=f"198.18.{subnet}.{i + 2}")
        for i, name in enumerate(names)
    }
    net = Network(tag=tag, bridge=bridge, gateway=f"198.18.{subnet}.1", hosts=hosts)
    namespaces: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{net.gateway}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, host in enumerate(hosts.values()):
            _ip("netns", "add", host.namespace)
            namespaces.append(host.namespace)
            veth = net.veth(host.name)
            _ip(
                "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.namespace
            )
            _ip("link", "set", veth, "master", bridge, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            if host.name in stray:
                nowhere = f"td{tag}x{i}"
                _ip("netns", "add", nowhere)
                namespaces.append(nowhere)
                _ip("link", "add", "stray0", "netns", host.namespace, "type", "veth",
                    "peer", "name", "end0", "netns", nowhere)  # fmt: skip
                _ip("-n", nowhere, "link", "set", "end0", "up")
                _ip("-n", host.namespace, "addr", "add", f"198.19.{subnet}.{i + 2}/24",
                    "dev", "stray0")  # fmt: skip
                _ip("-n", host.namespace, "link", "set", "stray0", "up")
        yield net
    finally:
        for namespace in namespaces:
            _kill_all_in(namespace)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def _kill_all_in(namespace: str) -> None:
    pids = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True
    ).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)
