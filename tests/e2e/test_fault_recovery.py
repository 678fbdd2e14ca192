"""Worker deaths and a cancellation storm through a real coordinator (real ZMQ, real NIXL).

One ctx, one gen and a coordinator, shared by the module; the workers run with faults armed
(no rule until a test sets one) and KV digests on. A test that kills a worker starts a new one on
the same port before the next test needs it; every process is stopped at the end.
"""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import pytest
import trio
import yaml

from tests.fault_checks import (
    SLACK_S,
    Processes,
    completion,
    digests,
    held_blocks,
    is_idle,
    processes,
    same_kv_landed,
    set_faults,
    wait_all_healthy,
    wait_metrics,
)
from tests.procs import Server, free_port, metric, wait_healthy
from trtdisagg.transfer.protocol.liveness import RELINK_S

pytestmark = pytest.mark.timeout(300)

REQUEST_TIMEOUT_S = 30
FORGOTTEN = "trtdisagg_kv_peers_forgotten_total"
DEAD = "trtdisagg_kv_peers_dead_total"
# kv_transfer_timeout_ms of this module's workers: 6 s. 100 concurrent requests on a loaded
# 2-core machine can take 2 s from ctx's answer to gen's request for the KV, and a request that
# waits on a ctx whose process ended must fail well before its deadline (within RELINK_S).
TIMEOUT_S = 6.0


@attrs.define(eq=False)
class Cluster:
    procs: Processes
    ports: dict[str, int]
    servers: dict[str, Server] = attrs.Factory(dict)

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def start_workers(self, *roles: str) -> None:
        for role in roles:
            port = self.ports[role]
            self.servers[role] = self.procs.start_worker(role, port, timeout_s=TIMEOUT_S)
        wait_all_healthy(*(self.servers[role] for role in roles))

    def ensure_workers(self) -> None:
        """Restart any worker a previous test left dead."""
        self.start_workers(*(r for r in ("ctx", "gen") if not self.servers[r].alive()))

    def kill(self, role: str) -> None:
        proc = self.servers[role].proc
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("recovery")
    ports = {role: free_port() for role in ("ctx", "gen", "coordinator")}
    with processes(tmp) as procs:
        cluster = Cluster(procs=procs, ports=ports)
        cluster.start_workers("ctx", "gen")
        config = {
            "hostname": "127.0.0.1", "port": ports["coordinator"], "max_retries": 0,
            "max_migrations": 0,  # the workers' own failure paths, as the client sees them
            "context_servers": {"urls": [cluster.url("ctx")]},
            "generation_servers": {"urls": [cluster.url("gen")]},
            "health_check_interval": 0.2, "request_timeout": REQUEST_TIMEOUT_S,
        }  # fmt: skip
        path = tmp / "disagg.yaml"
        path.write_text(yaml.safe_dump(config))
        coordinator = procs.start(
            ["coordinator", "--config", str(path)], ports["coordinator"], "coordinator.log"
        )
        wait_healthy(coordinator.url, coordinator.proc, coordinator.log_path, 60)
        cluster.servers["coordinator"] = coordinator
        yield cluster


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(n)]


def _with_key(body: dict[str, Any], key: int) -> dict[str, Any]:
    """Choose the request's id (the coordinator uses a client's positive id as is; the transfer
    key it mints)."""
    return {**body, "disaggregated_params": {"disagg_request_id": key}}


async def _tokens_of_stream(response: httpx.Response) -> list[int]:
    tokens: list[int] = []
    async for line in response.aiter_lines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                tokens.extend(choice.get("token_ids") or [])
    return tokens


@attrs.frozen(kw_only=True)
class StormRequest:
    key: int
    body: dict[str, Any]
    cancel: str | None  # None | before_ctx | prefill | transfer | decode
    cancel_after_s: float = 0.0
    read_bytes: int = 0  # transfer, decode: SSE bytes read before hanging up


