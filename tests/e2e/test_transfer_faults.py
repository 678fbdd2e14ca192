"""Injected control- and data-plane faults between a real ctx and gen (real ZMQ, real NIXL).

One ctx and one gen run with faults armed but no rule (TRTDISAGG_FAULTS=none); each scenario
arms its rules through `POST /debug/faults`, sends one request through ctx → gen, and disarms.
Every fault, on its own, must end in success or in a clean failure within the transfer deadline;
afterwards both workers are idle with every block back (free + reusable == total), no transfer
session or quarantine left, and the next transfer moves exactly the bytes ctx held.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import resource
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import httpx
import pytest
import trio

from tests.fault_checks import (
    SLACK_S,
    TIMEOUT_S,
    completion,
    digests,
    held_blocks,
    is_idle,
    processes,
    set_faults,
    wait_all_healthy,
    wait_metrics,
)
from tests.procs import Server, free_port, metric

pytestmark = pytest.mark.timeout(300)
MIN_GBPS = 0.1  # ctx's kv_transfer_min_gbps
SLOW = "trtdisagg_kv_slow_writes_total"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    with processes(tmp_path_factory.mktemp("faults")) as procs:
        # the floor: far under what a write to a gen on this host moves, unless it is stalled
        ctx = procs.start_worker("ctx", free_port(), transfer={"kv_transfer_min_gbps": MIN_GBPS})
        gen = procs.start_worker("gen", free_port())
        wait_all_healthy(ctx, gen)
        yield ctx, gen


@attrs.frozen(kw_only=True)
class Case:
    ctx: str = "none"
    gen: str = "none"
    fails_with: str | None = None  # None: the transfer succeeds
    within_s: float = TIMEOUT_S + SLACK_S  # the gen request ends this soon either way
    quarantine_expires: bool = False  # gen frees its blocks only after the second timeout


# ctx's report of a write lost (TRANSFER_RESULT) ...
LOST = "drop:TRANSFER_RESULT:1"
# ... and at gen, the write's notification, which says what the write moved.
NOTICE_LOST = "drop:WRITE_NOTICE:1"

CASES = {
    # TRANSFER_RESULT (ctx -> gen): gen needs it only when the notice did not come
    "result dropped: the notice suffices": Case(ctx=LOST),
    "result duplicated": Case(ctx="dup:TRANSFER_RESULT:1"),
    "result delayed": Case(ctx="delay:TRANSFER_RESULT:300ms:1"),
    "result and notice dropped": Case(ctx=LOST, gen=NOTICE_LOST, fails_with="timed out"),
    "notice dropped, result later than the deadline": Case(
        ctx=f"delay:TRANSFER_RESULT:{TIMEOUT_S + 1}s:1",
        gen=NOTICE_LOST,
        fails_with="timed out",
    ),
    # REQUEST_DATA (gen -> ctx)
    "request dropped": Case(gen="drop:REQUEST_DATA:1", fails_with="timed out"),
    "request duplicated": Case(gen="dup:REQUEST_DATA:1"),
    "request delayed": Case(gen="delay:REQUEST_DATA:300ms:1"),
    # WRITE_NOTICE (NIXL's notification that the bytes landed, at gen)
    "notice dropped": Case(gen="drop:WRITE_NOTICE:1", fails_with="timed out"),
    "notice duplicated": Case(gen="dup:WRITE_NOTICE:1"),
    "notice delayed": Case(gen="delay:WRITE_NOTICE:300ms:1"),
    # the NIXL write itself (ctx)
    "submit fails": Case(ctx="fail_submit:1", fails_with="injected fault", within_s=SLACK_S),
    "write stalls": Case(ctx="stall_transfer:500ms:1"),
    # CANCEL (gen -> ctx, after a timeout): its answer is what lets gen free its blocks early
    "cancel duplicated": Case(ctx=LOST, gen=f"{NOTICE_LOST};dup:CANCEL:1", fails_with="timed out"),
    "cancel delayed": Case(
        ctx=LOST, gen=f"{NOTICE_LOST};delay:CANCEL:500ms:1", fails_with="timed out"
    ),
    "cancel dropped too: gen waits a second timeout": Case(
        ctx=LOST,
        gen=f"{NOTICE_LOST};drop:CANCEL:1",
        fails_with="timed out",
        quarantine_expires=True,
    ),
}


async def context_only(client: httpx.AsyncClient, ctx: Server, body: dict[str, Any]) -> Any:
    r = await client.post(
        ctx.url + "/v1/completions",
        json={**body, "disaggregated_params": {"request_type": "context_only"}},
    )
    assert r.status_code == 200, r.text
    return r.json()


def gen_body(answer: Any, body: dict[str, Any]) -> dict[str, Any]:
    params = {**answer["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
    return {**body, "prompt_token_ids": answer["prompt_token_ids"], "disaggregated_params": params}


async def assert_exact_transfer(
    client: httpx.AsyncClient, ctx: Server, gen: Server, rng: random.Random
) -> None:
    """One clean ctx → gen transfer: it succeeds and gen holds exactly ctx's bytes."""
    body = completion([rng.randrange(10, 500) for _ in range(rng.randint(20, 70))], 4)
    answer = await context_only(client, ctx, body)
    r = await client.post(gen.url + "/v1/completions", json=gen_body(answer, body))
    assert r.status_code == 200, r.text
    key = str(answer["choices"][0]["disaggregated_params"]["transfer_key"])
    assert (await digests(client, ctx))[key] == (await digests(client, gen))[key], key


