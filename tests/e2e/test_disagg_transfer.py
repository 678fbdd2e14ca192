"""ctx → gen over real processes, real ZMQ and real NIXL: tokens, bytes, lifecycle, refusals."""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import zmq

from tests.fault_checks import SLACK_S, gen_asks_first, is_idle, request_data_waiting, wait_metrics
from tests.instances import running_instances
from tests.oracle import assert_greedy_match, hf_greedy
from tests.procs import Server, metric, running_worker
from trtdisagg.model.loader import resolve_model
from trtdisagg.model.tiny import TinySpec, ensure_tiny_checkpoint
from trtdisagg.worker.http.handoff import ctx_instance_of

TIMEOUT_MS = 3000
TRANSFER = {"backend": "NIXL", "kv_transfer_timeout_ms": TIMEOUT_MS, "nixl_progress_thread": False}
HOOKS = {"TRTDISAGG_TEST_HOOKS": "1"}


@contextlib.contextmanager
def _running_pair(tmp: Path, **overrides: Any) -> Iterator[tuple[Server, Server]]:
    """A ctx and a gen worker with test hooks, started together."""
    overrides = {"cache_transceiver_config": TRANSFER, **overrides}
    specs = {"ctx": ("ctx", overrides), "gen": ("gen", overrides)}
    with running_instances(tmp, specs, env=HOOKS) as servers:
        yield servers["ctx"], servers["gen"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    with _running_pair(tmp_path_factory.mktemp("pair")) as servers:
        yield servers


def _gen_body(ctx_answer: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    params = dict(ctx_answer["choices"][0]["disaggregated_params"])
    params["request_type"] = "generation_only"
    prompt = ctx_answer["prompt_token_ids"]
    return {**body, "prompt_token_ids": prompt, "disaggregated_params": params}


async def _split(
    client: httpx.AsyncClient, ctx: Server, gen: Server, body: dict[str, Any]
) -> tuple[list[int], int]:
    """context_only on ctx, then generation_only on gen: (gen's tokens, transfer key)."""
    ctx_body = {**body, "stream": False, "disaggregated_params": {"request_type": "context_only"}}
    r = await client.post(ctx.url + "/v1/completions", json=ctx_body)
    assert r.status_code == 200, r.text
    answer = r.json()
    key = answer["choices"][0]["disaggregated_params"]["transfer_key"]
    assert answer["choices"][0]["finish_reason"] is None
    # ctx names itself, so gen can tell a restarted ctx on a reused endpoint from the old one.
    state = answer["choices"][0]["disaggregated_params"]["opaque_state"]
    assert ctx_instance_of(state) is not None and ctx_instance_of(state).startswith("ctx-")
    return await _generate(client, gen, _gen_body(answer, body)), key


async def _generate(client: httpx.AsyncClient, gen: Server, body: dict[str, Any]) -> list[int]:
    """gen's token ids for `body`, streamed or not as it asks."""
    if not body.get("stream"):
        g = await client.post(gen.url + "/v1/completions", json=body)
        assert g.status_code == 200, g.text
        return list(g.json()["choices"][0]["token_ids"])
    tokens: list[int] = []
    async with client.stream("POST", gen.url + "/v1/completions", json=body) as g:
        assert g.status_code == 200
        async for line in g.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tokens.extend(choice.get("token_ids", []))
    return tokens


async def _aggregated(client: httpx.AsyncClient, server: Server, body: dict[str, Any]) -> list[int]:
    r = await client.post(server.url + "/v1/completions", json={**body, "stream": False})
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def _info_endpoint(server: Server) -> str:
    """The worker's control-plane endpoint (every worker with a transceiver has one)."""
    with httpx.Client() as client:
        info = client.get(server.url + "/server_info").json()
    return str(info["disaggregated_params"]["ctx_info_endpoint"])


def _body(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip


def _generation_first_bodies(
    ctx: Server, key: int, body: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """gen's generation-first request for transfer `key` from `ctx`, and ctx's context_only one."""
    gen_body = {**body, "disaggregated_params": {
        "request_type": "generation_only", "schedule_style": "generation_first",
        "disagg_request_id": key, "ctx_request_id": key, "ctx_info_endpoint": _info_endpoint(ctx),
    }}  # fmt: skip
    ctx_body = {**body, "disaggregated_params": {
        "request_type": "context_only", "disagg_request_id": key,
    }}  # fmt: skip
    return gen_body, ctx_body


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(n)]


async def _wait_idle(client: httpx.AsyncClient, server: Server, timeout: float = 10.0) -> str:
    with trio.fail_after(timeout):
        while True:
            text = (await client.get(server.url + "/metrics")).text
            free = metric(text, "trtdisagg_kv_cache_free_blocks")
            reusable = metric(text, "trtdisagg_kv_cache_reusable_blocks")
            total = metric(text, "trtdisagg_kv_cache_total_blocks")
            if metric(text, "trtdisagg_requests_running") == 0 and free + reusable == total:
                return text
            await trio.sleep(0.05)


async def test_tokens_equal_aggregated_and_hf(pair: tuple[Server, Server]) -> None:
    ctx, gen = pair
    rng = random.Random(3)
    model_dir = resolve_model("tiny")
    async with httpx.AsyncClient(timeout=60) as client:
        for n in (1, 15, 16, 17, 40, 100):  # block size 16: inside, on and across boundaries
            body = _body(_prompt(rng, n), 12)
            aggregated = await _aggregated(client, ctx, body)
            split, _ = await _split(client, ctx, gen, body)
            streamed, _ = await _split(client, ctx, gen, {**body, "stream": True})
            assert split == aggregated, f"prompt of {n}: split {split} vs aggregated {aggregated}"
            assert streamed == aggregated
            if n in (17, 100):  # the whole path against the HF oracle (slow: two sizes)
                reference, margins = hf_greedy(model_dir, body["prompt"], 12)
                assert_greedy_match(split, reference, margins)
        for server in pair:
            await _wait_idle(client, server)


async def test_32_concurrent_pairs_match_aggregated(pair: tuple[Server, Server]) -> None:
    ctx, gen = pair
    rng = random.Random(11)
    bodies = [_body(_prompt(rng, rng.randint(1, 90)), rng.randint(2, 20), stream=i % 2 == 0)
              for i in range(32)]  # fmt: skip
    async with httpx.AsyncClient(timeout=120) as client:
        expected = [await _aggregated(client, ctx, b) for b in bodies]
        got: list[list[int]] = [[] for _ in bodies]

        async def one(i: int) -> None:
            got[i], _ = await _split(client, ctx, gen, bodies[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(bodies)):
                nursery.start_soon(one, i)
        assert got == expected
        for server in pair:
            await _wait_idle(client, server)


async def test_gen_blocks_hold_exactly_the_ctx_bytes(pair: tuple[Server, Server]) -> None:
    ctx, gen = pair
    rng = random.Random(5)
    async with httpx.AsyncClient(timeout=60) as client:
        keys = [(await _split(client, ctx, gen, _body(_prompt(rng, n), 3)))[1] for n in (7, 33, 64)]
        ctx_digests = (await client.get(ctx.url + "/debug/kv_digests")).json()
        gen_digests = (await client.get(gen.url + "/debug/kv_digests")).json()
    for key in keys:
        assert ctx_digests[str(key)] == gen_digests[str(key)], f"transfer {key} changed bytes"
    assert len({ctx_digests[str(k)] for k in keys}) == len(keys)  # digests see the content


async def _generation_first(
    client: httpx.AsyncClient, ctx: Server, gen: Server, body: dict[str, Any], key: int
) -> tuple[list[int], list[int]]:
    """generation_only posted first, without a first token; context_only only once gen's
    REQUEST_DATA waits at ctx. (gen's tokens, ctx's tokens)."""
    gen_body, ctx_body = _generation_first_bodies(ctx, key, body)
    ctx_body["stream"] = False
    gen_tokens: list[int] = []

    async def run_gen() -> None:
        gen_tokens.extend(await _generate(client, gen, gen_body))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_gen)
        await request_data_waiting(client, ctx)  # gen asked before ctx has seen the request
        r = await client.post(ctx.url + "/v1/completions", json=ctx_body)
        assert r.status_code == 200, r.text
        ctx_tokens = list(r.json()["choices"][0]["token_ids"])
    return gen_tokens, ctx_tokens


async def test_generation_first_gets_its_first_token_with_the_kv(
    pair: tuple[Server, Server],
) -> None:
    ctx, gen = pair
    rng = random.Random(13)
    async with httpx.AsyncClient(timeout=60) as client:
        keys = []
        for i, n in enumerate((1, 16, 33, 70)):
            body = _body(_prompt(rng, n), 6, stream=i % 2 == 1)
            key = 2**50 + 7000 + n
            keys.append(key)
            gen_tokens, ctx_tokens = await _generation_first(client, ctx, gen, body, key)
            assert gen_tokens == await _aggregated(client, ctx, body), f"prompt of {n}"
            assert gen_tokens[:1] == ctx_tokens  # the token gen never saw in its request
        ctx_digests = (await client.get(ctx.url + "/debug/kv_digests")).json()
        gen_digests = (await client.get(gen.url + "/debug/kv_digests")).json()
        for key in keys:
            assert ctx_digests[str(key)] == gen_digests[str(key)], f"transfer {key} changed bytes"
        # Without generation_first, a generation_only request must carry ctx's first token.
        bare = _body([5, 6, 7], 2)
        bare["disaggregated_params"] = {
            "request_type": "generation_only", "disagg_request_id": 2**50 + 1,
            "ctx_info_endpoint": _info_endpoint(ctx),
        }  # fmt: skip
        r = await client.post(gen.url + "/v1/completions", json=bare)
        assert r.status_code == 400 and "first_gen_tokens" in r.json()["error"]["message"]
        for server in pair:
            await _wait_idle(client, server)


@pytest.mark.parametrize("ending", ["first_token", "step_failure"])
async def test_generation_first_gen_is_refused_at_once_when_ctx_sends_no_kv(
    pair: tuple[Server, Server], ending: str
) -> None:
    """gen asked first; ctx's request then ends without KV to send: at its first token
    (max_tokens 1), or because its prefill step raised (a 500). gen's request fails within a
    second with that reason, not at kv_transfer_timeout_ms, and both workers are idle after
    (peers.md, pain point 1: a prefill-side end must free the decode slot in under a second)."""
    ctx, gen = pair
    key = 2**50 + 7200 + (ending == "step_failure")
    gen_body, ctx_body = _generation_first_bodies(ctx, key, _body(_prompt(random.Random(5), 24), 6))
    if ending == "first_token":
        ctx_body["max_tokens"] = 1
        ctx_status, reason = 200, "it finished at its first token"
    else:
        ctx_status, reason = 500, "it failed"
    async with httpx.AsyncClient(timeout=60) as client:
        async with trio.open_nursery() as nursery:
            refused = await gen_asks_first(client, nursery, gen, ctx, gen_body)
            if ending == "step_failure":
                armed = await client.post(ctx.url + "/debug/step_failures", json={"count": 1})
                assert armed.status_code == 200, armed.text
            started = time.monotonic()
            r = await client.post(ctx.url + "/v1/completions", json=ctx_body)
            assert r.status_code == ctx_status, r.text
        elapsed = time.monotonic() - started
        (g,) = refused
        assert g.status_code == 502, g.text
        message = g.json()["error"]["message"]
        assert f"ctx request ended before its KV was ready: {reason}" in message, message
        assert elapsed < min(1.0, TIMEOUT_MS / 1000 / 2), elapsed  # not the deadline
        await _wait_idle(client, gen)
        await _wait_idle(client, ctx)


async def test_a_client_hanging_up_on_ctx_mid_prefill_refuses_the_waiting_gen_at_once(
    pair: tuple[Server, Server],
) -> None:
    """gen asked first; ctx's client hangs up while its prompt is still prefilling (a prompt of
    many steps at the test budget of 256 tokens a step). ctx aborts the request between two
    chunks, and gen's request fails within a second, naming the abort, not at
    kv_transfer_timeout_ms; both workers end idle (peers.md, pain point 1)."""
    ctx, gen = pair
    gen_body, ctx_body = _generation_first_bodies(
        ctx, 2**50 + 7300, _body(_prompt(random.Random(6), 4000), 4)
    )
    async with httpx.AsyncClient(timeout=60) as client:
        before = (await client.get(ctx.url + "/metrics")).text
        hang_up = trio.CancelScope()

        async def run_ctx() -> None:
            with hang_up:
                await client.post(ctx.url + "/v1/completions", json=ctx_body)
                raise AssertionError("ctx answered before its client hung up")

        def prefilling(text: str) -> bool:
            return metric(text, "trtdisagg_requests_running") >= 1

        async with trio.open_nursery() as nursery:
            refused = await gen_asks_first(client, nursery, gen, ctx, gen_body)
            nursery.start_soon(run_ctx)
            await wait_metrics(client, ctx, prefilling, "ctx prefilling", 10)
            hung_up = time.monotonic()
            hang_up.cancel()
        elapsed = time.monotonic() - hung_up
        (g,) = refused
        assert g.status_code == 502, g.text
        message = g.json()["error"]["message"]
        assert "ctx request ended before its KV was ready: it was aborted" in message, message
        assert elapsed < min(1.0, TIMEOUT_MS / 1000 / 2), elapsed  # not the deadline
        after = await _wait_idle(client, ctx)
        await _wait_idle(client, gen)
        aborted = 'role="ctx",status="aborted"'
        assert metric(after, "trtdisagg_requests_total", aborted) == (
            metric(before, "trtdisagg_requests_total", aborted) + 1
        )


async def test_kv_no_gen_asks_for_is_pinned_until_the_deadline_then_freed_and_counted(
    pair: tuple[Server, Server],
) -> None:
    """A client talks to ctx directly (context_only) and no gen ever asks for the KV, nor does
    anyone release it: ctx pins the blocks until kv_transfer_timeout_ms, not longer, frees them
    then and counts the failed send (peers.md, pain point 16: no block stranded for minutes)."""
    ctx, _ = pair
    body = _body(_prompt(random.Random(8), 40), 4)
    ctx_body = {**body, "disaggregated_params": {"request_type": "context_only"}}
    async with httpx.AsyncClient(timeout=60) as client:
        before = (await client.get(ctx.url + "/metrics")).text
        started = time.monotonic()  # the deadline counts from later: when the KV is ready
        r = await client.post(ctx.url + "/v1/completions", json=ctx_body)
        assert r.status_code == 200, r.text
        pinned = (await client.get(ctx.url + "/metrics")).text
        assert metric(pinned, "trtdisagg_kv_sessions", 'side="sender"') == 1
        assert metric(pinned, "trtdisagg_kv_cache_free_blocks") < metric(
            before, "trtdisagg_kv_cache_free_blocks"
        )
        after = await wait_metrics(client, ctx, is_idle, "ctx idle", TIMEOUT_MS / 1000 + SLACK_S)
        assert time.monotonic() - started >= TIMEOUT_MS / 1000, "freed before the deadline"
        failures = "trtdisagg_kv_transfer_failures_total"
        assert metric(after, failures) == metric(before, failures) + 1


async def test_rendezvous_once_and_one_descriptor_per_run(pair: tuple[Server, Server]) -> None:
    ctx, gen = pair
    rng = random.Random(9)
    async with httpx.AsyncClient(timeout=60) as client:
        await _split(client, ctx, gen, _body(_prompt(rng, 20), 2))  # connection established
        gen_before = (await client.get(gen.url + "/metrics")).text
        for n in (5, 48, 80):
            ctx_before = metric((await client.get(ctx.url + "/metrics")).text,
                                "trtdisagg_kv_transfer_descriptors_total")  # fmt: skip
            await _split(client, ctx, gen, _body(_prompt(rng, n), 2))
            ctx_after = metric((await client.get(ctx.url + "/metrics")).text,
                               "trtdisagg_kv_transfer_descriptors_total")  # fmt: skip
            # Fresh prompts get consecutive blocks on both sides: one contiguous run, one write.
            used = ctx_after - ctx_before
            assert used == 1, f"prompt of {n}: {used} descriptors"
        gen_after = (await client.get(gen.url + "/metrics")).text
    name = "trtdisagg_kv_rendezvous_total"
    assert metric(gen_before, name) >= 1
    assert metric(gen_after, name) == metric(gen_before, name)


async def test_gen_request_whose_ctx_never_answers_times_out(pair: tuple[Server, Server]) -> None:
    ctx, gen = pair
    body = _body([5, 6, 7, 8], 4)
    endpoint = _info_endpoint(ctx)
    body["disaggregated_params"] = {
        "request_type": "generation_only", "first_gen_tokens": [9], "ctx_request_id": 1,
        "disagg_request_id": 2**50 + 12345, "ctx_info_endpoint": endpoint,
    }  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as client:
        start = time.monotonic()
        r = await client.post(gen.url + "/v1/completions", json=body)
        elapsed = time.monotonic() - start
        assert r.status_code == 502, r.text
        assert "timed out" in r.json()["error"]["message"]
        assert TIMEOUT_MS / 1000 - 0.5 <= elapsed <= TIMEOUT_MS / 1000 + 3
        await _wait_idle(client, gen)


async def test_ctx_request_whose_gen_never_asks_is_freed(pair: tuple[Server, Server]) -> None:
    ctx, _ = pair
    body = _body(_prompt(random.Random(1), 50), 8)
    body["disaggregated_params"] = {"request_type": "context_only"}
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(ctx.url + "/v1/completions", json=body)
        assert r.status_code == 200
        text = (await client.get(ctx.url + "/metrics")).text
        held = (
            metric(text, "trtdisagg_kv_cache_total_blocks")
            - metric(text, "trtdisagg_kv_cache_free_blocks")
            - metric(text, "trtdisagg_kv_cache_reusable_blocks")
        )
        assert held > 0  # pinned for the transfer that never comes
        await _wait_idle(client, ctx, timeout=TIMEOUT_MS / 1000 + 5)


async def test_garbage_frames_are_counted_and_dropped(pair: tuple[Server, Server]) -> None:
    ctx, gen = pair
    context = zmq.Context.instance()
    for server in pair:
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 5000)  # connect is asynchronous: let the frames go out
        socket.connect(_info_endpoint(server))
        for frames in ([b"\x00garbage"], [b"a", b"b", b"c"], [b"\x81\xa4type\xa3BAD"], [b""]):
            socket.send_multipart(frames)
        socket.close()
    async with httpx.AsyncClient(timeout=60) as client:
        for server in pair:
            with trio.fail_after(10):
                while True:
                    text = (await client.get(server.url + "/metrics")).text
                    if metric(text, "trtdisagg_control_bad_frames_total") >= 3:
                        break
                    await trio.sleep(0.05)
        tokens, _ = await _split(client, ctx, gen, _body([3, 4, 5, 6, 7], 4))
        assert tokens == await _aggregated(client, ctx, _body([3, 4, 5, 6, 7], 4))


@contextlib.contextmanager
def _mismatched_gen(tmp_path: Path, **overrides: Any) -> Iterator[Server]:
    with running_worker(tmp_path, "gen", cache_transceiver_config=TRANSFER, **overrides) as gen:
        yield gen


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"kv_cache_config": {"tokens_per_block": 32}}, ["tokens_per_block", "32", "16"]),
        ({"dtype": "bfloat16"}, ["dtype", "bfloat16", "float32"]),
        ({"model": "other-tiny"}, ["model_fingerprint"]),
    ],
)
async def test_incompatible_pair_is_refused_fast_with_both_values(
    pair: tuple[Server, Server], tmp_path: Path, overrides: dict[str, Any], words: list[str]
) -> None:
    ctx, _ = pair
    if overrides.get("model") == "other-tiny":  # same shape, other weights: another model
        other = ensure_tiny_checkpoint(tmp_path / "models", TinySpec(seed=99))
        overrides = {"model": str(other), "served_model_name": "tiny"}
    with _mismatched_gen(tmp_path, **overrides) as gen:
        async with httpx.AsyncClient(timeout=60) as client:
            for attempt in range(2):
                ctx_body = {**_body([1, 2, 3, 4, 5], 4),
                            "disaggregated_params": {"request_type": "context_only"}}  # fmt: skip
                answer = (await client.post(ctx.url + "/v1/completions", json=ctx_body)).json()
                start = time.monotonic()
                gen_body = _gen_body(answer, _body([1, 2, 3, 4, 5], 4))
                r = await client.post(gen.url + "/v1/completions", json=gen_body)
                elapsed = time.monotonic() - start
                assert r.status_code == 502, r.text
                message = r.json()["error"]["message"]
                for word in words:
                    assert word in message, message
                assert elapsed < (2.0 if attempt == 0 else 0.5)
            await _wait_idle(client, gen)
