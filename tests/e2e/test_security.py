"""Security at the edges: what a running cluster listens on, and the API key.

* A cluster started as a user would (`python -m trtdisagg up`, the default shape: 1 ctx + 1 gen
  with the NIXL transceiver + coordinator, on 127.0.0.1) has no TCP listener and no UDP socket on
  a non-loopback address, UCX's included, runs its control plane secured (CURVE, with a secret
  `up` made for the run), and still moves KV. Sockets are read from /proc: each
  process's socket inodes (/proc/PID/fd) joined with its network namespace's tables
  (/proc/PID/net/{tcp,tcp6,udp,udp6}).
* With an API key (env `TRTDISAGG_API_KEY` for the workers, `api_key` in the coordinator's file),
  every OpenAI route of every process, and the workers' `/disagg/release`, answers 401 without
  the key or with a wrong one, serves with `Authorization: Bearer <key>`, and the key never
  shows in any process's log.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import yaml

from tests.edges import Cluster, aggregated, completion, running_cluster, wait_idle, wait_until
from tests.procs import REPO, free_port, metric
from trtdisagg.launcher import DEFAULT_CLUSTER
from trtdisagg.membership.interfaces import confine_ucx
from trtdisagg.security.policy import SECURED_LOG

pytestmark = pytest.mark.timeout(300)


# ---- listening sockets, from /proc ----


@attrs.frozen
class BoundSocket:
    pid: int
    protocol: str  # tcp | tcp6 | udp | udp6
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int

    @property
    def is_loopback(self) -> bool:
        mapped = getattr(self.address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
        return self.address.is_loopback or (mapped is not None and mapped.is_loopback)

    def __str__(self) -> str:
        return f"pid {self.pid} {self.protocol} {self.address}:{self.port}"


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net prints it: 32-bit words in host byte order, hex."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed while we look
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def bound_sockets(pid: int) -> list[BoundSocket]:
    """Every TCP socket of `pid` in LISTEN state and every UDP socket it has bound."""
    inodes = _socket_inodes(pid)
    found = []
    for protocol in ("tcp", "tcp6", "udp", "udp6"):
        lines = Path(f"/proc/{pid}/net/{protocol}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if inode not in inodes or (protocol.startswith("tcp") and state != "0A"):
                continue
            hex_address, hex_port = local.split(":")
            found.append(BoundSocket(pid, protocol, _address(hex_address), int(hex_port, 16)))
    return found


def descendants(pid: int) -> set[int]:
    """`pid`'s children, their children, ... (from each process's parent id in /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_address_decoding_matches_the_kernel() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        probe.listen()
        port = probe.getsockname()[1]
        mine = [s for s in bound_sockets(os.getpid()) if s.port == port]
    assert [(s.protocol, str(s.address)) for s in mine] == [("tcp", "127.0.0.1")]
    assert _address("00000000000000000000000001000000") == ipaddress.ip_address("::1")
    assert _address("020200C0") == ipaddress.ip_address("192.0.2.2")


# ---- a cluster as `up` starts it ----


