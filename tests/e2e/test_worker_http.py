"""A real worker process over HTTP: aggregated serving, concurrency, bad input, accounting."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import httpx
import openai
import pytest
import trio

from tests.instances import running_instances
from tests.procs import Server, metric

# 24 blocks of 16 tokens: 12 requests of ~40 prompt + 60 output tokens cannot all fit.
SMALL_POOL = {"tokens_per_block": 16, "max_tokens": 384, "enable_block_reuse": False}


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """The worker most tests share, and one with a small pool, started together."""
    specs = {"worker": ("ctx", {}), "small": ("ctx", {"kv_cache_config": SMALL_POOL})}
    with running_instances(tmp_path_factory.mktemp("worker"), specs) as servers:
        yield servers


@pytest.fixture
def worker(workers: dict[str, Server]) -> Server:
    return workers["worker"]


def _body(prompt: str | list[int], max_tokens: int, **extra: object) -> dict[str, object]:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }


async def _tokens(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> list[int]:
    if not body.get("stream"):
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])
    tokens: list[int] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    tokens.extend(choice.get("token_ids", []))
    return tokens


def _free_equals_total(text: str) -> tuple[float, float, float]:
    return (
        metric(text, "trtdisagg_kv_cache_free_blocks"),
        metric(text, "trtdisagg_kv_cache_reusable_blocks"),
        metric(text, "trtdisagg_kv_cache_total_blocks"),
    )


async def _wait_idle(client: httpx.AsyncClient, url: str, timeout: float = 10.0) -> str:
    """Wait until the worker holds no request and every block is free or reusable."""
    with trio.fail_after(timeout):
        while True:
            text = (await client.get(url + "/metrics")).text
            free, reusable, total = _free_equals_total(text)
            running = metric(text, "trtdisagg_requests_running")
            waiting = metric(text, "trtdisagg_requests_waiting")
            if running == 0 and waiting == 0 and free + reusable == total and total > 0:
                return text
            await trio.sleep(0.05)


async def test_concurrent_requests_match_sequential(worker: Server) -> None:
    rng = random.Random(7)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
    bodies = []
    for i in range(32):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 120)))
        bodies.append(_body(prompt, rng.randint(1, 40), stream=i % 3 == 0))
    async with httpx.AsyncClient(timeout=120) as client:
        alone = [await _tokens(client, worker.url, b) for b in bodies]
        together: list[list[int]] = [[] for _ in bodies]

        async def one(i: int) -> None:
            together[i] = await _tokens(client, worker.url, bodies[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(bodies)):
                nursery.start_soon(one, i)
        await _wait_idle(client, worker.url)
    for i, (a, b) in enumerate(zip(alone, together)):
        assert a == b, f"request {i}: alone {a} vs concurrent {b}"
        assert 1 <= len(a) <= bodies[i]["max_tokens"]  # type: ignore[operator]


def test_openai_client(worker: Server) -> None:
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]

    done = client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=8, temperature=0
    )
    assert done.choices[0].finish_reason in ("stop", "length")
    assert done.usage is not None and done.usage.completion_tokens >= 1

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.prompt_tokens > 0

    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi!"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    def seeded(seed: int) -> str:
        r = client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=24, temperature=1.0, seed=seed
        )
        return r.choices[0].text

    assert seeded(1234) == seeded(1234)
    assert len({seeded(s) for s in range(6)}) > 1  # sampling really samples


BAD_BODIES = [
    (b"{not json", 400, "JSON"),
    (json.dumps({"max_tokens": 4}).encode(), 400, "prompt"),
    (json.dumps({"prompt": 12}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "x", "max_tokens": "4"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": -3}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "x", "n": 0}).encode(), 400, "n"),
    (json.dumps({"prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"prompt": [1, 2, 999999]}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "x " * 5000}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "x", "model": "gpt-9"}).encode(), 404, "model"),
    (json.dumps([1, 2]).encode(), 400, "object"),
]


async def test_bad_input_is_rejected_and_server_keeps_serving(worker: Server) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        for raw, status, word in BAD_BODIES:
            r = await client.post(
                worker.url + "/v1/completions",
                content=raw,
                headers={"content-type": "application/json"},
            )
            assert r.status_code == status, (raw[:60], r.text)
            error = r.json()["error"]
            assert word in error["message"], (raw[:60], error)
            assert error["code"] == status
        r = await client.post(worker.url + "/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
        r = await client.post(worker.url + "/v1/chat/completions", json={"prompt": "x"})
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
        r = await client.get(worker.url + "/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        r = await client.post(
            worker.url + "/v1/completions",
            json={"prompt": "x", "disaggregated_params": {"request_type": "generation_only"}},
        )
        assert (
            r.status_code == 400 and "cache_transceiver is disabled" in r.json()["error"]["message"]
        )
        assert await _tokens(client, worker.url, _body("still alive", 3))
        await _wait_idle(client, worker.url)


async def test_client_disconnect_aborts_and_frees(worker: Server) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        before = metric(
            (await client.get(worker.url + "/metrics")).text,
            "trtdisagg_requests_total",
            'role="ctx",status="aborted"',
        )
        body = _body("a long story begins", 2000, stream=True, ignore_eos=True)
        async with client.stream("POST", worker.url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # one chunk arrived: the request is running; hang up now
        text = await _wait_idle(client, worker.url)
        after = metric(text, "trtdisagg_requests_total", 'role="ctx",status="aborted"')
        assert after == before + 1


async def test_preemption_keeps_tokens_and_frees_blocks(workers: dict[str, Server]) -> None:
    server = workers["small"]
    bodies = [_body(f"request number {i} " * (3 + i % 4), 60, ignore_eos=True) for i in range(12)]
    async with httpx.AsyncClient(timeout=120) as client:
        alone = [await _tokens(client, server.url, b) for b in bodies]
        together: list[list[int]] = [[] for _ in bodies]

        async def one(i: int) -> None:
            together[i] = await _tokens(client, server.url, bodies[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(bodies)):
                nursery.start_soon(one, i)
        text = await _wait_idle(client, server.url)
    assert metric(text, "trtdisagg_preemptions_total") > 0, "the pool was meant to overflow"
    assert together == alone


async def test_event_loop_lag_is_exported(worker: Server) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        with trio.fail_after(10):
            while True:  # the watcher observes every 100 ms once the worker runs
                text = (await client.get(worker.url + "/metrics")).text
                if metric(text, "trtdisagg_event_loop_lag_seconds_count") >= 1:
                    break
                await trio.sleep(0.05)
