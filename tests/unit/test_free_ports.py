"""Ports for servers that bind seconds later: never an ephemeral one, never one held, and `up`
gives a worker without a port the next one no process holds."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from trtdisagg.free_ports import first_ephemeral_port, free_port, is_free
from trtdisagg.launcher import plan_cluster


@pytest.fixture
def listener() -> Iterator[int]:
    """A port held by a listening socket of this process (one below the ephemeral range)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        yield int(held.getsockname()[1])


def test_a_held_port_is_not_free_and_the_next_one_is(listener: int) -> None:
    assert not is_free("127.0.0.1", listener)
    assert is_free("127.0.0.1", free_port())


def test_ports_are_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 <= port < first_ephemeral_port() for port in ports)


def test_up_skips_a_held_port_for_a_worker_without_one(listener: int) -> None:
    cluster = {
        "coordinator": {"port": listener - 1},
        "ctx": [{"model": "tiny"}],
        "gen": [{"model": "tiny"}],
    }
    plan, _ = plan_cluster(cluster, source="test", root=Path.cwd())
    workers = {child.name: child.url for child in plan.children}
    assert str(listener) not in workers["ctx-0"] + workers["gen-0"]
    ctx_port = int(workers["ctx-0"].rsplit(":", 1)[1])
    gen_port = int(workers["gen-0"].rsplit(":", 1)[1])
    assert listener < ctx_port < gen_port  # the next ones after it, in order
