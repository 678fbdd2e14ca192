"""The coordinator over real HTTP in front of fake workers, all in one trio run.

The fake workers (`tests/fake_worker.py`) speak the worker contract including
context_only / generation_only, so the whole split, merge, relay, retry and routing logic runs
here without a model or a KV transceiver. Every wait is bounded.
"""

from __future__ import annotations

import functools
import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio
import trio.lowlevel
import trio.testing

from tests.etcd_server import Etcd, running_etcd
from tests.fake_worker import FakeWorker, create_fake_app, fake_tokenize, generate
from trtdisagg.api.listen import bind_socket, serve_http
from trtdisagg.coordinator.config import coordinator_config_from_dict
from trtdisagg.coordinator.routers.conversation import rendezvous_choice
from trtdisagg.coordinator.serve import serve_coordinator
from trtdisagg.kv.hashing import reusable_block_hashes
from trtdisagg.membership.etcd import open_etcd
from trtdisagg.membership.records import WorkerRecord, worker_key

pytestmark = pytest.mark.timeout(60)


@attrs.define(eq=False)
class Fake:
    worker: FakeWorker
    url: str
    port: int
    scope: trio.CancelScope


@attrs.define(eq=False)
class Cluster:
    url: str
    ctx: list[Fake]
    gen: list[Fake]
    nursery: trio.Nursery
    name: str = ""
    """The etcd cluster name, when the servers come from etcd."""

    async def stop(self, fake: Fake) -> None:
        fake.scope.cancel()
        await trio.lowlevel.checkpoint()

    async def restart(self, fake: Fake) -> None:
        fake.scope = await self.nursery.start(_serve_fake, fake.worker, fake.port)


async def _serve_fake(
    worker: FakeWorker, port: int, *, task_status: trio.TaskStatus[trio.CancelScope]
) -> None:
    with trio.CancelScope() as scope:
        sock = bind_socket("127.0.0.1", port, reuse_port=False)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_http, create_fake_app(worker), sock)
            task_status.started(scope)


async def _fake(nursery: trio.Nursery, role: str, **knobs: Any) -> Fake:
    sock = bind_socket("127.0.0.1", 0, reuse_port=False)
    port = sock.getsockname()[1]
    sock.close()
    worker = FakeWorker(role=role, **knobs)
    scope = await nursery.start(_serve_fake, worker, port)
    return Fake(worker=worker, url=f"http://127.0.0.1:{port}", port=port, scope=scope)


async def start_cluster(
    nursery: trio.Nursery,
    *,
    ctx: int = 1,
    gen: int = 1,
    ctx_router: str = "round_robin",
    gen_router: str = "round_robin",
    gen_knobs: dict[str, Any] | None = None,
    **config: Any,
) -> Cluster:
    ctxs = [await _fake(nursery, "ctx") for _ in range(ctx)]
    gens = [await _fake(nursery, "gen", **(gen_knobs or {})) for _ in range(gen)]
    return await _start_coordinator(
        nursery, ctxs, gens, ctx_router=ctx_router, gen_router=gen_router, **config
    )


_CLUSTER_NAMES = (f"fakes-{i}" for i in itertools.count())
# /health timeout of the tests on late probes: short, so their misses come quickly.
PROBE_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    with running_etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


async def register(etcd: Etcd, cluster: str, fake: Fake, *, lease: int | None = None) -> bytes:
    """Write `fake`'s record as a worker would register itself; its key."""
    record = WorkerRecord(
        url=fake.url, role=fake.worker.role, instance=f"{fake.worker.role}-{fake.port}",
        model=fake.worker.model, kv_compat=fake.worker.kv_compat,
    )  # fmt: skip
    key = worker_key(cluster, record.role, record.instance)
    async with open_etcd(etcd.url) as client:
        await client.put(key, record.encode(), lease=lease)
    return key


async def _start_coordinator(
    nursery: trio.Nursery,
    ctxs: list[Fake],
    gens: list[Fake],
    *,
    ctx_router: str = "round_robin",
    gen_router: str = "round_robin",
    etcd: Etcd | None = None,
    **config: Any,
) -> Cluster:
    """A coordinator in front of the fakes: listed in its config, or (with `etcd`) registered
    there under a cluster name of their own and found by its membership watch."""
    data = {
        "hostname": "127.0.0.1",
        "port": 0,
        "context_servers": {"urls": [f.url for f in ctxs], "router": {"type": ctx_router}},
        "generation_servers": {"urls": [f.url for f in gens], "router": {"type": gen_router}},
        "health_check_interval": 0.1,
        "server_start_timeout": 10,
        "request_timeout": 10,
        **config,
    }
    name = ""
    if etcd is not None:
        name = next(_CLUSTER_NAMES)
        for fake in ctxs + gens:
            await register(etcd, name, fake)
        data["cluster"] = {"etcd": etcd.url, "name": name}
        for group in ("context_servers", "generation_servers"):
            del data[group]["urls"]
    coordinator = coordinator_config_from_dict(data, source="test")
    host, port = await nursery.start(functools.partial(serve_coordinator, coordinator))
    cluster = Cluster(url=f"http://{host}:{port}", ctx=ctxs, gen=gens, nursery=nursery, name=name)
    if etcd is not None:  # its members joined at start-up and are checked at once: wait for that
        async with httpx.AsyncClient() as client:
            await _wait_health(client, cluster.url, 200)
    return cluster


