"""A model step that fails in a real worker process: what the client sees, and what the worker does.

The worker runs with the test hooks on (TRTDISAGG_TEST_HOOKS=1), and `POST /debug/step_failures`
makes its next steps raise in the forward's thread, where a CUDA error or a sampling bug would.
The requests of a failed step get a 500 naming the cause (a 500 on gen too, where a failed KV
transfer is a 502); the worker serves on with every block back. Failed steps in a row stop it:
`/health` answers 503 with the reason, new requests a 503, and the process stays up.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fault_checks import completion, is_idle, wait_metrics
from tests.instances import running_instances
from tests.procs import Server, metric
from trtdisagg.worker.engine.loop import MAX_CONSECUTIVE_STEP_FAILURES

pytestmark = pytest.mark.timeout(300)

ENV = {"TRTDISAGG_TEST_HOOKS": "1"}
TRANSFER = {"cache_transceiver_config": {"backend": "NIXL", "nixl_progress_thread": False}}
INJECTED = "internal error in the model step: InjectedStepFailure: step failure injected"
IDLE_S = 15.0


async def arm(client: httpx.AsyncClient, server: Server, count: int) -> None:
    r = await client.post(server.url + "/debug/step_failures", json={"count": count})
    assert r.status_code == 200, r.text


async def post(client: httpx.AsyncClient, server: Server, body: dict[str, Any]) -> httpx.Response:
    return await client.post(server.url + "/v1/completions", json=body)


def assert_step_failed(r: httpx.Response) -> None:
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["message"].startswith(INJECTED), error
    assert (error["type"], error["code"]) == ("internal_server_error", 500)


async def stream_events(
    client: httpx.AsyncClient, server: Server, body: dict[str, Any]
) -> list[Any]:
    events: list[Any] = []
    async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return events


async def wait_idle(client: httpx.AsyncClient, server: Server) -> str:
    return await wait_metrics(client, server, is_idle, "every block free", IDLE_S)


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """A ctx and gen pair, and a ctx whose steps will keep failing, all started together."""
    specs = {"ctx": ("ctx", TRANSFER), "gen": ("gen", TRANSFER), "doomed": ("ctx", {})}
    with running_instances(tmp_path_factory.mktemp("workers"), specs, env=ENV) as servers:
        yield servers


async def test_a_failed_step_is_a_500_and_the_worker_serves_on(workers: dict[str, Server]) -> None:
    prompt = [(7 * i + 3) % 400 + 10 for i in range(30)]
    other = [(11 * i + 5) % 400 + 10 for i in range(30)]
    worker = workers["ctx"]
    async with httpx.AsyncClient(timeout=60) as client:
        r = await post(client, worker, completion(prompt, 8))
        assert r.status_code == 200, r.text
        expected = r.json()["choices"][0]["token_ids"]

        await arm(client, worker, 1)
        assert_step_failed(await post(client, worker, completion(other, 8)))
        r = await post(client, worker, completion(prompt, 8))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected

        await arm(client, worker, 1)  # a stream has sent its 200: the error is an event
        events = await stream_events(client, worker, completion(other, 8, stream=True))
        assert events[-1] == "[DONE]", events
        error = events[-2]["error"]
        assert error["message"].startswith(INJECTED) and error["code"] == 500, events

        assert (await client.get(worker.url + "/health")).status_code == 200
        text = await wait_idle(client, worker)
        assert metric(text, "trtdisagg_step_failures_total") == 2
        assert metric(text, "trtdisagg_requests_total", 'role="ctx",status="error"') == 2


async def test_failed_steps_in_a_row_make_the_worker_unhealthy(
    workers: dict[str, Server],
) -> None:
    worker = workers["doomed"]
    async with httpx.AsyncClient(timeout=60) as client:
        await arm(client, worker, MAX_CONSECUTIVE_STEP_FAILURES)
        for i in range(MAX_CONSECUTIVE_STEP_FAILURES):  # one at a time: one step each
            assert_step_failed(await post(client, worker, completion([20 + i] * 12, 4)))

        r = await client.get(worker.url + "/health")
        assert r.status_code == 503, r.text
        health = r.json()
        assert health["status"] == "unhealthy", health
        assert health["reason"].startswith("3 model steps failed in a row"), health
        assert "InjectedStepFailure: step failure injected" in health["reason"], health

        r = await post(client, worker, completion([30] * 12, 4))
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["message"].startswith("this worker stopped serving: 3 model steps")
        assert error["type"] == "service_unavailable"

        assert worker.alive()  # stopped serving, not exited: its state stays readable
        text = await wait_idle(client, worker)
        assert metric(text, "trtdisagg_step_failures_total") == MAX_CONSECUTIVE_STEP_FAILURES


async def context_only(client: httpx.AsyncClient, ctx: Server, body: dict[str, Any]) -> Any:
    r = await post(client, ctx, {**body, "disaggregated_params": {"request_type": "context_only"}})
    assert r.status_code == 200, r.text
    return r.json()


def generation_only(answer: Any, body: dict[str, Any]) -> dict[str, Any]:
    params = {**answer["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
    return {**body, "prompt_token_ids": answer["prompt_token_ids"], "disaggregated_params": params}


async def test_a_failed_step_on_gen_is_a_500_not_an_upstream_502(
    workers: dict[str, Server],
) -> None:
    body = completion([(5 * i + 1) % 400 + 10 for i in range(40)], 6)
    ctx, gen = workers["ctx"], workers["gen"]
    async with httpx.AsyncClient(timeout=60) as client:
        answer = await context_only(client, ctx, body)
        await arm(client, gen, 1)
        # The KV came from ctx; the decode step after it failed: this worker's fault.
        assert_step_failed(await post(client, gen, generation_only(answer, body)))
        for server in (ctx, gen):
            await wait_idle(client, server)

        answer = await context_only(client, ctx, body)
        r = await post(client, gen, generation_only(answer, body))
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["token_ids"]) == 6
        for server in (ctx, gen):
            await wait_idle(client, server)
