"""gen's KV pool kept full by disaggregated requests (real ZMQ, real NIXL; peers.md, pain point 4).

High concurrency once gave transfer failures and a slot leak. Here 16 clients keep sending
context_only to ctx and then generation_only to gen, whose pool holds about four requests at a
time, so requests wait on gen for blocks and decodes outgrow what is free. Every request must
succeed with exactly ctx's KV on gen, and afterwards both workers are idle with every block back.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest
import trio

from tests.fault_checks import (
    ENV,
    SLACK_S,
    digests,
    is_idle,
    processes,
    wait_all_healthy,
    wait_metrics,
)
from tests.procs import Server, free_port, metric

pytestmark = pytest.mark.timeout(300)

GEN_POOL_TOKENS = 512  # 32 blocks of 16: about four of these requests at once
REQUESTS = 64
CLIENTS = 16
MAX_TOKENS = 32
TIMEOUT_S = 20.0  # ctx keeps a request's KV this long for a gen that waits for blocks


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    assert ENV["TRTDISAGG_TEST_HOOKS"] == "1"  # KV digests on both sides
    with processes(tmp_path_factory.mktemp("pressure")) as procs:
        ctx = procs.start_worker("ctx", free_port(), timeout_s=TIMEOUT_S)
        gen = procs.start_worker(
            "gen", free_port(), timeout_s=TIMEOUT_S, kv_cache_config={"max_tokens": GEN_POOL_TOKENS}
        )
        wait_all_healthy(ctx, gen)
        yield ctx, gen


async def test_a_full_gen_pool_delays_requests_and_loses_none(pair: tuple[Server, Server]) -> None:
    ctx, gen = pair
    rng = random.Random(4)
    bodies = [
        {"prompt": [rng.randrange(10, 500) for _ in range(rng.randint(60, 100))],
         "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        for _ in range(REQUESTS)
    ]  # fmt: skip
    keys: list[str] = []
    peak_waiting = 0.0
    async with httpx.AsyncClient(timeout=60) as client:
        queue = list(range(REQUESTS))

        async def one_client() -> None:
            while queue:
                body = bodies[queue.pop()]
                ctx_body = {**body, "disaggregated_params": {"request_type": "context_only"}}
                r = await client.post(ctx.url + "/v1/completions", json=ctx_body)
                assert r.status_code == 200, r.text
                answer = r.json()
                params = dict(answer["choices"][0]["disaggregated_params"])
                params["request_type"] = "generation_only"
                gen_body = {**body, "prompt_token_ids": answer["prompt_token_ids"],
                            "disaggregated_params": params}  # fmt: skip
                g = await client.post(gen.url + "/v1/completions", json=gen_body)
                assert g.status_code == 200, g.text
                assert len(g.json()["choices"][0]["token_ids"]) == MAX_TOKENS
                keys.append(str(params["transfer_key"]))

        async def watch_gen() -> None:
            nonlocal peak_waiting
            while True:
                text = (await client.get(gen.url + "/metrics")).text
                peak_waiting = max(peak_waiting, metric(text, "trtdisagg_requests_waiting"))
                await trio.sleep(0.02)  # sampling an observable state, not waiting for it

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_gen)
            async with trio.open_nursery() as clients:
                for _ in range(CLIENTS):
                    clients.start_soon(one_client)
            nursery.cancel_scope.cancel()
        assert len(keys) == REQUESTS
        assert peak_waiting >= 4, peak_waiting  # gen queued requests: its pool was the limit
        ctx_digests, gen_digests = await digests(client, ctx), await digests(client, gen)
        for key in keys:
            assert gen_digests[key] == ctx_digests[key], key
        for server in pair:
            await wait_metrics(client, server, is_idle, "idle", SLACK_S)