def _storm(rng: random.Random, n: int) -> list[StormRequest]:
    cancelled = set(rng.sample(range(n), n // 2))
    out = []
    for i in range(n):
        key = 2**45 + 7919 * i
        if i not in cancelled:
            body = completion(_prompt(rng, rng.randint(8, 120)), rng.randint(3, 16))
            out.append(StormRequest(key=key, body={**body, "stream": rng.random() < 0.3},
                                    cancel=None))  # fmt: skip
            continue
        mode = rng.choice(["before_ctx", "prefill", "transfer", "decode"])
        if mode in ("transfer", "decode"):
            # Streamed: the status line comes once gen has the request, while its KV is still
            # on the way; "transfer" hangs up right then, "decode" after reading a while.
            body = completion(_prompt(rng, rng.randint(8, 80)), 400, stream=True)
            read = 0 if mode == "transfer" else rng.randint(1, 3000)
            out.append(StormRequest(key=key, body=body, cancel=mode, read_bytes=read))
            continue
        prompt_len = rng.randint(500, 900) if mode == "prefill" else rng.randint(8, 120)
        after = (0.0, 0.004) if mode == "before_ctx" else (0.05, 0.4)
        out.append(
            StormRequest(
                key=key,
                body=completion(_prompt(rng, prompt_len), rng.randint(3, 16)),
                cancel=mode,
                cancel_after_s=rng.uniform(*after),
            )
        )
    return out


async def _send(client: httpx.AsyncClient, url: str, request: StormRequest) -> list[int] | None:
    """The request's tokens, or None when it was hung up on by design."""
    body = _with_key(request.body, request.key)
    if request.cancel in ("transfer", "decode"):
        async with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200, await r.aread()
            seen = 0
            if request.read_bytes > 0:
                async for chunk in r.aiter_raw():
                    seen += len(chunk)
                    if seen >= request.read_bytes:
                        break
        return None  # leaving the block closes the connection mid-stream
    if request.cancel is not None:
        with trio.move_on_after(request.cancel_after_s):
            r = await client.post(url, json=body)
            # Too late to hang up (it finished first): it must still be a good answer.
            assert r.status_code == 200, r.text
        return None
    if request.body["stream"]:
        async with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200, await r.aread()
            return await _tokens_of_stream(r)
    r = await client.post(url, json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


async def test_cancellation_storm_leaves_every_worker_idle(cluster: Cluster) -> None:
    """200 requests, half of them hung up on before ctx, in prefill, in transfer (made slower on
    purpose) or in decode. The others complete with exactly ctx's bytes; afterwards both workers
    are idle with every block back and no transfer session, early message or quarantine left."""
    cluster.ensure_workers()
    ctx, gen, coord = (cluster.servers[r] for r in ("ctx", "gen", "coordinator"))
    storm = _storm(random.Random(20261130), 200)
    url = coord.url + "/v1/completions"
    results: dict[int, list[int] | None] = {}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S + 10, limits=limits) as client:
        before = {
            r: (await client.get(s.url + "/metrics")).text for r, s in (("ctx", ctx), ("gen", gen))
        }
        # Warm: gen's first contact with a ctx (rendezvous, UCX connection) is not the subject.
        warm = await client.post(url, json=completion(_prompt(random.Random(0), 20), 2))
        assert warm.status_code == 200, warm.text
        landed_before = set(await digests(client, gen))
        # Widen the transfer window: every write stalls (a gen hanging up meanwhile leaves both
        # sides holding blocks until it lands), and every result reaches gen 100 ms late.
        await set_faults(client, ctx, "stall_transfer:300ms;delay:TRANSFER_RESULT:100ms")
        limiter = trio.CapacityLimiter(16)
        peaks = {"ctx": 0.0, "gen": 0.0}

        async def one(request: StormRequest) -> None:
            async with limiter:
                results[request.key] = await _send(client, url, request)

        async def watch_quarantine() -> None:
            while True:
                for role, server in (("ctx", ctx), ("gen", gen)):
                    text = (await client.get(server.url + "/metrics")).text
                    count = metric(text, "trtdisagg_kv_quarantined_requests")
                    peaks[role] = max(peaks[role], count)
                await trio.sleep(0.05)

        started = time.monotonic()
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                async with trio.open_nursery() as requests:
                    nursery.start_soon(watch_quarantine)
                    for request in storm:
                        requests.start_soon(one, request)
                nursery.cancel_scope.cancel()
        storm_s = time.monotonic() - started
        await set_faults(client, ctx, "none")

        # Everything comes back within bounds: a ctx session whose gen never asked waits one
        # deadline, an early message one deadline plus a sweep, a gen quarantine two deadlines.
        for server in (ctx, gen):
            await wait_metrics(
                client, server,
                lambda text: is_idle(text) and metric(text, "trtdisagg_kv_early_messages") == 0,
                "idle, no early message", 2 * TIMEOUT_S + SLACK_S + 2,
            )  # fmt: skip
        await wait_metrics(
            client, coord, lambda t: metric(t, "trtdisagg_requests_running") == 0, "idle", 5
        )

        completed = [r for r in storm if r.cancel is None]
        for request in completed:
            tokens = results[request.key] or []
            assert len(tokens) == request.body["max_tokens"], f"{request.key}: {tokens}"
        # Every completed request's KV landed exactly (so did some hung up on in decode).
        landed = await same_kv_landed(client, ctx, gen, landed_before)
        assert len(landed) >= len(completed), (len(landed), len(completed))
        after = {
            r: (await client.get(s.url + "/metrics")).text for r, s in (("ctx", ctx), ("gen", gen))
        }
        aborted = {
            r: metric(after[r], "trtdisagg_requests_total", f'role="{r}",status="aborted"')
            - metric(before[r], "trtdisagg_requests_total", f'role="{r}",status="aborted"')
            for r in ("ctx", "gen")
        }  # fmt: skip
        print(f"storm: {storm_s:.1f}s, aborted {aborted}, peak quarantined {peaks}")
        # Hang-ups reached both workers (ctx in prefill, gen in transfer or decode), and some
        # came while a write was in flight: both sides then held the blocks until it landed.
        assert aborted["ctx"] > 0 and aborted["gen"] > 0, aborted
        assert peaks["ctx"] > 0 and peaks["gen"] > 0, peaks
        # The cluster still serves: one more request, exact.
        landed_before = set(await digests(client, gen))
        body = _with_key(completion(_prompt(random.Random(1), 40), 5), 2**45 - 3)
        r = await client.post(url, json=body)
        assert r.status_code == 200, r.text
        assert len(await same_kv_landed(client, ctx, gen, landed_before)) == 1


@attrs.define(eq=False)
class Outcome:
    status: int = 0
    text: str = ""
    done_at: float = 0.0


async def _post(client: httpx.AsyncClient, url: str, body: dict[str, Any], out: Outcome) -> None:
    r = await client.post(url, json=body)
    out.status, out.text, out.done_at = r.status_code, r.text, time.monotonic()


async def _health(client: httpx.AsyncClient, url: str, status: int, timeout: float) -> None:
    with trio.fail_after(timeout):
        while (await client.get(url + "/health")).status_code != status:  # noqa: ASYNC110
            await trio.sleep(0.05)


async def _sample_health(
    client: httpx.AsyncClient, url: str, statuses: list[int], *, task_status: Any
) -> None:
    """Record `url`'s /health status every 50 ms until cancelled (a peer's death must not
    change it: peers.md, pain point 7)."""
    task_status.started()
    while True:
        statuses.append((await client.get(url + "/health")).status_code)
        await trio.sleep(0.05)  # sampling an observable state, not waiting for it


async def test_ctx_killed_mid_transfer_fails_the_request_then_a_new_ctx_serves(
    cluster: Cluster,
) -> None:
    """kill -9 of ctx while its NIXL write is in flight (stalled on purpose): gen's connection
    to ctx drops and stays down, so within about RELINK_S, long before the transfer deadline,
    gen forgets that ctx as dead, the client gets a 5xx that says so, and gen frees the
    request's blocks (no quarantine: a process that ended writes nothing). gen's own /health
    stays 200 throughout, and the coordinator keeps it in rotation. A new ctx on the same port
    then serves the next request with exactly its bytes, with the same gen process."""
    cluster.ensure_workers()
    ctx, gen, coord = (cluster.servers[r] for r in ("ctx", "gen", "coordinator"))
    gen_pid = gen.proc.pid
    stall = 'action="stall_transfer",message=""'
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S + 10) as client:
        old_endpoint = (await client.get(ctx.url + "/server_info")).json()["disaggregated_params"]
        stalls = metric((await client.get(ctx.url + "/metrics")).text,
                        "trtdisagg_faults_injected_total", stall)  # fmt: skip
        expired = "trtdisagg_kv_quarantine_expired_total"
        gen_before = (await client.get(gen.url + "/metrics")).text
        expired_before = metric(gen_before, expired)
        forgotten_before = metric(gen_before, FORGOTTEN)
        dead_before = metric(gen_before, DEAD)
        await set_faults(client, ctx, "stall_transfer:60s:1")
        out = Outcome()
        body = completion(_prompt(random.Random(5), 50), 8)
        gen_health: list[int] = []
        async with trio.open_nursery() as watch:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_post, client, coord.url + "/v1/completions", body, out)
                await wait_metrics(
                    client, ctx,
                    lambda t: metric(t, "trtdisagg_faults_injected_total", stall) == stalls + 1,
                    "ctx write in flight", 20,
                )  # fmt: skip
                await wait_metrics(
                    client, gen, lambda t: held_blocks(t) > 0, "gen holding the KV's blocks", 5
                )
                await watch.start(_sample_health, client, gen.url, gen_health)
                killed_at = time.monotonic()
                await trio.to_thread.run_sync(cluster.kill, "ctx")
            assert 500 <= out.status < 600, out.text
            assert "is gone" in out.text and "dropped" in out.text, out.text
            took = out.done_at - killed_at
            assert took < RELINK_S + 2 * SLACK_S < TIMEOUT_S, took
            gen_text = await wait_metrics(client, gen, is_idle, "gen idle", SLACK_S)
            watch.cancel_scope.cancel()
        assert len(gen_health) >= 5 and set(gen_health) == {200}, gen_health
        assert metric(gen_text, expired) == expired_before  # freed at once, not quarantined
        assert metric(gen_text, DEAD) == dead_before + 1
        assert metric(gen_text, FORGOTTEN) == forgotten_before + 1  # its agents unloaded
        await _health(client, coord.url, 503, 10)  # no ctx left
        seen = (await client.get(coord.url + "/cluster_info")).json()
        assert seen["server_lists"]["generation"] == [gen.url], seen
        assert seen["unhealthy"] == {"context": [ctx.url], "generation": []}, seen

        await trio.to_thread.run_sync(cluster.start_workers, "ctx")
        ctx = cluster.servers["ctx"]
        await _health(client, coord.url, 200, 10)
        info = (await client.get(ctx.url + "/server_info")).json()["disaggregated_params"]
        assert info != old_endpoint  # a new instance, at a new control endpoint
        landed_before = set(await digests(client, gen))
        r = await client.post(
            coord.url + "/v1/completions",
            json=_with_key(completion(_prompt(random.Random(6), 45), 7), 2**46 + 11),
        )
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["token_ids"]) == 7
        assert len(await same_kv_landed(client, ctx, gen, landed_before)) == 1
        assert gen.proc.pid == gen_pid and gen.alive()


