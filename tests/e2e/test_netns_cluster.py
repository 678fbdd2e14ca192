"""Hosts for real on one machine: ctx, gen and the coordinator each in a network namespace of
its own, finding each other through etcd, the KV crossing the network over UCX's TCP.

Namespaces share /dev/shm and one kernel, so UCX would take shared memory between them: every
worker runs with ``UCX_TLS=tcp``, and the test counts the bytes ctx sends on its interface.
ctx-a and gen-a also have a second interface each, on one subnet that connects neither to the
other (as docker0 does on every host): UCX, left alone, offers those addresses, finds them in
its own subnet and fails to load the peer (NIXL_ERR_BACKEND); the workers keep UCX on the
interface that carries their `advertise_host`.

The hosts, etcd and the first workers are shared by the module; the elastic test changes the
membership, so it runs last.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import yaml

from tests.control_peers import SECRET_TEXT
from tests.etcd_server import Etcd, running_etcd
from tests.netns import Network, network
from tests.procs import metric, stop, wait_healthy, worker_config
from trtdisagg.membership.etcd import open_etcd
from trtdisagg.membership.etcd_wire import EventType
from trtdisagg.membership.records import workers_prefix

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

HOSTS = ("coord", "ctxa", "gena", "ctxb", "genb")
CLUSTER = "netns"
LEASE_TTL_S = 2
PORT = 8001
# (workers bind 0.0.0.0: their control plane must run CURVE, keyed by the cluster's secret)
ENV = {"UCX_TLS": "tcp", "TRTDISAGG_TEST_HOOKS": "1", "TRTDISAGG_CLUSTER_SECRET": SECRET_TEXT}


@attrs.define(eq=False)
class Proc:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@attrs.define(eq=False)
class Hosts:
    net: Network
    etcd: Etcd
    tmp: Path
    coordinator: Proc
    workers: dict[str, Proc] = attrs.Factory(dict)

    def start_worker(self, host: str) -> Proc:
        role = host[:3]
        address = self.net.hosts[host].address
        config = worker_config(
            host="0.0.0.0",
            advertise_host=address,
            cache_transceiver_config={"backend": "NIXL", "nixl_progress_thread": False},
            cluster={"etcd": self.etcd.url, "name": CLUSTER, "lease_ttl_s": LEASE_TTL_S},
        )
        path = self.tmp / f"{host}.yaml"
        path.write_text(yaml.safe_dump(config))
        log_path = self.tmp / f"{host}.log"
        proc = self.net.popen(
            host, [role, "--config", str(path), "--port", str(PORT)], log_path=log_path, env=ENV
        )
        self.workers[host] = Proc(url=f"http://{address}:{PORT}", proc=proc, log_path=log_path)
        return self.workers[host]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    tmp = tmp_path_factory.mktemp("netns")
    with (
        network(HOSTS, stray=("ctxa", "gena")) as net,
        running_etcd(tmp, host=net.gateway) as etcd,
    ):
        coordinator_config = {
            "hostname": "0.0.0.0",
            "port": 8000,
            "cluster": {"etcd": etcd.url, "name": CLUSTER},
            "generation_servers": {"router": {"type": "load_balancing"}},
            "health_check_interval": 0.5,
            "request_timeout": 60,
        }
        path = tmp / "coordinator.yaml"
        path.write_text(yaml.safe_dump(coordinator_config))
        log_path = tmp / "coordinator.log"
        url = f"http://{net.hosts['coord'].address}:8000"
        coordinator = Proc(
            url=url,
            proc=net.popen("coord", ["coordinator", "--config", str(path)], log_path=log_path),
            log_path=log_path,
        )
        cluster = Hosts(net=net, etcd=etcd, tmp=tmp, coordinator=coordinator)
        try:
            for host in ("ctxa", "gena", "ctxb"):
                cluster.start_worker(host)
            for worker in cluster.workers.values():
                wait_healthy(worker.url, worker.proc, worker.log_path, 180)
            wait_healthy(url, coordinator.proc, log_path, 60)  # ready: each role serves
            yield cluster
        finally:
            for proc in [coordinator, *cluster.workers.values()]:
                stop(proc.proc)


def body(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip


async def metrics(client: httpx.AsyncClient, proc: Proc) -> str:
    return (await client.get(proc.url + "/metrics")).text


async def kv_sent(client: httpx.AsyncClient, ctxs: list[Proc]) -> float:
    """KV bytes written by these ctx workers so far (their own count)."""
    total = 0.0
    for ctx in ctxs:
        total += metric(await metrics(client, ctx), "trtdisagg_kv_transfer_bytes_total")
    return total


async def test_three_hosts_tokens_equal_aggregated_and_kv_crosses_tcp_byte_exact(
    hosts: Hosts,
) -> None:
    ctxs = [hosts.workers["ctxa"], hosts.workers["ctxb"]]
    gen = hosts.workers["gena"]
    for worker in (hosts.workers["ctxa"], gen):  # each has an interface that leads nowhere
        assert "UCX restricted to eth0" in worker.log()
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        sent_before = sum(hosts.net.tx_bytes(h) for h in ("ctxa", "ctxb"))
        kv_before = await kv_sent(client, ctxs)
        landed_before = set((await client.get(gen.url + "/debug/kv_digests")).json())
        for i, n in enumerate((17, 64, 150)):
            prompt = [(7 * i + 3 * j) % 490 + 10 for j in range(n)]
            params = {"request_type": "context_only", "disagg_request_id": 2**50 + i}
            r = await client.post(
                hosts.coordinator.url + "/v1/completions",
                json=body(prompt, 10, disaggregated_params=params),
            )
            assert r.status_code == 200, r.text
            aggregated = await client.post(gen.url + "/v1/completions", json=body(prompt, 10))
            assert (
                r.json()["choices"][0]["token_ids"] == aggregated.json()["choices"][0]["token_ids"]
            )
        gen_digests = (await client.get(gen.url + "/debug/kv_digests")).json()
        ctx_digests: dict[str, str] = {}
        for ctx in ctxs:
            ctx_digests |= (await client.get(ctx.url + "/debug/kv_digests")).json()
        keys = set(gen_digests) - landed_before  # the coordinator's transfer keys: random
        assert len(keys) == 3, keys
        for key in keys:
            assert ctx_digests[key] == gen_digests[key], f"transfer {key} changed bytes"
        kv_bytes = await kv_sent(client, ctxs) - kv_before
        sent = sum(hosts.net.tx_bytes(h) for h in ("ctxa", "ctxb")) - sent_before
    assert kv_bytes > 100_000  # 231 tokens of KV
    assert sent >= kv_bytes, f"ctx sent {sent} bytes on the network for {kv_bytes} bytes of KV"


@attrs.define
class Outcome:
    started: float
    ended: float
    error: str | None


async def _stream_until(
    stop: trio.Event, client: httpx.AsyncClient, url: str, outcomes: list[Outcome], seed: int
) -> None:
    """Streaming requests one after another until `stop`; each must end whole (all its tokens,
    [DONE]). The last one is finished, not cut: a client leaving is not what is tested here."""
    i = 0
    while not stop.is_set():
        i += 1
        prompt = [(seed * 31 + i * 7 + j) % 490 + 10 for j in range(24)]
        started = trio.current_time()
        error = None
        tokens, done = 0, False
        try:
            async with client.stream(
                "POST", url + "/v1/completions", json=body(prompt, 12, stream=True)
            ) as r:
                if r.status_code != 200:
                    error = f"{r.status_code} {(await r.aread())[:300]!r}"
                else:
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: {"):
                            event = json.loads(line[6:])
                            if "error" in event:
                                error = f"error event: {event['error']}"
                            for choice in event.get("choices", []):
                                tokens += len(choice.get("token_ids") or [])
            if error is None and (tokens != 12 or not done):
                error = f"stream ended after {tokens} tokens, [DONE] {done}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        outcomes.append(Outcome(started=started, ended=trio.current_time(), error=error))


async def _wait(predicate: Any, timeout: float, what: str) -> float:
    """Poll `predicate()` (an async check over HTTP or etcd) until true; when it became true."""
    with trio.fail_after(timeout):
        while not await predicate():  # noqa: ASYNC110
            await trio.sleep(0.02)  # polling other processes' state, bounded above
    return trio.current_time()


async def test_elastic_membership_under_load(hosts: Hosts) -> None:
    """A gen joins while requests stream, another drains, a ctx is killed: the joiner takes
    traffic, the drained gen's streams all end whole, the killed ctx leaves with its lease,
    requests go around it, and the survivors hold no KV at the end."""
    coordinator = hosts.coordinator.url
    ctxa, ctxb, gena = (hosts.workers[h] for h in ("ctxa", "ctxb", "gena"))
    outcomes: list[Outcome] = []
    stop = trio.Event()
    async with (
        httpx.AsyncClient(timeout=60, trust_env=False) as client,
        open_etcd(hosts.etcd.url) as etcd,
        trio.open_nursery() as load,
    ):
        for seed in range(3):
            load.start_soon(_stream_until, stop, client, coordinator, outcomes, seed)

        async def healthy(proc: Proc) -> bool:
            try:
                return (await client.get(proc.url + "/health", timeout=1)).status_code == 200
            except httpx.TransportError:
                return False

        # A second gen joins while requests stream: it serves within 2 s of being healthy.
        genb = hosts.start_worker("genb")
        became_healthy = await _wait(lambda: healthy(genb), 120, "gen-b healthy")

        async def genb_served() -> bool:
            text = await metrics(client, genb)
            return (
                metric(text, "trtdisagg_requests_running")
                + metric(text, "trtdisagg_requests_total", 'role="gen",status="ok"')
                > 0
            )

        took_traffic = await _wait(genb_served, 10, "gen-b served")
        assert took_traffic - became_healthy < 2.0

        # gen-a drains while it streams: it leaves, finishes, exits 0; nothing fails.
        async def gena_streams() -> bool:
            return metric(await metrics(client, gena), "trtdisagg_requests_running") >= 1

        await _wait(gena_streams, 30, "gen-a streaming")
        gena.proc.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(gena.proc.wait, 60) == 0, gena.log()[-3000:]
        assert "drained in" in gena.log()
        assert [o.error for o in outcomes if o.error] == []

        # ctx-a is killed: its lease expires, it is out of rotation within TTL + 1 s.
        answer = await etcd.get_prefix(workers_prefix(CLUSTER))
        ctxa_key = next(kv.key for kv in answer.kvs if ctxa.url.encode() in kv.value)
        deleted = trio.Event()

        async def watch_ctxa() -> None:
            async with etcd.watch(ctxa_key, start_revision=answer.revision + 1) as batches:
                async for batch in batches:
                    if any(e.type is EventType.DELETE for e in batch.events):
                        deleted.set()
                        return

        async with trio.open_nursery() as watching:
            # The watch starts at the revision read above: it sees the delete whenever it began.
            watching.start_soon(watch_ctxa)
            ctxa.proc.send_signal(signal.SIGKILL)
            killed = trio.current_time()

            async def out_of_rotation() -> bool:
                info = (await client.get(coordinator + "/cluster_info")).json()
                return ctxa.url not in info["server_lists"]["context"]

            left = await _wait(out_of_rotation, LEASE_TTL_S + 5, "ctx-a out of rotation")
            with trio.fail_after(LEASE_TTL_S + 5):
                await deleted.wait()
            lease_gone = trio.current_time()
        assert left - killed <= LEASE_TTL_S + 1
        assert lease_gone - killed <= LEASE_TTL_S + 1

        # Requests go around it: every one started after it left succeeds.
        count = len(outcomes)
        await _wait(lambda: _more(outcomes, count + 6), 60, "more requests")
        stop.set()
    after = [o for o in outcomes if o.started > left]
    assert len(after) >= 3 and [o.error for o in after if o.error] == []
    during = [o for o in outcomes if o.started <= killed <= o.ended]
    assert all(o.error is None for o in outcomes if o not in during)

    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        # gen-b loaded ctx-a's agent when it took KV from it; it unloads it now it is gone.
        async def forgot_ctxa() -> bool:
            text = await metrics(client, hosts.workers["genb"])
            return metric(text, "trtdisagg_kv_peers_forgotten_total") >= 1

        await _wait(forgot_ctxa, 30, "gen-b forgot ctx-a")

        async def idle(proc: Proc) -> bool:
            text = await metrics(client, proc)
            held = (
                metric(text, "trtdisagg_kv_cache_total_blocks")
                - metric(text, "trtdisagg_kv_cache_free_blocks")
                - metric(text, "trtdisagg_kv_cache_reusable_blocks")
            )
            return held == 0 and metric(text, "trtdisagg_requests_running") == 0

        for survivor in (ctxb, hosts.workers["genb"]):
            await _wait(lambda s=survivor: idle(s), 15, f"{survivor.url} idle")  # type: ignore[misc]


async def _more(outcomes: list[Outcome], count: int) -> bool:
    await trio.lowlevel.checkpoint()
    return len(outcomes) >= count