@pytest.mark.parametrize("name", list(CASES))
async def test_one_fault_ends_cleanly_within_the_deadline(
    pair: tuple[Server, Server], name: str
) -> None:
    case = CASES[name]
    ctx, gen = pair
    rng = random.Random(name)
    async with httpx.AsyncClient(timeout=60) as client:
        expired = "trtdisagg_kv_quarantine_expired_total"
        expired_before = metric((await client.get(gen.url + "/metrics")).text, expired)
        body = completion([rng.randrange(10, 500) for _ in range(rng.randint(20, 90))], 6)
        answer = await context_only(client, ctx, body)
        await set_faults(client, ctx, case.ctx)
        await set_faults(client, gen, case.gen)
        started = time.monotonic()
        r = await client.post(gen.url + "/v1/completions", json=gen_body(answer, body))
        elapsed = time.monotonic() - started
        await set_faults(client, ctx, "none")
        await set_faults(client, gen, "none")
        assert elapsed < case.within_s, f"{name}: the gen request took {elapsed:.2f}s"
        if case.fails_with is None:
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"][0]["token_ids"]) == 6
            key = str(answer["choices"][0]["disaggregated_params"]["transfer_key"])
            ctx_digest, gen_digest = [(await digests(client, s))[key] for s in pair]
            assert ctx_digest == gen_digest, f"{name}: the bytes differ"
        else:
            assert r.status_code == 502, r.text
            assert case.fails_with in r.json()["error"]["message"], r.text

        # Blocks come back on both sides: at once when ctx answers, else after the second
        # timeout (the only case where gen frees without ctx's word, and it is counted).
        settle = 2 * TIMEOUT_S + SLACK_S if case.quarantine_expires else TIMEOUT_S + SLACK_S
        gen_text = await wait_metrics(client, gen, is_idle, "gen idle", settle)
        await wait_metrics(client, ctx, is_idle, "ctx idle", settle)
        assert metric(gen_text, expired) - expired_before == (1 if case.quarantine_expires else 0)
        await assert_exact_transfer(client, ctx, gen, rng)


async def test_cancel_during_a_stalled_write_quarantines_until_it_lands(
    pair: tuple[Server, Server],
) -> None:
    """A gen client hangs up while ctx's write is in flight: cancel returns False on gen (and
    ctx's session is cancelled with the write in flight), both keep their blocks pinned and say
    so in `trtdisagg_kv_quarantined_requests`, and both free them once the write completes."""
    ctx, gen = pair
    stall_s = 1.5
    rng = random.Random(77)
    async with httpx.AsyncClient(timeout=60) as client:
        body = completion([rng.randrange(10, 500) for _ in range(60)], 50)
        answer = await context_only(client, ctx, body)
        stalls = metric(
            (await client.get(ctx.url + "/metrics")).text, "trtdisagg_faults_injected_total",
            'action="stall_transfer",message=""',
        )  # fmt: skip
        gen_before = (await client.get(gen.url + "/metrics")).text
        aborted = metric(gen_before, "trtdisagg_requests_total", 'role="gen",status="aborted"')
        expired = metric(gen_before, "trtdisagg_kv_quarantine_expired_total")
        await set_faults(client, ctx, f"stall_transfer:{stall_s}s:1")
        request_scope = trio.CancelScope()

        async def request() -> None:
            with request_scope:
                await client.post(gen.url + "/v1/completions", json=gen_body(answer, body))
                raise AssertionError("the gen request ended before the client hung up")

        def stalled(text: str) -> bool:
            key = 'action="stall_transfer",message=""'
            return metric(text, "trtdisagg_faults_injected_total", key) == stalls + 1

        async with trio.open_nursery() as nursery:
            # The stall starts after this (one clock for every process of the host); the test
            # sees it start only at its next /metrics poll, which a busy machine delays.
            requested_at = time.monotonic()
            nursery.start_soon(request)
            await wait_metrics(client, ctx, stalled, "ctx write in flight", 10)
            stalled_at = time.monotonic()
            request_scope.cancel()  # the client hangs up mid-transfer
        await set_faults(client, ctx, "none")

        def quarantined(text: str) -> bool:
            return metric(text, "trtdisagg_kv_quarantined_requests") == 1 and held_blocks(text) > 0

        await wait_metrics(client, gen, quarantined, "gen quarantine", stall_s / 2)
        await wait_metrics(client, ctx, quarantined, "ctx quarantine", stall_s / 2)
        assert time.monotonic() - stalled_at < stall_s, "the write completed before the check"
        gen_text = await wait_metrics(client, gen, is_idle, "gen idle", stall_s + SLACK_S)
        await wait_metrics(client, ctx, is_idle, "ctx idle", SLACK_S)
        assert time.monotonic() - requested_at >= stall_s, "freed before the write landed"
        after = metric(gen_text, "trtdisagg_requests_total", 'role="gen",status="aborted"')
        assert after == aborted + 1
        assert metric(gen_text, "trtdisagg_kv_quarantine_expired_total") == expired  # ctx answered
        await assert_exact_transfer(client, ctx, gen, rng)


