"""A gen leg that never takes ctx's KV frees ctx's blocks at once, not at its deadline.

ctx pins a context_only request's blocks until a gen asks for the KV or `kv_transfer_timeout_ms`
passes. When the gen leg never reaches a gen that takes it (gen refuses the request, is
unreachable, or the client leaves first), nothing would ask: peers saw prefill blocks stranded
for minutes that way (peers.md, pain point 16). The coordinator now posts `/disagg/release` to
ctx. Here ctx's deadline is 60 s, so only the release can free its blocks within the test's
bounds. gen's KV pool is small, so a long prompt fits ctx and not gen.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator

import attrs
import httpx
import pytest
import trio
import yaml

from tests.fault_checks import SLACK_S, Processes, is_idle, processes, wait_metrics
from tests.procs import Server, free_port, metric, wait_healthy, worker_config

pytestmark = pytest.mark.timeout(300)

CTX_TIMEOUT_MS = 60_000
GEN_POOL_TOKENS = 256
RELEASED = "trtdisagg_kv_sends_released_total"
RELEASES = "trtdisagg_coordinator_ctx_releases_total"


@attrs.frozen
class Cluster:
    ctx: Server
    gen: Server
    coordinator: Server


def _worker(procs: Processes, role: str, pool_tokens: int) -> Server:
    port = free_port()
    config = worker_config(
        kv_cache_config={"max_tokens": pool_tokens},
        cache_transceiver_config={
            "backend": "NIXL",
            "kv_transfer_timeout_ms": CTX_TIMEOUT_MS,
            "nixl_progress_thread": False,
        },
    )
    path = procs.tmp / f"{role}.yaml"
    path.write_text(yaml.safe_dump(config))
    server = procs.start([role, "--config", str(path), "--port", str(port)], port, f"{role}.log")
    return server


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("release")
    with processes(tmp) as procs:
        ctx = _worker(procs, "ctx", 16384)
        gen = _worker(procs, "gen", GEN_POOL_TOKENS)
        for server in (ctx, gen):
            wait_healthy(server.url, server.proc, server.log_path, 180)
        port = free_port()
        config = {
            "hostname": "127.0.0.1", "port": port, "max_retries": 0,
            "context_servers": {"urls": [ctx.url]}, "generation_servers": {"urls": [gen.url]},
            # Probes too far apart to see gen die within a test: its leg finds it dead.
            "health_check_interval": 60, "request_timeout": 30,
        }  # fmt: skip
        path = tmp / "disagg.yaml"
        path.write_text(yaml.safe_dump(config))
        coordinator = procs.start(["coordinator", "--config", str(path)], port, "coord.log")
        wait_healthy(coordinator.url, coordinator.proc, coordinator.log_path, 60)
        yield Cluster(ctx=ctx, gen=gen, coordinator=coordinator)


def _body(n: int, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    prompt = [rng.randrange(10, 500) for _ in range(n)]
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}


async def _count(client: httpx.AsyncClient, server: Server, name: str, labels: str = "") -> float:
    return metric((await client.get(server.url + "/metrics")).text, name, labels)


async def test_release_route_names_what_is_wrong_and_knows_what_ctx_holds(
    cluster: Cluster,
) -> None:
    url = cluster.ctx.url + "/disagg/release"
    async with httpx.AsyncClient(timeout=30) as client:
        bad = ({}, {"transfer_key": "seven"}, {"transfer_key": -1}, {"transfer_key": 2**64},
               {"disagg_request_id": -1}, [1])  # fmt: skip
        for body in bad:
            r = await client.post(url, json=body)
            assert r.status_code == 400, (body, r.text)
            message = r.json()["error"]["message"]
            assert "transfer_key" in message or "JSON object" in message, message
        r = await client.post(url, json={"transfer_key": 2**63 + 3})
        assert r.status_code == 200 and r.json()["released"] is False, r.text
        released = await _count(client, cluster.ctx, RELEASED)
        # A request whose gen took its KV is not released: ctx frees it when the write is done.
        r = await client.post(cluster.coordinator.url + "/v1/completions", json=_body(40, 1))
        assert r.status_code == 200, r.text
        await wait_metrics(client, cluster.ctx, is_idle, "ctx idle", SLACK_S)
        assert await _count(client, cluster.ctx, RELEASED) == released
        assert await _count(client, cluster.coordinator, RELEASES, 'outcome="released"') == 0


async def test_a_release_before_the_prefill_ends_ends_the_request_there(cluster: Cluster) -> None:
    """The coordinator gave up (its client left) while ctx still prefills: the release is not
    forgotten ("not held"), leaving the KV pinned for the whole timeout once the prefill ends;
    the request ends at once and frees its blocks. A release that overtakes its request (over
    another connection) ends the request as it comes."""
    ctx = cluster.ctx
    async with httpx.AsyncClient(timeout=30) as client:
        released = await _count(client, ctx, RELEASED)
        key = 2**63 + 12345
        params = {"request_type": "context_only", "transfer_key": key}
        body = {**_body(2000, 5), "disaggregated_params": params}  # a few prefill steps long
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await client.post(ctx.url + "/v1/completions", json=body))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await wait_metrics(client, ctx, lambda t: metric(t, "trtdisagg_requests_running") > 0,
                               "ctx prefilling", 10)  # fmt: skip
            r = await client.post(ctx.url + "/disagg/release", json={"transfer_key": key})
            assert r.json() == {"transfer_key": key, "released": True}, r.text
        (answer,) = answers
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "abort", answer.text
        await wait_metrics(client, ctx, is_idle, "ctx idle", SLACK_S)

        key += 1
        r = await client.post(ctx.url + "/disagg/release", json={"transfer_key": key})
        assert r.json() == {"transfer_key": key, "released": False}, r.text  # nothing yet
        body = {**_body(40, 6), "disaggregated_params": {**params, "transfer_key": key}}
        answer = await client.post(ctx.url + "/v1/completions", json=body)
        assert answer.json()["choices"][0]["finish_reason"] == "abort", answer.text
        await wait_metrics(client, ctx, is_idle, "ctx idle", SLACK_S)
        assert await _count(client, ctx, RELEASED) == released + 2


async def test_a_gen_that_refuses_the_request_frees_ctx_at_once(cluster: Cluster) -> None:
    """gen's pool is smaller than the prompt: gen answers 4xx before it admits the request."""
    async with httpx.AsyncClient(timeout=30) as client:
        released = await _count(client, cluster.ctx, RELEASED)
        r = await client.post(
            cluster.coordinator.url + "/v1/completions", json=_body(GEN_POOL_TOKENS + 100, 2)
        )
        assert 400 <= r.status_code < 500, r.text
        assert "KV cache holds" in r.text, r.text  # gen's reason reaches the client
        ended = time.monotonic()
        await wait_metrics(client, cluster.ctx, is_idle, "ctx idle", SLACK_S)
        assert time.monotonic() - ended < CTX_TIMEOUT_MS / 1000
        assert await _count(client, cluster.ctx, RELEASED) == released + 1
        assert await _count(client, cluster.coordinator, RELEASES, 'outcome="released"') == 1
        r = await client.post(cluster.coordinator.url + "/v1/completions", json=_body(40, 3))
        assert r.status_code == 200, r.text  # both workers still serve


async def test_an_unreachable_gen_frees_ctx_at_once(cluster: Cluster) -> None:
    """gen is killed; the coordinator, not yet aware, runs the ctx leg and finds gen gone."""
    async with httpx.AsyncClient(timeout=30) as client:
        released = await _count(client, cluster.ctx, RELEASED)
        releases = await _count(client, cluster.coordinator, RELEASES, 'outcome="released"')
        cluster.gen.proc.send_signal(signal.SIGKILL)
        cluster.gen.proc.wait(10)
        r = await client.post(cluster.coordinator.url + "/v1/completions", json=_body(40, 4))
        assert 500 <= r.status_code < 600 and "unreachable" in r.text, r.text
        await wait_metrics(client, cluster.ctx, is_idle, "ctx idle", SLACK_S)
        assert await _count(client, cluster.ctx, RELEASED) == released + 1
        after = await _count(client, cluster.coordinator, RELEASES, 'outcome="released"')
        assert after == releases + 1