def _body(prompt: str | list[int] = "hello world, this is a prompt", **kw: Any) -> dict[str, Any]:
    return {"model": "fake", "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "return_token_ids": True, **kw}  # fmt: skip


def _expected(prompt: str | list[int], max_tokens: int = 6) -> list[int]:
    ids = fake_tokenize(prompt) if isinstance(prompt, str) else prompt
    return generate(ids, max_tokens)


async def _events(response: httpx.Response) -> AsyncIterator[Any]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])


async def _wait_health(client: httpx.AsyncClient, url: str, status: int) -> None:
    """Poll another server's /health (no event to wait on across HTTP), bounded."""
    with trio.fail_after(5):
        while (await client.get(url + "/health")).status_code != status:  # noqa: ASYNC110
            await trio.sleep(0.05)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=20) as c:
        yield c


async def test_split_answer_equals_aggregated_and_usage_merges(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery)
    r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["choices"][0]["token_ids"] == _expected(_body()["prompt"])
    assert "disaggregated_params" not in data["choices"][0]
    assert data["prompt_token_ids"] == fake_tokenize(_body()["prompt"])
    n_prompt = len(fake_tokenize(_body()["prompt"]))
    assert data["usage"] == {
        "prompt_tokens": n_prompt, "completion_tokens": 6, "total_tokens": n_prompt + 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }  # fmt: skip
    ctx, gen = c.ctx[0].worker, c.gen[0].worker
    assert ctx.requests == {"context_only": 1} and gen.requests == {"generation_only": 1}
    ctx_body, gen_body = ctx.bodies[0], gen.bodies[0]
    assert ctx_body["stream"] is False
    disagg_id = ctx_body["disaggregated_params"]["disagg_request_id"]
    assert 1 << 40 <= disagg_id < (1 << 63) - 1
    params = gen_body["disaggregated_params"]
    assert params["request_type"] == "generation_only" and params["disagg_request_id"] == disagg_id
    # The KV moves under a key of its own: random, not the (predictable) id, carried to gen.
    key = ctx_body["disaggregated_params"]["transfer_key"]
    assert params["transfer_key"] == key and key != disagg_id and 0 < key < 2**64
    assert params["first_gen_tokens"] == _expected(_body()["prompt"])[:1]
    assert gen_body["prompt_token_ids"] == fake_tokenize(_body()["prompt"])
    # The second identical prompt is a prefix hit on ctx: cached tokens come from ctx.
    r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # The coordinator asks gen for token ids itself; a client that did not gets none.
    plain = await client.post(c.url + "/v1/completions", json=_body(return_token_ids=False))
    assert plain.status_code == 200, plain.text
    assert "token_ids" not in plain.json()["choices"][0] and "prompt_token_ids" not in plain.json()
    assert plain.json()["choices"][0]["text"] == data["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("style", ["context_first", "generation_first"])
async def test_usage_counts_ctx_s_cached_tokens_in_every_mode(
    nursery: trio.Nursery, client: httpx.AsyncClient, style: str, stream: bool
) -> None:
    """Pain point 23: `prompt_tokens_details.cached_tokens` is ctx's prefix-cache hit (gen,
    which received the KV, reports 0), whichever leg goes first, streamed or not."""
    c = await start_cluster(nursery, schedule_style=style)
    body = _body(stream=stream, stream_options={"include_usage": True}) if stream else _body()
    prompt = fake_tokenize(body["prompt"])
    expected = len(reusable_block_hashes(prompt, c.ctx[0].worker.tokens_per_block))
    expected *= c.ctx[0].worker.tokens_per_block
    assert expected > 0
    for cached in (0, expected):  # the second identical prompt hits ctx's prefix cache
        usage = None
        if stream:
            async with client.stream("POST", c.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for event in _events(r):
                    if isinstance(event, dict) and event.get("usage"):
                        usage = event["usage"]
        else:
            r = await client.post(c.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
        assert usage is not None
        assert usage["prompt_tokens_details"] == {"cached_tokens": cached}, (style, usage)
        assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == 6


async def test_streaming_relays_chunks_as_they_arrive(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, gen_knobs={"token_delay": 0.05})
    body = _body(max_tokens=12, stream=True, stream_options={"include_usage": True})
    started = trio.current_time()
    times, tokens, usage = [], [], None
    async with client.stream("POST", c.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        async for event in _events(r):
            times.append(trio.current_time() - started)
            if event == "[DONE]":
                break
            assert "disaggregated_params" not in json.dumps(event)
            for choice in event["choices"]:
                tokens.extend(choice["token_ids"])
            usage = event.get("usage") or usage
    assert tokens == _expected(body["prompt"], 12)
    assert times[0] < times[-1] - 0.3  # first token long before the last: not buffered
    assert usage is not None and usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] == len(fake_tokenize(body["prompt"]))


async def test_openai_client_chat_and_completions(nursery: trio.Nursery) -> None:
    c = await start_cluster(nursery)
    api = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0)
    chat = await api.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi there"}], max_tokens=5
    )
    assert chat.choices[0].message.content and chat.usage and chat.usage.completion_tokens == 5
    stream = await api.completions.create(
        model="fake", prompt="abc", max_tokens=4, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    text, usage = "", None
    async for chunk in stream:
        text += "".join(choice.text for choice in chunk.choices)
        usage = chunk.usage or usage
    assert text == "".join(f" t{t}" for t in _expected("abc", 4))
    assert usage is not None and usage.completion_tokens == 4 and usage.prompt_tokens == 3
    await api.close()


async def test_ctx_finished_request_has_no_gen_leg(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery)
    r = await client.post(c.url + "/v1/completions", json=_body(max_tokens=1))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    body = _body(max_tokens=1, stream=True, stream_options={"include_usage": True})
    async with client.stream("POST", c.url + "/v1/completions", json=body) as r:
        events = [e async for e in _events(r)]
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 1
    assert c.gen[0].worker.requests == {}


async def test_client_disagg_request_id_is_honoured(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery)
    body = _body(disaggregated_params={"request_type": "context_only", "disagg_request_id": 4242})
    r = await client.post(c.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert c.ctx[0].worker.bodies[0]["disaggregated_params"]["disagg_request_id"] == 4242
    assert c.gen[0].worker.bodies[0]["disaggregated_params"]["disagg_request_id"] == 4242
    assert c.ctx[0].worker.bodies[0]["disaggregated_params"]["transfer_key"] != 4242  # random


async def test_worker_4xx_is_passed_through_and_not_retried(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, ctx=2, max_retries=3)
    for fake in c.ctx:
        fake.worker.fail_status, fake.worker.fail_count = 400, 1
    r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "fake ctx failure"
    assert sum(len(f.worker.bodies) for f in c.ctx) == 1


async def test_5xx_is_retried_on_another_server_with_a_new_id(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, ctx=2)
    c.ctx[0].worker.fail_status, c.ctx[0].worker.fail_count = 500, 1
    r = await client.post(c.url + "/v1/completions", json=_body())  # round robin: ctx 0 first
    assert r.status_code == 200, r.text
    first, second = (f.worker.bodies[0] for f in c.ctx)
    ids = {b["disaggregated_params"]["disagg_request_id"] for b in (first, second)}
    assert len(ids) == 2
    keys = {b["disaggregated_params"]["transfer_key"] for b in (first, second)}
    assert len(keys) == 2  # a key per attempt, too
    # With no retries left the failure is a 502.
    for fake in c.ctx:
        fake.worker.fail_status, fake.worker.fail_count = 500, 5
    r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.status_code == 502 and "upstream failure" in r.json()["error"]["message"]


async def test_gen_timeout_is_504_within_request_timeout(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, request_timeout=1)
    c.gen[0].worker.hang = True
    with trio.fail_after(3):
        r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.status_code == 504 and "request_timeout" in r.json()["error"]["message"]
    # A stream starts with ctx's first token as soon as ctx answers, before gen is posted:
    # its status is long sent when the deadline passes, so it ends with a 504 error event.
    with trio.fail_after(3):
        r = await client.post(c.url + "/v1/completions", json=_body(stream=True))
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:7] == "{"]
    first, error = events
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert first["choices"][0]["token_ids"] == _expected(_body()["prompt"], 1)
    assert error["error"]["code"] == 504 and "timed out" in error["error"]["message"]


async def test_dead_ctx_is_retried_then_503_then_recovers(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, ctx=2)
    await c.stop(c.ctx[0])
    for _ in range(4):  # the dead one is retried around, then out of rotation
        r = await client.post(c.url + "/v1/completions", json=_body())
        assert r.status_code == 200, r.text
    await c.stop(c.ctx[1])
    r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.status_code in (502, 503)
    await _wait_health(client, c.url, 503)
    r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.status_code == 503, r.text
    info = (await client.get(c.url + "/cluster_info")).json()
    assert info["is_ready"] is False and info["server_lists"]["context"] == []
    await c.restart(c.ctx[1])
    await _wait_health(client, c.url, 200)
    r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.status_code == 200, r.text


async def test_a_worker_s_unhealthy_reason_reaches_cluster_info(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """A worker that stopped serving says why on /health; the coordinator keeps that reason, so
    /cluster_info (and its log) tell the operator more than "answered 503"."""
    c = await start_cluster(nursery)
    reason = "3 model steps failed in a row; the last: RuntimeError: CUDA error"
    c.gen[0].worker.unhealthy = reason
    await _wait_health(client, c.url, 503)
    info = (await client.get(c.url + "/cluster_info")).json()
    (gen,) = [s for s in info["servers"] if s["url"] == c.gen[0].url]
    assert gen["healthy"] is False
    assert gen["last_error"] == f"/health answered 503: {reason}"
    c.gen[0].worker.unhealthy = None
    await _wait_health(client, c.url, 200)


async def test_a_serving_worker_is_not_evicted_for_a_late_health_answer(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """An overloaded front end answers its own /health probes late. A worker that keeps
    answering real requests meanwhile stays in rotation; one that serves nothing is evicted."""
    c = await start_cluster(nursery, health_check_timeout=PROBE_TIMEOUT_S)
    worker = c.ctx[0].worker
    worker.health_hang = True
    first = worker.health_checks
    with trio.fail_after(15):
        # Three probes reached it: the first two have timed out, which would evict.
        while worker.health_checks < first + 3:
            r = await client.post(c.url + "/v1/completions", json=_body(max_tokens=1))
            assert r.status_code == 200, r.text
    assert (await client.get(c.url + "/health")).status_code == 200
    with trio.fail_after(15):  # no traffic now: two more timed-out probes evict it
        while (await client.get(c.url + "/health")).status_code != 503:  # noqa: ASYNC110
            await trio.sleep(0.1)
    worker.health_hang = False
    await _wait_health(client, c.url, 200)


async def test_an_idle_worker_is_not_evicted_while_the_front_end_s_loop_stalls(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """A stalled front end (its event loop held, as under overload) times its /health probes
    out late. A worker that gets no traffic meanwhile (a gen behind max_tokens 1 requests) is
    not evicted for that; once the loop is on time again, missed probes evict as before."""
    c = await start_cluster(nursery, health_check_timeout=PROBE_TIMEOUT_S)
    worker = c.gen[0].worker
    worker.health_hang = True
    for _ in range(2):  # two probes in a row: two counted misses would evict
        seen = worker.health_checks
        with trio.fail_after(10):
            while worker.health_checks == seen:  # noqa: ASYNC110
                await trio.sleep(0.01)
        # The load this test injects, not a wait: the whole loop stalls across the probe's
        # timeout, which then fires about half a second late.
        time.sleep(PROBE_TIMEOUT_S + 0.5)  # noqa: ASYNC251
    assert (await client.get(c.url + "/health")).status_code == 200
    with trio.fail_after(15):  # on time now: two timed-out probes evict it
        while (await client.get(c.url + "/health")).status_code != 503:  # noqa: ASYNC110
            await trio.sleep(0.1)


async def test_client_disconnect_mid_stream_cancels_gen(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, gen_knobs={"token_delay": 0.2})
    gen = c.gen[0].worker
    body = _body(max_tokens=50, stream=True)
    async with client.stream("POST", c.url + "/v1/completions", json=body) as r:
        tokens = 0
        async for event in _events(r):
            tokens += len(event["choices"][0]["token_ids"])
            if tokens == 2:  # ctx's token, then gen's first
                break
        assert gen.running == 1
    with trio.fail_after(1):
        await gen.wait_running(0)
    metrics = (await client.get(c.url + "/metrics")).text
    assert 'trtdisagg_requests_total{role="coordinator",status="aborted"} 1.0' in metrics
    assert "trtdisagg_requests_running 0.0" in metrics
    assert "trtdisagg_event_loop_lag_seconds_count" in metrics  # the loop watcher runs here too


async def test_client_disconnect_during_ctx_leg_cancels_it(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, gen_knobs={"token_delay": 0.5})
    with trio.move_on_after(0.3):
        await client.post(c.url + "/v1/completions", json=_body())
    with trio.fail_after(1):
        await c.gen[0].worker.wait_running(0)


def _sent_id(fake: Fake) -> int:
    """The transfer key the coordinator sent with its last ctx leg to `fake`."""
    key = fake.worker.bodies[-1]["disaggregated_params"]["transfer_key"]
    assert isinstance(key, int)
    return key


async def _releases(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(url + "/metrics")).text
    prefix = 'trtdisagg_coordinator_ctx_releases_total{outcome="'
    return {
        line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


async def test_ctx_kv_is_released_only_when_no_gen_leg_took_it(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """Pain point 16: ctx's KV is handed back when the gen leg fails, and only then; a ctx that
    answered with an error holds nothing and is not asked."""
    c = await start_cluster(nursery, max_retries=0)
    ctx, gen = c.ctx[0], c.gen[0].worker
    r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.status_code == 200, r.text
    assert ctx.worker.releases == []
    gen.fail_status, gen.fail_count = 400, 1
    r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.status_code == 400, r.text
    assert ctx.worker.releases == [_sent_id(ctx)]  # done before the client got its answer
    assert _sent_id(ctx) not in ctx.worker.held
    ctx.worker.fail_status, ctx.worker.fail_count = 500, 1
    r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.status_code == 502, r.text
    assert len(ctx.worker.releases) == 1
    assert await _releases(client, c.url) == {"released": 1.0}


@pytest.mark.parametrize("style", ["context_first", "generation_first"])
async def test_a_ctx_leg_cut_short_releases_ctx_and_ends_the_gen_leg(
    nursery: trio.Nursery, client: httpx.AsyncClient, style: str
) -> None:
    """Pain points 16 and 22: ctx takes the request and stays silent. At `request_timeout` the
    client gets a 504, ctx is asked to release the id it was sent (it may have answered just
    then, holding KV no gen will take), and a gen leg already running ends too."""
    c = await start_cluster(
        nursery, request_timeout=1, schedule_style=style, gen_knobs={"token_delay": 5}
    )
    ctx, gen = c.ctx[0], c.gen[0].worker
    ctx.worker.hang = True
    started = time.monotonic()
    r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.status_code == 504, r.text
    assert time.monotonic() - started < 3
    with trio.fail_after(1):
        await ctx.worker.wait_releases(1)
        await gen.wait_running(0)
    assert ctx.worker.releases == [_sent_id(ctx)]
    assert await _releases(client, c.url) == {"not_held": 1.0}
    with trio.move_on_after(0.3):  # the client hangs up while ctx still works
        await client.post(c.url + "/v1/completions", json=_body())
    with trio.fail_after(2.5):
        await ctx.worker.wait_releases(2)
    assert ctx.worker.releases[-1] == _sent_id(ctx)


async def test_a_stream_that_stalls_midway_ends_at_the_deadline_and_frees_gen(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """Pain point 22: gen streams two tokens and goes silent with its connection open. The
    client's stream ends at `request_timeout` with an error event and [DONE], and the gen leg
    is cancelled (its request no longer runs)."""
    c = await start_cluster(nursery, request_timeout=1, gen_knobs={"stall_after": 2})
    gen = c.gen[0].worker
    started = time.monotonic()
    tokens: list[int] = []
    events: list[Any] = []
    async with client.stream("POST", c.url + "/v1/completions", json=_body(stream=True)) as r:
        assert r.status_code == 200
        async for event in _events(r):
            events.append(event)
            if isinstance(event, dict):
                for choice in event.get("choices", []):
                    tokens.extend(choice.get("token_ids") or [])
    assert time.monotonic() - started < 3
    assert tokens == _expected("hello world, this is a prompt")[:2]
    assert events[-1] == "[DONE]"
    assert "timed out" in events[-2]["error"]["message"], events[-2]
    with trio.fail_after(1):
        await gen.wait_running(0)


async def test_round_robin_alternates_ctx_servers(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, ctx=2)
    for _ in range(4):
        assert (await client.post(c.url + "/v1/completions", json=_body())).status_code == 200
    assert [len(f.worker.bodies) for f in c.ctx] == [2, 2]
    metrics = (await client.get(c.url + "/metrics")).text
    assert (
        f'trtdisagg_router_decisions_total{{router="round_robin",server="{c.ctx[0].url}"}} 2.0'
        in metrics
    )


async def test_kv_cache_aware_routes_shared_prefixes_together(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, ctx=2, ctx_router="kv_cache_aware")
    prefixes = [[p * 100 + i for i in range(24)] for p in range(1, 5)]
    homes = []
    for prefix in prefixes:
        await client.post(c.url + "/v1/completions", json=_body(prefix))
        homes.append(
            next(
                i
                for i, f in enumerate(c.ctx)
                if f.worker.bodies and f.worker.bodies[-1]["prompt"] == prefix
            )
        )
    labels = '{role="context",router="kv_cache_aware"}'
    text = (await client.get(c.url + "/metrics")).text
    assert f"trtdisagg_router_prompt_tokens_total{labels} 96.0" in text  # 4 x 24
    assert f"trtdisagg_router_matched_tokens_total{labels} 0.0" in text  # all new
    for prefix, home in zip(prefixes, homes, strict=True):
        for tail in ([1, 2, 3], [7, 8, 9, 10, 11]):
            before = len(c.ctx[home].worker.bodies)
            r = await client.post(c.url + "/v1/completions", json=_body(prefix + tail))
            assert r.status_code == 200
            assert len(c.ctx[home].worker.bodies) == before + 1
    # The hit rate shows. A prompt's block holding its last token is never reused, so the bare
    # 24-token prefix left 5 blocks of 4 (20 tokens) for its first tail; that 27-token prompt
    # left 6 (24 tokens) for the second.
    text = (await client.get(c.url + "/metrics")).text
    assert f"trtdisagg_router_prompt_tokens_total{labels} {96.0 + 4 * (27 + 29)}" in text
    assert f"trtdisagg_router_matched_tokens_total{labels} {4 * (20.0 + 24)}" in text


async def test_a_ctx_restarted_between_two_health_checks_is_known_to_hold_nothing(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """A restarted worker's KV events start over, and there may be none yet: its new boot id
    alone tells the router that the prefixes placed there before are gone."""
    c = await start_cluster(nursery, ctx=2, ctx_router="kv_cache_aware")
    prefix = [100 + i for i in range(24)]
    labels = '{role="context",router="kv_cache_aware"}'

    async def matched() -> str:
        text = (await client.get(c.url + "/metrics")).text
        return next(line for line in text.splitlines() if line.startswith(
            f"trtdisagg_router_matched_tokens_total{labels}"))  # fmt: skip

    assert (await client.post(c.url + "/v1/completions", json=_body(prefix))).status_code == 200
    (home,) = [f.worker for f in c.ctx if f.worker.bodies]
    r = await client.post(c.url + "/v1/completions", json=_body([*prefix, 1, 2, 3]))
    assert r.status_code == 200 and home.bodies[-1]["prompt"] == [*prefix, 1, 2, 3]
    assert await matched() == f"trtdisagg_router_matched_tokens_total{labels} 20.0"
    home.restart("boot-2")
    await home.wait_health_checks(home.health_checks + 2)
    r = await client.post(c.url + "/v1/completions", json=_body([*prefix, 4, 5, 6]))
    assert r.status_code == 200
    assert await matched() == f"trtdisagg_router_matched_tokens_total{labels} 20.0"


async def test_a_second_front_end_reads_the_kv_events_the_first_one_read(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """Two front ends of one fleet poll the same workers' KV events, each with its own cursor:
    the first one's reads take nothing from the second, which starts after the prefixes were
    placed and sends each prefix's continuations to the ctx that holds it."""
    ctxs = [await _fake(nursery, "ctx") for _ in range(2)]
    gens = [await _fake(nursery, "gen")]
    # Polled at start-up and after each request served, not in the background meanwhile.
    router = {"type": "kv_cache_aware", "events_poll_interval": 3600}
    servers = {"urls": [f.url for f in ctxs], "router": router}
    first = await _start_coordinator(nursery, ctxs, gens, context_servers=servers)
    prefixes = [[p * 100 + i for i in range(24)] for p in range(1, 5)]
    homes = []
    for prefix in prefixes:
        r = await client.post(first.url + "/v1/completions", json=_body(prefix))
        assert r.status_code == 200, r.text
        homes.append(
            next(
                i
                for i, f in enumerate(first.ctx)
                if f.worker.bodies[-1:] and f.worker.bodies[-1]["prompt"] == prefix
            )
        )
    assert sorted(set(homes)) == [0, 1]
    second = await _start_coordinator(nursery, ctxs, gens, context_servers=servers)
    for prefix, home in zip(prefixes, homes, strict=True):
        for tail in ([1, 2, 3], [7, 8, 9, 10, 11]):
            r = await client.post(second.url + "/v1/completions", json=_body(prefix + tail))
            assert r.status_code == 200, r.text
            assert first.ctx[home].worker.bodies[-1]["prompt"] == prefix + tail


async def test_conditional_disagg_serves_short_prompts_on_gen_alone(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, conditional_disagg_config={"max_local_prefill_length": 8})
    r = await client.post(c.url + "/v1/completions", json=_body(list(range(1, 6))))
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == _expected(
        list(range(1, 6))
    )
    assert c.ctx[0].worker.requests == {} and c.gen[0].worker.requests == {
        "context_and_generation": 1
    }
    assert "disaggregated_params" not in c.gen[0].worker.bodies[0]
    r = await client.post(c.url + "/v1/completions", json=_body(list(range(1, 30))))
    assert r.status_code == 200 and c.ctx[0].worker.requests == {"context_only": 1}
    # A text prompt without a tokenizer at the coordinator goes through ctx.
    r = await client.post(c.url + "/v1/completions", json=_body("hi"))
    assert r.status_code == 200 and c.ctx[0].worker.requests == {"context_only": 2}


async def test_conditional_disagg_counts_only_the_uncached_part(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(
        nursery,
        gen_router="kv_cache_aware",
        conditional_disagg_config={"max_local_prefill_length": 8},
    )
    prompt = list(range(1, 42))
    await client.post(c.url + "/v1/completions", json=_body(prompt))  # via ctx: too long
    assert c.ctx[0].worker.requests == {"context_only": 1}
    # gen now holds the prompt's blocks (it received their KV): only the tail is uncached.
    r = await client.post(c.url + "/v1/completions", json=_body([*prompt, 5, 6]))
    assert r.status_code == 200
    assert c.ctx[0].worker.requests == {"context_only": 1}
    assert c.gen[0].worker.requests["context_and_generation"] == 1


async def test_perf_metrics_merge_coordinator_and_worker_phases(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery)
    r = await client.post(c.url + "/v1/completions", json=_body(return_perf_metrics=True))
    perf = r.json()["perf_metrics"]
    for key in ("coordinator_queue_s", "ctx_s", "gen_first_token_s", "decode_s", "e2e_s", "gen"):
        assert key in perf, perf
    body = _body(return_perf_metrics=True, stream=True)
    async with client.stream("POST", c.url + "/v1/completions", json=body) as r:
        events = [e async for e in _events(r)]
    assert "gen_first_token_s" in events[-2]["perf_metrics"] and events[-1] == "[DONE]"


@pytest.mark.parametrize("style", ["context_first", "generation_first"])
async def test_a_stream_led_by_ctx_s_token_times_the_hand_over_to_gen_s_first_token(
    nursery: trio.Nursery, client: httpx.AsyncClient, style: str
) -> None:
    """The client's first token is ctx's, out before gen sends anything, under either schedule;
    the phase breakdown still times gen's first token (its repeat of ctx's), not the lead."""
    c = await start_cluster(nursery, schedule_style=style, gen_knobs={"token_delay": 0.2})
    body = _body(return_perf_metrics=True, stream=True, max_tokens=3)
    async with client.stream("POST", c.url + "/v1/completions", json=body) as r:
        events = [e async for e in _events(r)]
    tokens = [t for e in events[:-2] for t in e["choices"][0]["token_ids"]]
    assert tokens == _expected(body["prompt"], 3)  # ctx's token once, then gen's
    perf = events[-2]["perf_metrics"]
    assert perf["gen_first_token_s"] >= 0.2, perf  # gen waited before each token
    echoed = await client.post(c.url + "/v1/completions", json=_body(stream=True, echo=True))
    assert echoed.status_code == 200  # a stream, without a lead: the echo goes first
    metrics = (await client.get(c.url + "/metrics")).text
    assert "trtdisagg_coordinator_streams_led_total 1.0" in metrics


async def test_32_concurrent_requests_equal_aggregated(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, ctx=2, gen=2, gen_router="load_balancing")
    prompts = [[i + 1] * (i % 7 + 3) + list(range(i)) for i in range(32)]
    results: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        body = _body(prompts[i], max_tokens=5 + i % 4, stream=i % 2 == 0)
        if not body["stream"]:
            r = await client.post(c.url + "/v1/completions", json=body)
            results[i] = r.json()["choices"][0]["token_ids"]
            return
        tokens: list[int] = []
        async with client.stream("POST", c.url + "/v1/completions", json=body) as r:
            async for event in _events(r):
                if event != "[DONE]":
                    for choice in event["choices"]:
                        tokens.extend(choice["token_ids"])
        results[i] = tokens

    async with trio.open_nursery() as inner:
        for i in range(32):
            inner.start_soon(one, i)
    for i, prompt in enumerate(prompts):
        assert results[i] == _expected(prompt, 5 + i % 4)
    assert all(f.worker.running == 0 for f in c.gen)
    metrics = (await client.get(c.url + "/metrics")).text
    assert 'trtdisagg_requests_total{role="coordinator",status="ok"} 32.0' in metrics


async def test_generation_first_posts_both_legs(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, schedule_style="generation_first")
    r = await client.post(c.url + "/v1/completions", json=_body([3, 4, 5, 6]))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == _expected([3, 4, 5, 6])
    gen_params = c.gen[0].worker.bodies[0]["disaggregated_params"]
    assert gen_params["ctx_info_endpoint"] == "tcp://fake-ctx:1"
    assert (
        gen_params["disagg_request_id"]
        == c.ctx[0].worker.bodies[0]["disaggregated_params"]["disagg_request_id"]
    )
    assert r.json()["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(("status", "answer"), [(400, 400), (500, 502)])
async def test_generation_first_ends_the_waiting_gen_leg_when_ctx_fails(
    nursery: trio.Nursery, client: httpx.AsyncClient, status: int, answer: int
) -> None:
    """Pain point 2: ctx answers an error while the gen leg, posted with it, waits for KV. The
    client gets ctx's error at once and the gen leg ends with it, not at a timeout."""
    c = await start_cluster(
        nursery, schedule_style="generation_first", max_retries=0, gen_knobs={"token_delay": 5}
    )
    ctx, gen = c.ctx[0].worker, c.gen[0].worker
    ctx.fail_status, ctx.fail_count = status, 1
    ctx.gate = trio.Event()  # ctx answers once the gen leg runs
    replies: list[httpx.Response] = []

    async def post() -> None:
        replies.append(await client.post(c.url + "/v1/completions", json=_body()))

    async with trio.open_nursery() as inner:
        inner.start_soon(post)
        with trio.fail_after(2):
            await gen.wait_running(1)
        started = time.monotonic()
        ctx.gate.set()
    assert replies[0].status_code == answer, replies[0].text
    assert time.monotonic() - started < 1
    with trio.fail_after(1):
        await gen.wait_running(0)
    assert ctx.releases == []  # an error answer holds no KV


async def test_generation_first_runs_no_continuation_when_ctx_finished_the_request(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """ctx finishes the request at its first token (max_tokens 1) and refuses the KV to the
    gen leg posted with it, whose stream fails before ctx's answer comes. The answer is ctx's,
    and the failed leg is not resumed: a continuation would compute the prompt again on gen."""
    c = await start_cluster(
        nursery, schedule_style="generation_first", gen_knobs={"error_after": 0}
    )
    ctx, gen = c.ctx[0].worker, c.gen[0].worker
    ctx.gate = trio.Event()  # ctx answers once the gen leg has failed
    replies: list[httpx.Response] = []

    async def post() -> None:
        replies.append(await client.post(c.url + "/v1/completions", json=_body(max_tokens=1)))

    async with trio.open_nursery() as inner:
        inner.start_soon(post)
        with trio.fail_after(2):
            await gen.wait_bodies(1)
            await gen.wait_running(0)  # its stream sent the error and ended
        await trio.testing.wait_all_tasks_blocked(0.05)  # and the coordinator read it
        assert len(gen.bodies) == 1
        ctx.gate.set()
    assert replies[0].status_code == 200, replies[0].text
    assert replies[0].json()["choices"][0]["token_ids"] == _expected(_body()["prompt"], 1)
    assert len(gen.bodies) == 1
    text = (await client.get(c.url + "/metrics")).text
    assert "trtdisagg_coordinator_migrations_total{" not in text


# ---- routing by pair (pain point 11) ----
#
# A rolling upgrade: the new workers publish another protocol version than the old ones, and a
# fake gen answers 500 to KV from a ctx of the other group. Group A (old) has one ctx and
# `a_gens` gens, group B (new) one of each: with two gens in A, round robin on each role alone
# does not keep step with the groups and would cross them.

OLD_KV: dict[str, str | int] = {"protocol_version": 4, "tokens_per_block": 4}
NEW_KV: dict[str, str | int] = {"protocol_version": 5, "tokens_per_block": 4}


async def start_groups(nursery: trio.Nursery, *, a_gens: int = 2, **config: Any) -> Cluster:
    """ctx = [A's, B's]; gen = [A's..., B's]."""
    ctxs = [await _fake(nursery, "ctx", kv_compat=kv) for kv in (OLD_KV, NEW_KV)]
    gens = [await _fake(nursery, "gen", kv_compat=kv) for kv in [OLD_KV] * a_gens + [NEW_KV]]
    return await _start_coordinator(nursery, ctxs, gens, **config)


@pytest.mark.parametrize("router", ["round_robin", "load_balancing"])
@pytest.mark.parametrize("members", ["listed", "etcd"])
@pytest.mark.parametrize("style", ["context_first", "generation_first", "conditional"])
async def test_two_kv_groups_are_each_paired_only_among_themselves(
    nursery: trio.Nursery,
    client: httpx.AsyncClient,
    request: pytest.FixtureRequest,
    style: str,
    members: str,
    router: str,
) -> None:
    """Whichever leg is placed first (conditional disaggregation reserves gen first), the second
    is of its group: every request succeeds, with no retry to hide a crossed pair. Workers
    found through etcd publish `kv_compat` in their records and their `/server_info` alike."""
    config: dict[str, Any] = {"max_retries": 0, "ctx_router": router, "gen_router": router}
    if style == "conditional":  # prompts all uncached: gen first, then a ctx
        config["conditional_disagg_config"] = {"max_local_prefill_length": 0}
    else:
        config["schedule_style"] = style
    etcd = request.getfixturevalue("etcd") if members == "etcd" else None
    c = await start_groups(nursery, etcd=etcd, **config)
    for i in range(12):
        prompt = [i + 1, i + 2, i + 3, i + 4, i + 5]
        r = await client.post(c.url + "/v1/completions", json=_body(prompt))
        assert r.status_code == 200, (i, r.text)
        assert r.json()["choices"][0]["token_ids"] == _expected(prompt)
    assert sum(f.worker.requests["context_only"] for f in c.ctx) == 12
    assert sum(f.worker.requests["generation_only"] for f in c.gen) == 12
    assert all(f.worker.bodies for f in c.ctx + c.gen)  # both groups, every server of them


async def test_a_worker_restarted_between_two_health_checks_pairs_by_its_new_settings(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """A gen restarted in place with another KV protocol, quickly enough to fail no health check:
    /health names a new boot, so the coordinator reads its settings again and pairs no ctx of
    the old group with it (the fake gen would answer 500 to that KV)."""
    ctx = await _fake(nursery, "ctx", kv_compat=OLD_KV)
    gens = [await _fake(nursery, "gen", kv_compat=OLD_KV) for _ in range(2)]
    c = await _start_coordinator(nursery, [ctx], gens, max_retries=0)
    for i in range(4):
        r = await client.post(c.url + "/v1/completions", json=_body([i + 1, i + 2, i + 3]))
        assert r.status_code == 200, r.text
    assert all(g.worker.bodies for g in gens)
    restarted = gens[0].worker
    restarted.kv_compat, restarted.boot_id = NEW_KV, "boot-2"
    served = len(restarted.bodies)
    await restarted.wait_health_checks(restarted.health_checks + 2)
    for i in range(6):
        r = await client.post(c.url + "/v1/completions", json=_body([i + 7, i + 8, i + 9]))
        assert r.status_code == 200, (i, r.text)
    assert len(restarted.bodies) == served


@pytest.mark.parametrize("router", ["round_robin", "load_balancing"])
async def test_no_gen_left_to_pair_with_ctx_is_503_naming_both_and_releases_ctx(
    nursery: trio.Nursery, client: httpx.AsyncClient, router: str
) -> None:
    """A's only gen fails while A's ctx prefills: B's gen is healthy but cannot take A's KV, so
    the request ends with a 503 that says why, and ctx's KV is released at once."""
    c = await start_groups(nursery, a_gens=1, ctx_router=router, gen_router=router, max_retries=0)
    a_ctx, a_gen = c.ctx[0].worker, c.gen[0].worker
    a_ctx.gate = trio.Event()
    replies: list[httpx.Response] = []

    async def post() -> None:
        replies.append(await client.post(c.url + "/v1/completions", json=_body()))

    async with trio.open_nursery() as inner:
        inner.start_soon(post)
        with trio.fail_after(5):
            await a_ctx.wait_bodies(1)  # the first request goes to the first ctx
            a_gen.unhealthy = "stopped"
            # Two failed checks evict it. Health checks run in rounds, one after the other, so
            # a third one received means the round of the second is over.
            await a_gen.wait_health_checks(a_gen.health_checks + 3)
        a_ctx.gate.set()
    r = replies[0]
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert message == (
        f"no generation server can exchange KV with {c.ctx[0].url}: "
        f"{c.gen[1].url}: protocol_version: ctx 4 vs gen 5"
    )
    assert a_ctx.releases == [_sent_id(c.ctx[0])] and a_ctx.held == set()
    assert c.gen[1].worker.bodies == []
    # A's ctx is out of rotation now (it can pair with no healthy gen): B serves.
    r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.status_code == 200, r.text
    assert len(a_ctx.bodies) == 1 and c.ctx[1].worker.requests == {"context_only": 1}


async def test_a_retry_left_only_the_gen_that_failed_goes_back_to_it_not_across(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """A retry avoids the gen that failed, unless nothing else is left: then it goes back to
    that gen, still among those that can pair with its ctx (the conversation keeps the retry
    on A's ctx, whose only gen failed), not to B's idle one."""
    c = await start_groups(nursery, a_gens=1, ctx_router="conversation", max_retries=1)
    a_gen = c.gen[0].worker
    a_gen.fail_status, a_gen.fail_count = 500, 1
    ctx_urls = [f.url for f in c.ctx]
    conversation = next(  # one that the conversation router places on A's ctx
        f"chat-{i}"
        for i in itertools.count()
        if rendezvous_choice(f"chat-{i}", ctx_urls) == ctx_urls[0]
    )
    r = await client.post(c.url + "/v1/completions", json=_body(conversation_id=conversation))
    assert r.status_code == 200, r.text
    assert c.ctx[0].worker.requests == {"context_only": 2} and c.ctx[1].worker.bodies == []
    assert len(a_gen.bodies) == 2 and c.gen[1].worker.bodies == []
    assert len(c.ctx[0].worker.releases) == 1  # the first attempt's KV, which no gen took


async def test_vllm_s_session_id_keeps_a_session_on_one_server(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """The conversation router reads vLLM's `session_id` as a `conversation_id`."""
    c = await start_groups(nursery, a_gens=1, ctx_router="conversation")
    ctx_urls = [f.url for f in c.ctx]
    for home in (0, 1):
        session = next(
            f"s-{i}"
            for i in itertools.count()
            if rendezvous_choice(f"s-{i}", ctx_urls) == ctx_urls[home]
        )
        for _ in range(3):
            r = await client.post(c.url + "/v1/completions", json=_body(session_id=session))
            assert r.status_code == 200, r.text
        assert c.ctx[home].worker.requests == {"context_only": 3}


async def test_bad_input_and_routes(nursery: trio.Nursery, client: httpx.AsyncClient) -> None:
    c = await start_cluster(nursery, api_key="sesame")
    auth = {"Authorization": "Bearer sesame"}
    r = await client.post(c.url + "/v1/completions", json=_body(max_tokens="5"), headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "max_tokens" in r.json()["error"]["message"]
    r = await client.post(c.url + "/v1/completions", content=b"{nope", headers=auth)
    assert r.status_code == 400
    r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.status_code == 401
    assert (await client.get(c.url + "/nowhere")).status_code == 404
    assert (await client.get(c.url + "/version")).json()["version"]
    models = (await client.get(c.url + "/v1/models", headers=auth)).json()
    assert models["data"][0]["id"] == "fake"
    info = (await client.get(c.url + "/cluster_info")).json()
    assert info["is_ready"] and info["server_lists"]["context"] == [c.ctx[0].url]
    assert (await client.get(c.url + "/prometheus/metrics")).status_code == 200
    assert c.ctx[0].worker.bodies == []