async def test_gen_killed_mid_decode_fails_its_requests_and_ctx_frees_by_deadline(
    cluster: Cluster,
) -> None:
    """kill -9 of gen with two requests decoding and two whose KV ctx holds for gen (gen drops
    its REQUEST_DATA on purpose): all four get a 5xx at once, ctx frees the pinned blocks by its
    transfer deadline, and the coordinator then answers 503 (no gen left)."""
    cluster.ensure_workers()
    ctx, gen, coord = (cluster.servers[r] for r in ("ctx", "gen", "coordinator"))
    url = coord.url + "/v1/completions"
    rng = random.Random(8)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S + 10) as client:
        ctx_before = (await client.get(ctx.url + "/metrics")).text
        forgotten_before, dead_before = metric(ctx_before, FORGOTTEN), metric(ctx_before, DEAD)
        decoding, waiting = [Outcome(), Outcome()], [Outcome(), Outcome()]
        async with trio.open_nursery() as nursery:
            for out in decoding:
                nursery.start_soon(_post, client, url, completion(_prompt(rng, 30), 4000), out)
            await wait_metrics(
                client, gen, lambda t: metric(t, "trtdisagg_requests_running") == 2,
                "two requests decoding", 20,
            )  # fmt: skip
            await set_faults(client, gen, "drop:REQUEST_DATA")
            for out in waiting:
                nursery.start_soon(_post, client, url, completion(_prompt(rng, 60), 8), out)
            await wait_metrics(
                client, ctx,
                lambda t: metric(t, "trtdisagg_kv_sessions", 'side="sender"') == 2
                and held_blocks(t) > 0,
                "ctx holding two requests' KV", 20,
            )  # fmt: skip
            killed_at = time.monotonic()
            await trio.to_thread.run_sync(cluster.kill, "gen")
        for out in decoding + waiting:
            assert 500 <= out.status < 600, out.text
            assert out.done_at - killed_at < SLACK_S, out.done_at - killed_at
        await wait_metrics(client, ctx, is_idle, "ctx idle", TIMEOUT_S + SLACK_S)
        assert time.monotonic() - killed_at < TIMEOUT_S + SLACK_S
        await wait_metrics(  # the dead gen: forgotten as ended, its agent unloaded
            client, ctx,
            lambda t: (metric(t, FORGOTTEN), metric(t, DEAD))
            == (forgotten_before + 1, dead_before + 1),
            "ctx forgetting the dead gen", RELINK_S + 2 * SLACK_S,
        )  # fmt: skip
        await _health(client, coord.url, 503, 5)
        r = await client.post(url, json=completion(_prompt(rng, 20), 4))
        assert r.status_code == 503, r.text