async def test_a_kv_write_below_the_bandwidth_floor_is_counted_and_logged(
    pair: tuple[Server, Server],
) -> None:
    """ctx runs with kv_transfer_min_gbps 0.1 (pain point 20: a transport that fell back to TCP
    said nothing). A 4.1 MiB write moves at several GB/s here and is not counted; the same write
    held back 500 ms (0.01 GB/s) is counted in trtdisagg_kv_slow_writes_total and logged, with
    the gen instance it went to, and the transfer itself still succeeds."""
    ctx, gen = pair
    rng = random.Random(20)
    (name,) = re.findall(r"KvCacheTransceiver backend=NIXL .* instance=(\S+)", gen.log())
    async with httpx.AsyncClient(timeout=60) as client:
        for stall, slow_writes in ((None, 0), ("stall_transfer:500ms:1", 1)):
            before = metric((await client.get(ctx.url + "/metrics")).text, SLOW)
            body = completion([rng.randrange(10, 500) for _ in range(2100)], 2)  # 66 blocks
            answer = await context_only(client, ctx, body)
            if stall is not None:
                await set_faults(client, ctx, stall)
            r = await client.post(gen.url + "/v1/completions", json=gen_body(answer, body))
            await set_faults(client, ctx, "none")
            assert r.status_code == 200, r.text
            after = metric((await client.get(ctx.url + "/metrics")).text, SLOW)
            assert after - before == slow_writes, (stall, after - before)
    warnings = [line for line in ctx.log().splitlines() if "below kv_transfer_min_gbps" in line]
    assert len(warnings) == 1, warnings
    assert f"KV writes to gen {name} run below kv_transfer_min_gbps (0.1 GB/s)" in warnings[0]


async def test_fault_routes_read_and_replace_the_plan(pair: tuple[Server, Server]) -> None:
    ctx, _ = pair
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(ctx.url + "/debug/faults", json={"spec": "drop:TRANSFER_RESULT;x"})
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("spec: fault rule 2 'x': unknown action")
        assert (await client.post(ctx.url + "/debug/faults", json={})).status_code == 400
        await set_faults(client, ctx, "dup:CANCEL:2; stall_transfer:1s")
        state = (await client.get(ctx.url + "/debug/faults")).json()
        assert state == {
            "plan": "dup:CANCEL:2;stall_transfer:1000ms",
            "rules": [{"rule": "dup:CANCEL:2", "fired": 0},
                      {"rule": "stall_transfer:1000ms", "fired": 0}],
        }  # fmt: skip
        await set_faults(client, ctx, "none")


