"""Deadlines per phase and stream migration, through a real coordinator in front of fake workers.

A fake gen stalls after a few tokens (``stall_after``), hangs before answering (``hang``) or
goes away mid-stream; its tokens are a function of the sequence so far, so an answer resumed on
another gen from prompt + tokens sent is the uninterrupted answer exactly when the coordinator
relays, resumes and counts correctly. Round robin places the first leg on gen 0.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import trio

from tests.fake_worker import fake_tokenize, text_of
from tests.integration.test_coordinator_fake_workers import (
    Cluster,
    _body,
    _events,
    _expected,
    start_cluster,
)

pytestmark = pytest.mark.timeout(60)

# Deadlines short enough for a quick test, and long enough that a busy 2-core machine stalling
# this process (workers, coordinator and client share its loop) does not trip them.
FAST = {"inter_token_timeout": 0.6, "gen_first_token_timeout": 0.8, "request_timeout": 10}


@pytest.fixture
async def client() -> Any:
    async with httpx.AsyncClient(timeout=20) as c:
        yield c


def _metric(text: str, name: str, **labels: str) -> float:
    inside = ",".join(f'{k}="{v}"' for k, v in labels.items())
    prefix = f"{name}{{{inside}}} " if labels else f"{name} "
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix)]
    return values[0] if values else 0.0


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[Any]:
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        return [event async for event in _events(r)]


def _tokens(events: list[Any]) -> list[int]:
    return [t for e in events if isinstance(e, dict) for c in e.get("choices", [])
            for t in c.get("token_ids", [])]  # fmt: skip


async def _metrics(client: httpx.AsyncClient, c: Cluster) -> str:
    return (await client.get(c.url + "/metrics")).text


async def test_a_stalled_stream_resumes_on_another_gen_with_no_gap_and_no_duplicate(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, gen=2, **FAST)
    stalled = c.gen[0].worker
    stalled.stall_after = 3
    body = _body(max_tokens=12, stream=True, stream_options={"include_usage": True})
    events = await _stream(client, c.url, body)
    expected = _expected(body["prompt"], 12)
    assert _tokens(events) == expected  # every token once, in order
    text = "".join(ch["text"] for e in events if isinstance(e, dict) for ch in e["choices"])
    assert text == text_of(expected)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert {e["id"] for e in events if isinstance(e, dict)} == {"cmpl-fake"}
    finishes = [ch["finish_reason"] for e in events[:-1] for ch in e["choices"]]
    assert [f for f in finishes if f is not None] == ["length"]
    usage = events[-2]["usage"]
    assert usage["prompt_tokens"] == len(fake_tokenize(body["prompt"]))
    assert usage["completion_tokens"] == 12 and usage["total_tokens"] == usage["prompt_tokens"] + 12
    # The continuation: gen 1 alone, for prompt + the 3 tokens sent and the 9 left.
    (continuation,) = c.gen[1].worker.bodies
    assert continuation["prompt_token_ids"] == fake_tokenize(body["prompt"]) + expected[:3]
    assert continuation["max_tokens"] == 9 and "disaggregated_params" not in continuation
    with trio.fail_after(2):
        await stalled.wait_running(0)  # the stalled leg was cut: its request ended
    metrics = await _metrics(client, c)
    miss = {"phase": "inter_token", "server": c.gen[0].url}
    assert _metric(metrics, "trtdisagg_coordinator_deadline_misses_total", **miss) == 1
    assert _metric(metrics, "trtdisagg_coordinator_migrations_total", reason="deadline") == 1
    assert _metric(metrics, "trtdisagg_requests_total", role="coordinator", status="ok") == 1


async def test_a_whole_answer_migrates_too(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, gen=2, **FAST)
    c.gen[0].worker.stall_after = 4
    r = await client.post(c.url + "/v1/completions", json=_body(max_tokens=10))
    assert r.status_code == 200, r.text
    answer = r.json()
    expected = _expected(_body()["prompt"], 10)
    assert answer["choices"][0]["token_ids"] == expected
    assert answer["choices"][0]["text"] == text_of(expected)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 10
    assert answer["prompt_token_ids"] == fake_tokenize(_body()["prompt"])
    assert answer["object"] == "text_completion"


async def test_chat_migration_sends_the_role_once(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, gen=2, **FAST)
    c.gen[0].worker.stall_after = 2
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "stream": True}  # fmt: skip
    async with client.stream("POST", c.url + "/v1/chat/completions", json=body) as r:
        events = [e async for e in _events(r)]
    deltas = [ch["delta"] for e in events if isinstance(e, dict) for ch in e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    prompt = fake_tokenize("user: hi")
    assert content == text_of(_expected(prompt, 6))
    assert all("token_ids" not in ch for e in events[:-1] for ch in e["choices"])


async def test_without_migrations_a_stall_ends_the_stream_with_an_error_at_the_deadline(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, gen=2, max_migrations=0, **FAST)
    stalled = c.gen[0].worker
    stalled.stall_after = 2
    started = time.monotonic()
    events = await _stream(client, c.url, _body(max_tokens=8, stream=True))
    took = time.monotonic() - started
    assert _tokens(events) == _expected(_body()["prompt"], 8)[:2]
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == 504 and "inter_token_timeout=0.6s" in error["message"], error
    assert took < 3  # the inter-token deadline, not request_timeout
    assert c.gen[1].worker.bodies == []
    with trio.fail_after(2):
        await stalled.wait_running(0)


async def test_a_gen_that_goes_away_mid_stream_is_resumed_and_reported(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, gen=2, health_check_interval=5, **FAST)
    c.gen[0].worker.token_delay = 0.05
    body = _body(max_tokens=20, stream=True)
    tokens: list[int] = []
    async with client.stream("POST", c.url + "/v1/completions", json=body) as r:
        async for event in _events(r):
            if isinstance(event, dict):
                tokens += [t for ch in event["choices"] for t in ch.get("token_ids", [])]
            if len(tokens) == 3 and c.gen[0].worker.running:
                await c.stop(c.gen[0])  # the process goes away: its connections drop
    assert tokens == _expected(body["prompt"], 20)
    info = (await client.get(c.url + "/cluster_info")).json()
    assert info["server_lists"]["generation"] == [c.gen[1].url], info  # out at once
    metrics = await _metrics(client, c)
    assert _metric(metrics, "trtdisagg_coordinator_migrations_total", reason="unreachable") == 1


async def test_a_missed_deadline_takes_the_worker_out_until_a_later_health_check_passes(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """The stalled gen answers /health all along, so probes alone would never evict it: the
    missed deadline does, at once, and the next probe sent after the miss brings it back."""
    c = await start_cluster(nursery, gen=2, health_check_interval=1.0, **FAST)
    stalled = c.gen[0].worker
    stalled.stall_after = 2
    checks = stalled.health_checks
    events = await _stream(client, c.url, _body(max_tokens=6, stream=True))
    assert _tokens(events) == _expected(_body()["prompt"], 6)
    info = (await client.get(c.url + "/cluster_info")).json()
    assert info["server_lists"]["generation"] == [c.gen[1].url], info
    (gen0,) = [s for s in info["servers"] if s["url"] == c.gen[0].url]
    assert "inter_token_timeout" in gen0["last_error"], gen0
    stalled.stall_after = None

    async def serving() -> list[str]:
        info = (await client.get(c.url + "/cluster_info")).json()
        return list(info["server_lists"]["generation"])

    with trio.fail_after(5):  # another process's state: polled, bounded
        while await serving() != [c.gen[0].url, c.gen[1].url]:  # noqa: ASYNC110
            await trio.sleep(0.05)
    assert stalled.health_checks > checks


@pytest.mark.parametrize("stream", [False, True])
async def test_a_gen_silent_before_its_first_token_is_retried_elsewhere(
    nursery: trio.Nursery, client: httpx.AsyncClient, stream: bool
) -> None:
    c = await start_cluster(nursery, gen=2, **FAST)
    c.gen[0].worker.hang = True  # takes the request, never answers
    started = time.monotonic()
    body = _body(max_tokens=5, stream=stream)
    if stream:
        tokens = _tokens(await _stream(client, c.url, body))
    else:
        r = await client.post(c.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["token_ids"]
    assert tokens == _expected(body["prompt"], 5)
    assert time.monotonic() - started < 3
    miss = {"phase": "gen_first_token", "server": c.gen[0].url}
    metrics = await _metrics(client, c)
    assert _metric(metrics, "trtdisagg_coordinator_deadline_misses_total", **miss) == 1


async def test_a_silent_ctx_misses_its_deadline_releases_and_is_retried(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(
        nursery, ctx=2, ctx_first_token_timeout=0.6, request_timeout=10, health_check_interval=5
    )
    c.ctx[0].worker.hang = True
    started = time.monotonic()
    r = await client.post(c.url + "/v1/completions", json=_body())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == _expected(_body()["prompt"])
    assert time.monotonic() - started < 3
    with trio.fail_after(2):
        await c.ctx[0].worker.wait_releases(1)  # it may hold KV for the id it was sent
    metrics = await _metrics(client, c)
    miss = {"phase": "ctx_first_token", "server": c.ctx[0].url}
    assert _metric(metrics, "trtdisagg_coordinator_deadline_misses_total", **miss) == 1
    info = (await client.get(c.url + "/cluster_info")).json()
    assert c.ctx[0].url not in info["server_lists"]["context"]


async def test_each_choice_of_a_batch_migrates_on_its_own(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, gen=2, **FAST)
    c.gen[0].worker.stall_after = 3  # one choice's first leg lands here, the other's on gen 1
    prompts = ["first prompt here", "and a second one"]
    body = _body(prompts, max_tokens=7, stream=True, stream_options={"include_usage": True})
    events = await _stream(client, c.url, body)
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    for event in events[:-1]:
        for ch in event["choices"]:
            per_choice[ch["index"]] += ch.get("token_ids", [])
    assert per_choice == {i: _expected(p, 7) for i, p in enumerate(prompts)}
    assert events[-2]["usage"]["completion_tokens"] == 14
    metrics = await _metrics(client, c)
    assert _metric(metrics, "trtdisagg_coordinator_migrations_total", reason="deadline") == 1


async def test_no_gen_left_to_resume_on_ends_the_stream_cleanly(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    c = await start_cluster(nursery, gen=1, **FAST)
    c.gen[0].worker.stall_after = 2
    events = await _stream(client, c.url, _body(max_tokens=6, stream=True))
    assert _tokens(events) == _expected(_body()["prompt"], 6)[:2]
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503, events[-2]
    metrics = await _metrics(client, c)
    assert _metric(metrics, "trtdisagg_requests_total", role="coordinator", status="error") == 1


async def test_an_error_mid_stream_is_resumed_and_the_worker_stays_in_rotation(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """gen answered, with an error event (a failed step, KV that could not come): the answer is
    resumed elsewhere, and the worker, which is alive and says so on /health, is not evicted."""
    c = await start_cluster(nursery, gen=2, health_check_interval=5, **FAST)
    c.gen[0].worker.error_after = 3
    events = await _stream(client, c.url, _body(max_tokens=8, stream=True))
    assert _tokens(events) == _expected(_body()["prompt"], 8)
    assert not any("error" in e for e in events if isinstance(e, dict))
    info = (await client.get(c.url + "/cluster_info")).json()
    assert info["server_lists"]["generation"] == [c.gen[0].url, c.gen[1].url]
    metrics = await _metrics(client, c)
    assert _metric(metrics, "trtdisagg_coordinator_migrations_total", reason="failed") == 1