async def _healthy_for_coordinator(client: httpx.AsyncClient, url: str, timeout: float) -> None:
    """Until the coordinator's health checks see every worker it knows healthy."""
    with trio.fail_after(timeout):
        while True:
            unhealthy = (await client.get(url + "/cluster_info")).json()["unhealthy"]
            if not any(unhealthy.values()):
                return
            await trio.sleep(0.05)  # polling an observable state, bounded above


@attrs.define
class Load:
    """Clients that keep sending through the coordinator: every answer, and a wake-up for
    whoever waits for the next `target` successes."""

    answers: list[tuple[float, int, str]] = attrs.Factory(list)  # (when, status, body)
    target: int = 0
    reached: trio.Event = attrs.Factory(trio.Event)

    def successes(self) -> int:
        return sum(status == 200 for _, status, _ in self.answers)

    async def more_successes(self, n: int, timeout: float) -> None:
        self.target, self.reached = self.successes() + n, trio.Event()
        with trio.fail_after(timeout):
            await self.reached.wait()

    async def client(self, client: httpx.AsyncClient, url: str, rng: random.Random) -> None:
        while True:
            body = completion(_prompt(rng, rng.randint(8, 60)), 6)
            r = await client.post(url + "/v1/completions", json=body)
            self.answers.append((time.monotonic(), r.status_code, r.text))
            if self.successes() >= self.target:
                self.reached.set()
            if r.status_code != 200:
                await trio.sleep(0.05)  # a client's back-off after an error, not a wait