async def test_saturated_peers_answer_each_other_s_probes_and_keep_each_other(
    pair: tuple[Server, Server],
) -> None:
    """Both workers run full batches of their own requests (peers.md, pain point 17: lease
    heartbeats starved at batch 128). Liveness runs on the control plane, beside the step loop,
    so each still answers the other's probes within peer_probe_ms: probes go out while the
    batches run, neither worker forgets the other, and the next transfer needs no new
    rendezvous."""
    ctx, gen = pair
    rng = random.Random(17)
    probes, forgotten = "trtdisagg_kv_peer_probes_total", "trtdisagg_kv_peers_forgotten_total"
    async with httpx.AsyncClient(timeout=60) as client:
        await assert_exact_transfer(client, ctx, gen, rng)  # each knows the other
        before = {s.url: (await client.get(s.url + "/metrics")).text for s in pair}

        async def load(server: Server) -> None:
            while True:
                body = completion([rng.randrange(10, 500) for _ in range(100)], 64)
                r = await client.post(server.url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text

        def probed_while_busy(server: Server) -> Callable[[str], bool]:
            def check(text: str) -> bool:
                sent = metric(text, probes) - metric(before[server.url], probes)
                return sent >= 4 and metric(text, "trtdisagg_requests_running") >= 16

            return check

        async with trio.open_nursery() as nursery:
            for server in pair:
                for _ in range(24):
                    nursery.start_soon(load, server)
            # A peer that misses three probes in a row is forgotten and probed no more: a fourth
            # probe means the three before it were answered, within peer_probe_ms each.
            for server in pair:
                await wait_metrics(client, server, probed_while_busy(server), "probes", 30)
            nursery.cancel_scope.cancel()
        for server in pair:
            text = await wait_metrics(client, server, is_idle, "idle", SLACK_S + 10)
            assert metric(text, forgotten) == metric(before[server.url], forgotten), server.url
        rendezvous = "trtdisagg_kv_rendezvous_total"
        await assert_exact_transfer(client, ctx, gen, rng)
        after = (await client.get(gen.url + "/metrics")).text
        assert metric(after, rendezvous) == metric(before[gen.url], rendezvous)


async def test_a_ctx_out_of_file_descriptors_stays_up_and_serves_once_some_close(
    pair: tuple[Server, Server],
) -> None:
    """Pain point 8: a server ran out of file descriptors. ctx's open-file limit is cut to what
    it holds plus a few, and idle client connections take those: its accepts fail with EMFILE
    (logged, and retried). A request that comes then waits, ctx stays up, and once the idle
    connections close the request is answered, and its KV moves to gen byte for byte. The log
    says so in one line a second, without a traceback. The last test of the module: it leaves
    ctx's limit as it was."""
    ctx, gen = pair
    pid, limit = ctx.proc.pid, resource.RLIMIT_NOFILE
    soft, hard = resource.prlimit(pid, limit)
    emfile = "accept returned EMFILE"
    seen = ctx.log().count(emfile)
    rng = random.Random(8)
    host, port = "127.0.0.1", int(ctx.url.rsplit(":", 1)[1])
    async with httpx.AsyncClient(timeout=60) as client:
        with contextlib.ExitStack() as idle:
            resource.prlimit(pid, limit, (len(os.listdir(f"/proc/{pid}/fd")) + 4, hard))
            try:
                for _ in range(12):  # more than ctx can accept now
                    idle.enter_context(socket.create_connection((host, port)))

                def exhausted() -> bool:
                    return ctx.log().count(emfile) > seen

                with trio.fail_after(20):
                    while not exhausted():  # noqa: ASYNC110
                        await trio.sleep(0.05)  # polling ctx's log, bounded above
                body = completion([rng.randrange(10, 500) for _ in range(40)], 4)
                # Connected (in ctx's accept queue) while ctx cannot accept it.
                waiting = await trio.open_tcp_stream(host, port)
                request = json.dumps(
                    {**body, "disaggregated_params": {"request_type": "context_only"}}
                ).encode()
                await waiting.send_all(
                    b"POST /v1/completions HTTP/1.1\r\nHost: ctx\r\nConnection: close\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(request), request)
                )
                idle.close()  # the idle connections end: ctx has descriptors again
                reply = b""
                with trio.fail_after(30):
                    while not _whole(reply):
                        reply += await waiting.receive_some()
                await waiting.aclose()
            finally:
                resource.prlimit(pid, limit, (soft, hard))
        assert ctx.alive()
        lines = ctx.log().splitlines()
        said = [i for i, line in enumerate(lines) if emfile in line][seen:]
        assert said and all(  # one line a second at most, no traceback after it
            not lines[i + 1].startswith("Traceback") for i in said if i + 1 < len(lines)
        ), lines[said[0] : said[0] + 3]
        head, _, content = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), reply[:300]
        answer = json.loads(content)
        r = await client.post(gen.url + "/v1/completions", json=gen_body(answer, body))
        assert r.status_code == 200, r.text
        key = str(answer["choices"][0]["disaggregated_params"]["transfer_key"])
        assert (await digests(client, ctx))[key] == (await digests(client, gen))[key]
        await assert_exact_transfer(client, ctx, gen, rng)


def _whole(reply: bytes) -> bool:
    """Whether `reply` holds an HTTP response's head and all the body its Content-Length says."""
    head, sep, body = reply.partition(b"\r\n\r\n")
    if not sep:
        return False
    lengths = re.findall(rb"(?im)^content-length:\s*(\d+)\s*$", head)
    return bool(lengths) and len(body) >= int(lengths[0])
