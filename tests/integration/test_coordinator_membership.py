"""A coordinator whose servers are the workers registered in a real etcd (fake workers).

The fakes do not register themselves (the real worker does: e2e/test_worker_membership.py);
the tests write their records as a worker would, so joins and leaves happen exactly when the
test says.
"""

from __future__ import annotations

import functools
import logging
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.etcd_server import Etcd, running_etcd
from tests.integration.test_coordinator_fake_workers import (
    Fake,
    _body,
    _fake,
    _start_coordinator,
    _wait_health,
    register,
)
from trtdisagg.coordinator.config import coordinator_config_from_dict
from trtdisagg.coordinator.serve import serve_coordinator
from trtdisagg.errors import StartupError
from trtdisagg.membership.etcd import open_etcd

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    with running_etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=20) as c:
        yield c


def _served(fakes: list[Fake]) -> list[int]:
    return [len(f.worker.bodies) for f in fakes]


async def _server_lists(client: httpx.AsyncClient, url: str) -> dict[str, list[str]]:
    info = (await client.get(url + "/cluster_info")).json()
    lists: dict[str, list[str]] = info["server_lists"]
    return lists


async def test_workers_join_serve_and_leave_through_etcd(
    nursery: trio.Nursery, client: httpx.AsyncClient, etcd: Etcd
) -> None:
    c = await _start_coordinator(
        nursery, [await _fake(nursery, "ctx")], [await _fake(nursery, "gen")], etcd=etcd
    )
    info = (await client.get(c.url + "/cluster_info")).json()
    assert info["membership"] == {"etcd": etcd.url, "cluster": c.name, "stale": False}
    health = (await client.get(c.url + "/health")).json()
    assert health["status"] == "ok" and health["membership"]["stale"] is False
    r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.status_code == 200, r.text

    # A second gen registers: it serves within 2 s (round robin alternates once it is in).
    second = await _fake(nursery, "gen")
    await register(etcd, c.name, second)
    joined = trio.current_time()
    with trio.fail_after(2):
        while not second.worker.bodies:
            r = await client.post(c.url + "/v1/completions", json=_body())
            assert r.status_code == 200, r.text
    assert trio.current_time() - joined < 2

    # The first gen's key goes: it is out of rotation as soon as the watch says so.
    first = c.gen[0]
    async with open_etcd(etcd.url) as members:
        await members.delete(f"/trtdisagg/{c.name}/workers/gen/gen-{first.port}".encode())
    with trio.fail_after(1):
        while first.url in (await _server_lists(client, c.url))["generation"]:  # noqa: ASYNC110
            await trio.sleep(0.01)  # polling another server's state over HTTP, bounded
    before = _served([first, second])
    for _ in range(4):
        r = await client.post(c.url + "/v1/completions", json=_body())
        assert r.status_code == 200, r.text
    assert _served([first, second]) == [before[0], before[1] + 4]

    # The last gen leaves too: not ready, and /health says why.
    async with open_etcd(etcd.url) as members:
        await members.delete(f"/trtdisagg/{c.name}/workers/gen/gen-{second.port}".encode())
    await _wait_health(client, c.url, 503)
    assert "no healthy generation servers" in (await client.get(c.url + "/health")).text


async def test_a_front_end_that_loses_etcd_serves_its_last_members_and_says_so(
    nursery: trio.Nursery,
    client: httpx.AsyncClient,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="trtdisagg.membership.watch")
    with running_etcd(tmp_path) as etcd:
        ctx, gen = await _fake(nursery, "ctx"), await _fake(nursery, "gen")
        c = await _start_coordinator(nursery, [ctx], [gen], etcd=etcd)
        etcd.proc.send_signal(signal.SIGKILL)
        etcd.proc.wait()
        with trio.fail_after(5):
            while not (await client.get(c.url + "/health")).json()["membership"]["stale"]:  # noqa: ASYNC110
                await trio.sleep(0.05)
        health = await client.get(c.url + "/health")
        assert health.status_code == 200  # still serving its last known servers
        assert health.json()["membership"]["reason"]
        r = await client.post(c.url + "/v1/completions", json=_body())
        assert r.status_code == 200, r.text
        assert any("lost etcd" in m and "last known" in m for m in caplog.messages)
    ports = etcd.ports
    with running_etcd(tmp_path, ports=ports):  # the same etcd again, its data kept
        with trio.fail_after(10):
            while (await client.get(c.url + "/health")).json()["membership"]["stale"]:  # noqa: ASYNC110
                await trio.sleep(0.05)
        assert any("membership is live again" in m for m in caplog.messages)
        r = await client.post(c.url + "/v1/completions", json=_body())
        assert r.status_code == 200, r.text


async def test_start_up_fails_naming_etcd_when_it_never_answers(nursery: trio.Nursery) -> None:
    config = coordinator_config_from_dict(
        {
            "hostname": "127.0.0.1",
            "port": 0,
            "cluster": {"etcd": "127.0.0.1:9", "name": "nobody"},
            "server_start_timeout": 1,
        },
        source="test",
    )
    with pytest.raises(ExceptionGroup) as caught:
        await nursery.start(functools.partial(serve_coordinator, config))
    assert caught.group_contains(
        StartupError, match=r"^etcd at http://127\.0\.0\.1:9 did not answer", depth=None
    )