@contextlib.contextmanager
def up(tmp_path: Path, spec: dict[str, Any]) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "up.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}  # the defaults
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trtdisagg", "up", str(path)],
            stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=env,
        )  # fmt: skip
    try:
        wait_until(
            lambda: b"cluster ready" in out.read_bytes() or proc.poll() is not None,
            180,
            "`up` printing that the cluster is ready",
        )
        assert proc.poll() is None, out.read_text()
        yield proc, out
    finally:
        children = descendants(proc.pid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # `up` stops its children itself
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in children:  # only if `up` failed to: never leave a process behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_up_s_default_cluster_serves_on_loopback_only_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    """`make serve`'s cluster: it prints its curl line, moves KV over NIXL, binds nothing beyond
    loopback, and Ctrl-C stops every child with exit status 0."""
    spec = {**DEFAULT_CLUSTER, "log_dir": str(tmp_path / "logs"), "stop_grace": 5}
    coordinator_port, ctx_port, gen_port = free_port(), free_port(), free_port()
    spec["coordinator"] = {**spec["coordinator"], "port": coordinator_port}
    spec["ctx"] = [{**spec["ctx"][0], "port": ctx_port}]
    spec["gen"] = [{**spec["gen"][0], "port": gen_port}]
    with up(tmp_path, spec) as (proc, out), httpx.Client(timeout=60, trust_env=False) as client:
        text = out.read_text()
        assert f"curl http://127.0.0.1:{coordinator_port}/v1/completions" in text
        assert "[ctx-0] " in text and "[coordinator] " in text
        children = {m[1] for m in re.finditer(r"started (\S+) \(pid \d+\)", text)}
        assert children == {"ctx-0", "gen-0", "coordinator"}
        for name in children:
            assert (tmp_path / "logs" / f"{name}.log").stat().st_size > 0
        ctx_url = f"http://127.0.0.1:{ctx_port}"
        body = {
            **completion([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2], 6),
            "model": "tiny",
        }
        r = client.post(f"http://127.0.0.1:{coordinator_port}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == aggregated(client, ctx_url, body)
        moved = metric(client.get(ctx_url + "/metrics").text, "trtdisagg_kv_transfer_bytes_total")
        assert moved > 0  # the answer came through a real NIXL transfer, not a local prefill
        pids = descendants(proc.pid) | {proc.pid}
        sockets = [s for pid in sorted(pids) for s in bound_sockets(pid)]
        exposed = [str(s) for s in sockets if not s.is_loopback]
        assert not exposed, f"bound beyond loopback: {exposed}\n{out.read_text()[-3000:]}"
        ports = {s.port for s in sockets}
        assert {coordinator_port, ctx_port, gen_port} <= ports  # the scan does see them
        for name in ("ctx-0", "gen-0"):
            log = (tmp_path / "logs" / f"{name}.log").read_text()
            assert "UCX restricted to lo: 127.0.0.1 is loopback" in log
            # `up` gave the workers a secret of the run's own: CURVE, not the loopback mode
            assert SECURED_LOG in log and "control plane unauthenticated" not in log
    assert proc.returncode == 0
    assert all(_gone(pid) for pid in pids)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_ucx_is_confined_to_loopback_for_loopback_hosts_and_never_over_a_user_value() -> None:
    """(The other interfaces: unit/test_membership_interfaces.py, e2e/test_netns_cluster.py.)"""
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        env: dict[str, str] = {}
        assert confine_ucx(host, None, env) == "lo" and env == {"UCX_NET_DEVICES": "lo"}, host
    for host in ("0.0.0.0", "::", "203.0.113.9", "ctx-0.invalid"):
        env = {}
        assert confine_ucx(host, None, env) is None and env == {}, host
    env = {"UCX_NET_DEVICES": "mlx5_0:1"}
    assert confine_ucx("127.0.0.1", None, env) is None
    assert env == {"UCX_NET_DEVICES": "mlx5_0:1"}


# ---- the API key ----

OPENAI_ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tiny", None),
    ("POST", "/v1/completions", completion([5, 6, 7], 3)),
    ("POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 3}),
]  # fmt: skip


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    tmp = tmp_path_factory.mktemp("api_key")
    key = "sk-" + secrets.token_hex(16)
    with running_cluster(
        tmp,
        worker={"log_level": "debug"},  # the chattiest setting: the key must not show even there
        coordinator={"api_key": key},
        coordinator_args=("--log-level", "debug"),
        worker_env={"TRTDISAGG_API_KEY": key},
    ) as cluster:
        yield cluster, key


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_openai_route_needs_the_key(keyed: tuple[Cluster, str]) -> None:
    cluster, key = keyed
    wrong = [
        {}, _auth("sk-wrong"), _auth(key[:-1]), _auth(key + "x"), {"Authorization": key},
        {"Authorization": f"bearer {key}"}, {"Authorization": f"Bearer  {key}"},
        {"Authorization": f"Basic {key}"}, {"X-Api-Key": key},
    ]  # fmt: skip
    with httpx.Client(timeout=60, trust_env=False) as client:
        for server in cluster.servers:
            for method, path, body in OPENAI_ROUTES:
                for headers in wrong:
                    r = client.request(method, server.url + path, json=body, headers=headers)
                    assert r.status_code == 401, (server.url, path, headers, r.text)
                    assert r.json()["error"]["type"] == "authentication_error"
                    assert key not in r.text
                r = client.request(method, server.url + path, json=body, headers=_auth(key))
                assert r.status_code == 200, (server.url, path, r.text)
            for variant in ("//v1/completions", "/v1//completions", "/V1/completions",
                            "/%76%31/completions", "/v1/completions/"):  # fmt: skip
                r = client.post(server.url + variant, json=completion([5, 6], 2))
                assert r.status_code != 200, (server.url, variant, r.text)
            for path in ("/health", "/metrics", "/version"):  # probes need no key
                assert client.get(server.url + path).status_code == 200
        release = {"transfer_key": 12345}  # the coordinator's call; no request holds it
        for server in cluster.workers:
            for headers in wrong:
                r = client.post(server.url + "/disagg/release", json=release, headers=headers)
                assert r.status_code == 401, (server.url, headers, r.text)
            r = client.post(server.url + "/disagg/release", json=release, headers=_auth(key))
            assert r.status_code == 200, (server.url, r.text)
            assert r.json() == {**release, "released": False}


def test_every_post_needs_the_key(keyed: tuple[Cluster, str]) -> None:
    """`POST /kv_cache_events` drains the routing events: a keyless caller must not."""
    cluster, key = keyed
    with httpx.Client(timeout=30, trust_env=False) as client:
        for server in cluster.workers:
            for headers in ({}, _auth("sk-wrong")):
                r = client.post(server.url + "/kv_cache_events", headers=headers)
                assert r.status_code == 401, (server.url, r.text)
            r = client.post(server.url + "/kv_cache_events", headers=_auth(key))
            assert r.status_code == 200 and isinstance(r.json(), list), r.text
        for server in cluster.servers:  # an unknown POST route is refused before it is found
            assert client.post(server.url + "/health").status_code == 401


def test_with_the_key_a_disaggregated_request_streams_through(keyed: tuple[Cluster, str]) -> None:
    cluster, key = keyed
    assert cluster.coordinator is not None
    body = {**completion([9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12, 13, 14, 15, 16, 17], 6),
            "stream": True}  # fmt: skip
    tokens: list[int] = []
    with httpx.Client(timeout=60, trust_env=False, headers=_auth(key)) as client:
        url = cluster.coordinator.url + "/v1/completions"
        with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = httpx.Response(200, content=line[6:]).json()
                    for choice in chunk["choices"]:
                        tokens.extend(choice.get("token_ids") or [])
        expected = aggregated(client, cluster.ctx.url, body)
        moved = metric(client.get(cluster.ctx.url + "/metrics").text,
                       "trtdisagg_kv_transfer_bytes_total")  # fmt: skip
        assert moved > 0
        for server in cluster.workers:
            wait_idle(client, server)
    assert tokens == expected


def test_a_refused_request_does_not_stall_the_connection(keyed: tuple[Cluster, str]) -> None:
    """A 401 answers before the request body is read. The client's next request on the same
    keep-alive connection must still be answered (hypercorn alone left it hanging now and then:
    about one connection in twenty)."""
    cluster, key = keyed
    started = time.monotonic()
    with httpx.Client(timeout=5, trust_env=False) as client:
        for _ in range(60):
            r = client.post(cluster.ctx.url + "/v1/completions", json=completion([5, 6, 7], 1))
            assert r.status_code == 401
            assert client.get(cluster.ctx.url + "/health").status_code == 200
            r = client.post(cluster.ctx.url + "/v1/completions", json=completion([5, 6, 7], 1),
                            headers=_auth(key))  # fmt: skip
            assert r.status_code == 200
    assert time.monotonic() - started < 60


def test_the_key_is_in_no_log(keyed: tuple[Cluster, str]) -> None:
    """Runs last in this module: every request above has been logged by now."""
    cluster, key = keyed
    for server in cluster.servers:
        log = server.log()
        assert log, server.log_path
        assert key not in log, f"{server.log_path} holds the API key"
        assert re.search(r"sk-[0-9a-f]{32}", log) is None