@pytest.mark.parametrize("restarted", ["ctx", "gen"])
async def test_a_worker_restarted_under_sustained_load_serves_again_and_leaks_nothing(
    cluster: Cluster, restarted: str
) -> None:
    """Eight clients keep sending through the coordinator while one worker is killed (-9) and a
    new one starts on its port (peers.md, pain point 6: decode needed a restart after prefill
    died; stale endpoints). Every request ends, with 200 or a 5xx that says why, and none
    failed before the kill; after the restart requests succeed again through the same other
    worker's process, which forgot the old instance (and, being gen, met the new ctx); at the
    end both workers are idle."""
    cluster.ensure_workers()
    survivor = cluster.servers["gen" if restarted == "ctx" else "ctx"]
    coord = cluster.servers["coordinator"]
    survivor_pid = survivor.proc.pid
    load = Load()
    rng = random.Random(66 if restarted == "ctx" else 67)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S + 10) as client:
        await _healthy_for_coordinator(client, coord.url, 10)  # a worker restarted before, too
        before = (await client.get(survivor.url + "/metrics")).text
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(load.client, client, coord.url, rng)
            await load.more_successes(16, 60)
            killed_at = time.monotonic()
            await trio.to_thread.run_sync(cluster.kill, restarted)
            await trio.to_thread.run_sync(cluster.start_workers, restarted)
            await load.more_successes(16, 60)
            nursery.cancel_scope.cancel()
        failed = [(at, status, text) for at, status, text in load.answers if status != 200]
        print(f"{restarted} restarted under load: {len(load.answers)} answers, "
              f"{len(failed)} failed:", sorted({(s, t[:90]) for _, s, t in failed}))  # fmt: skip
        for at, status, text in failed:
            assert 500 <= status < 600 and "message" in text, (status, text)
            assert at >= killed_at, f"failed before the kill: {status} {text}"
        for server in (cluster.servers["ctx"], cluster.servers["gen"]):
            await wait_metrics(client, server, is_idle, "idle", SLACK_S + TIMEOUT_S)
        await wait_metrics(  # the old instance, forgotten (ctx hears of a gen's end by probes)
            client, survivor, lambda t: metric(t, FORGOTTEN) == metric(before, FORGOTTEN) + 1,
            "the old instance forgotten", RELINK_S + 2 * SLACK_S,
        )  # fmt: skip
        if restarted == "ctx":
            after = (await client.get(survivor.url + "/metrics")).text
            rendezvous = "trtdisagg_kv_rendezvous_total"
            assert metric(after, rendezvous) >= metric(before, rendezvous) + 1  # the new ctx
        assert survivor.proc.pid == survivor_pid and survivor.alive()
        await _health(client, coord.url, 200, 10)
