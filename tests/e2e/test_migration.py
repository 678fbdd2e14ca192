"""Streams that survive a dead or stalled gen: deadlines per phase and stream migration, with real
processes (one ctx, two gens over NIXL, the tiny model, a coordinator), shared by the module.

Every disturbed run is compared with an undisturbed greedy run of the same requests through the
same coordinator: token for token (the streamed ids) and character for character (the streamed
text), so a token duplicated or lost at a cut, or text held back and dropped there, fails.
Tests run in file order: the one that kills a gen comes last.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import pytest
import trio
import yaml

from tests.edges import wait_until
from tests.fault_checks import Processes, held_blocks, processes, wait_all_healthy, wait_metrics
from tests.procs import Server, free_port, metric, stop, wait_healthy

pytestmark = pytest.mark.timeout(300)

INTER_TOKEN_S = 3.0  # the coordinator's inter_token_timeout and gen_first_token_timeout here
# A continuation's first token: a gen reserved, the request posted, prompt + sent prefilled on a
# gen that is decoding other streams, on a loaded 2-core machine.
RETRY_S = 2.5
STALL_S = 10.0
STREAMS = 8
MAX_TOKENS = 320  # long enough that every stream is still decoding when its gen stops
ABORTED = 'role="gen",status="aborted"'


@attrs.define(eq=False)
class Cluster:
    procs: Processes
    ctx: Server
    gens: list[Server]
    coordinator: Server

    def restart_gen(self, index: int) -> None:
        old = self.gens[index]
        if old.alive():
            return
        self.gens[index] = self.procs.start_worker("gen", old.port, timeout_s=10)
        wait_all_healthy(self.gens[index])

    def coordinator_config(self, port: int, **extra: Any) -> dict[str, Any]:
        return {
            "hostname": "127.0.0.1", "port": port,
            "context_servers": {"urls": [self.ctx.url]},
            "generation_servers": {"urls": [g.url for g in self.gens]},
            "health_check_interval": 0.5, "request_timeout": 60, "max_retries": 1,
            "max_migrations": 1, "inter_token_timeout": INTER_TOKEN_S,
            "gen_first_token_timeout": INTER_TOKEN_S, "ctx_first_token_timeout": 10,
            **extra,
        }  # fmt: skip

    def start_coordinator(self, name: str, **extra: Any) -> Server:
        port = free_port()
        path = self.procs.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(self.coordinator_config(port, **extra)))
        server = self.procs.start(["coordinator", "--config", str(path)], port, f"{name}.log")
        wait_healthy(server.url, server.proc, server.log_path, 60)
        return server

    @contextlib.contextmanager
    def other_coordinator(self, name: str, **extra: Any) -> Iterator[Server]:
        """A coordinator of the test's own over the module's workers, stopped after it."""
        server = self.start_coordinator(name, **extra)
        try:
            yield server
        finally:
            self.procs.started.remove(server)
            stop(server.proc)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("migration")
    with processes(tmp) as procs:
        ctx = procs.start_worker("ctx", free_port(), timeout_s=10)
        gens = [procs.start_worker("gen", free_port(), timeout_s=10) for _ in range(2)]
        wait_all_healthy(ctx, *gens)
        cluster = Cluster(procs=procs, ctx=ctx, gens=gens, coordinator=ctx)  # set just below
        cluster.coordinator = cluster.start_coordinator("coordinator")
        yield cluster


@pytest.fixture(scope="module")
def undisturbed(cluster: Cluster) -> list[Streamed]:
    """`body(i)` for i in 0..8, streamed through the coordinator with nothing going wrong (it
    also warms every gen up: first contact with ctx, the coordinator's tokenizer)."""

    async def run() -> list[Streamed]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await run_all(client, cluster.coordinator.url, [body(i) for i in range(9)])

    outs = trio.run(run)
    for out in outs:
        assert out.status == 200 and out.done and len(out.tokens) == MAX_TOKENS, out
    return outs


@attrs.define(eq=False)
class Streamed:
    """What one client saw of its stream."""

    status: int = 0
    tokens: list[int] = attrs.Factory(list)
    text: str = ""
    times: list[float] = attrs.Factory(list)  # when each event with a token arrived
    finishes: list[str] = attrs.Factory(list)
    errors: list[dict[str, Any]] = attrs.Factory(list)
    done: bool = False  # [DONE] came, last

    def largest_gap(self, since: float) -> float:
        times = [since, *self.times]
        return max(b - a for a, b in itertools.pairwise(times))


def body(i: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": f"Story number {i}: once upon a time there was",
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, **extra}  # fmt: skip


async def read_stream(
    client: httpx.AsyncClient, url: str, request: dict[str, Any], out: Streamed
) -> None:
    async with client.stream("POST", url + "/v1/completions", json=request) as r:
        out.status = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            assert not out.done, "an event after [DONE]"
            if line == "data: [DONE]":
                out.done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.errors.append(event["error"])
                continue
            for choice in event["choices"]:
                if choice.get("token_ids"):
                    out.times.append(time.monotonic())
                out.tokens += choice.get("token_ids") or []
                out.text += choice.get("text") or ""
                if choice.get("finish_reason") is not None:
                    out.finishes.append(choice["finish_reason"])


async def run_all(
    client: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]]
) -> list[Streamed]:
    outs = [Streamed() for _ in bodies]
    async with trio.open_nursery() as nursery:
        for request, out in zip(bodies, outs, strict=True):
            nursery.start_soon(read_stream, client, url, request, out)
    return outs


async def wait_tokens(outs: list[Streamed], count: int) -> None:
    """Until every stream has relayed `count` tokens (the clients' own state, polled)."""
    with trio.fail_after(60):
        while any(len(out.tokens) < count for out in outs):  # noqa: ASYNC110
            await trio.sleep(0.01)


def assert_whole(out: Streamed, reference: Streamed) -> None:
    assert out.status == 200 and not out.errors, (out.status, out.errors)
    assert out.done and len(out.finishes) == 1, (out.done, out.finishes)
    assert out.tokens == reference.tokens  # no token duplicated, lost or changed
    assert out.text == reference.text


async def counter(client: httpx.AsyncClient, server: Server, name: str, labels: str) -> float:
    return metric((await client.get(server.url + "/metrics")).text, name, labels)


async def serving_gens(client: httpx.AsyncClient, coordinator: Server) -> list[str]:
    info = (await client.get(coordinator.url + "/cluster_info")).json()
    return list(info["server_lists"]["generation"])


async def wait_idle(client: httpx.AsyncClient, server: Server, timeout: float) -> None:
    await wait_metrics(
        client, server,
        lambda t: metric(t, "trtdisagg_requests_running") == 0 and held_blocks(t) == 0,
        "no request running, every block free", timeout,
    )  # fmt: skip


def test_the_coordinator_loads_the_tokenizer_once_its_servers_are_up(cluster: Cluster) -> None:
    """Before any request: a first migration (several streams resuming at once) then finds it
    loaded, rather than loading it while the streams wait."""
    log = cluster.coordinator.log
    wait_until(lambda: "coordinator tokenizer loaded" in log(), 30, "the tokenizer loaded")


async def test_without_migrations_a_stall_ends_the_stream_with_a_clean_error(
    cluster: Cluster,
) -> None:
    """``max_migrations: 0``: a stream whose gen stalls ends with an OpenAI error event and
    [DONE] at the inter-token deadline, as a failure did before migrations existed."""
    stalled = cluster.gens[0]
    with cluster.other_coordinator(
        "no-migrations", max_migrations=0, inter_token_timeout=1.0,
        generation_servers={"urls": [stalled.url]},
    ) as coordinator:  # fmt: skip
        await _stall_without_migrations(coordinator, stalled)


async def _stall_without_migrations(coordinator: Server, stalled: Server) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        aborted_before = await counter(client, stalled, "trtdisagg_requests_total", ABORTED)
        out = Streamed()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_stream, client, coordinator.url, body(0), out)
            await wait_tokens([out], 10)
            stalled.proc.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
        ended_at = time.monotonic()
        stalled.proc.send_signal(signal.SIGCONT)
        assert out.status == 200 and out.done and out.finishes == []
        (error,) = out.errors
        assert error["code"] == 504 and "inter_token_timeout=1s" in error["message"], error
        assert ended_at - stopped_at < 1.0 + RETRY_S
        assert 10 <= len(out.tokens) < MAX_TOKENS
        await wait_idle(client, stalled, 10)
        aborted = await counter(client, stalled, "trtdisagg_requests_total", ABORTED)
        assert aborted == aborted_before + 1  # the cut leg, aborted when gen woke up


async def test_a_gen_stopped_for_10s_costs_no_stream_more_than_the_deadline_and_one_retry(
    cluster: Cluster, undisturbed: list[Streamed]
) -> None:
    """SIGSTOP one gen for 10 s while 8 streams decode (4 on it): each of its streams is cut at
    the inter-token deadline and resumed on the other gen; no stream, nor a request sent just
    after the stop, waits longer than the deadline plus one retry. The stalled gen leaves the
    coordinator's rotation at once (the deadline, not two failed probes, evicts it), comes back
    after a good health check once it runs again, and frees the blocks of the abandoned
    requests."""
    coordinator, stalled = cluster.coordinator, cluster.gens[0]
    bodies, references = [body(i) for i in range(STREAMS + 1)], undisturbed
    async with httpx.AsyncClient(timeout=60) as client:
        misses = f'phase="inter_token",server="{stalled.url}"'
        misses_before = await counter(
            client, coordinator, "trtdisagg_coordinator_deadline_misses_total", misses
        )
        outs = [Streamed() for _ in bodies]
        async with trio.open_nursery() as nursery:
            for request, out in zip(bodies[:STREAMS], outs, strict=False):
                nursery.start_soon(read_stream, client, coordinator.url, request, out)
            await wait_tokens(outs[:STREAMS], 10)
            text = (await client.get(stalled.url + "/metrics")).text
            running = metric(text, "trtdisagg_requests_running")
            aborted_before = metric(text, "trtdisagg_requests_total", ABORTED)
            assert running > 0
            stalled.proc.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            late = time.monotonic()
            nursery.start_soon(read_stream, client, coordinator.url, bodies[STREAMS], outs[-1])
            with trio.fail_after(INTER_TOKEN_S + RETRY_S):
                while stalled.url in await serving_gens(client, coordinator):  # noqa: ASYNC110
                    await trio.sleep(0.02)
            evicted_at = time.monotonic()
            info = (await client.get(coordinator.url + "/cluster_info")).json()
            (seen,) = [s for s in info["servers"] if s["url"] == stalled.url]
            assert "inter_token_timeout" in seen["last_error"], seen  # not a failed probe
            await trio.sleep(max(0.0, STALL_S - (time.monotonic() - stopped_at)))  # the fault
            stalled.proc.send_signal(signal.SIGCONT)
        print(f"evicted {evicted_at - stopped_at:.2f}s after the stop; gaps "
              f"{[round(o.largest_gap(stopped_at), 2) for o in outs]}")  # fmt: skip
        for out, reference in zip(outs, references, strict=True):
            assert_whole(out, reference)
        for out in outs[:STREAMS]:
            assert out.largest_gap(stopped_at) < INTER_TOKEN_S + RETRY_S
        assert outs[-1].times[0] - late < INTER_TOKEN_S + RETRY_S
        misses_after = await counter(
            client, coordinator, "trtdisagg_coordinator_deadline_misses_total", misses
        )
        assert misses_after > misses_before
        await wait_idle(client, stalled, 10)
        # Aborted when it woke up, not decoded to the end: each cut stream (and the request
        # sent after the stop, if it landed here).
        aborted = await counter(client, stalled, "trtdisagg_requests_total", ABORTED)
        assert running <= aborted - aborted_before <= running + 1, (running, aborted)
        with trio.fail_after(10):
            while stalled.url not in await serving_gens(client, coordinator):  # noqa: ASYNC110
                await trio.sleep(0.05)
        await wait_idle(client, cluster.gens[1], 10)


async def test_a_stream_s_first_token_is_ctx_s_out_before_gen_answers(
    cluster: Cluster, undisturbed: list[Streamed]
) -> None:
    """A stream's first token goes out as soon as ctx answers: with its gen stopped the client
    has that token, and only it; once the gen runs again the stream completes, token for token
    and character for character the undisturbed run."""
    held, reference, out = cluster.gens[0], undisturbed[0], Streamed()
    with cluster.other_coordinator(
        "lead", health_check_interval=3600, gen_first_token_timeout=60,
        generation_servers={"urls": [held.url]},
    ) as coordinator:  # fmt: skip
        async with httpx.AsyncClient(timeout=60) as client:
            held.proc.send_signal(signal.SIGSTOP)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read_stream, client, coordinator.url, body(0), out)
                    await wait_tokens([out], 1)
                    assert out.tokens == reference.tokens[:1]  # ctx's: gen cannot run
                    assert reference.text.startswith(out.text)
                    held.proc.send_signal(signal.SIGCONT)
            finally:
                held.proc.send_signal(signal.SIGCONT)
    assert_whole(out, reference)


async def test_a_first_leg_silent_after_ctx_s_token_went_out_is_resumed_whole(
    cluster: Cluster, undisturbed: list[Streamed]
) -> None:
    """ctx's token went out, then the gen the first leg went to stays silent past
    gen_first_token_timeout: the answer resumes on the other gen from the prompt and that token,
    whole; ctx frees the KV that no gen took, and the silent gen its blocks once it runs."""
    silent, other = cluster.gens
    released = "trtdisagg_kv_sends_released_total"
    with cluster.other_coordinator(  # round robin: its first gen is the first listed
        "lead-resumed", health_check_interval=3600, gen_first_token_timeout=RETRY_S,
        generation_servers={"urls": [silent.url, other.url], "router": {"type": "round_robin"}},
    ) as coordinator:  # fmt: skip
        async with httpx.AsyncClient(timeout=60) as client:
            released_before = await counter(client, cluster.ctx, released, "")
            out = Streamed()
            silent.proc.send_signal(signal.SIGSTOP)
            try:
                await read_stream(client, coordinator.url, body(1), out)
            finally:
                silent.proc.send_signal(signal.SIGCONT)
            assert_whole(out, undisturbed[1])
            name, deadline = "trtdisagg_coordinator_migrations_total", 'reason="deadline"'
            assert await counter(client, coordinator, name, deadline) == 1
            # released by the coordinator, not left to ctx's kv_transfer_timeout
            assert await counter(client, cluster.ctx, released, "") == released_before + 1
            await wait_idle(client, cluster.ctx, 10)
            await wait_idle(client, silent, 10)


async def test_a_whole_answer_of_two_choices_whose_gen_stalls_starts_again_elsewhere(
    cluster: Cluster,
) -> None:
    """Choices are not resumed one by one, but a whole (non-streamed) answer has told the
    client nothing: when its gen stalls mid-answer, the coordinator serves it again from the
    prompt on the other gen, and the client gets the answer an undisturbed run gives (seeded),
    not a 503."""
    stalled = cluster.gens[0]
    request = {**body(2, n=2, temperature=1.0, seed=7), "stream": False}
    async with httpx.AsyncClient(timeout=60) as client:
        reference = await client.post(cluster.coordinator.url + "/v1/completions", json=request)
        assert reference.status_code == 200, reference.text
        with cluster.other_coordinator(  # round robin: its first gen is the first listed
            "whole-retried", health_check_interval=3600, inter_token_timeout=1.0,
            generation_servers={"urls": [g.url for g in cluster.gens],
                                "router": {"type": "round_robin"}},
        ) as coordinator:  # fmt: skip
            answer: list[httpx.Response] = []

            async def ask() -> None:
                answer.append(await client.post(coordinator.url + "/v1/completions", json=request))

            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ask)
                    await wait_metrics(
                        client, stalled,
                        lambda t: metric(t, "trtdisagg_requests_running") == 2,
                        "both choices decoding on the first gen", 30,
                    )  # fmt: skip
                    steps = await counter(client, stalled, "trtdisagg_steps_total", "")
                    await wait_metrics(
                        client, stalled, lambda t: metric(t, "trtdisagg_steps_total") >= steps + 10,
                        "ten more decode steps", 30,
                    )  # fmt: skip
                    stalled.proc.send_signal(signal.SIGSTOP)
            finally:
                stalled.proc.send_signal(signal.SIGCONT)
            (got,) = answer
            assert got.status_code == 200, got.text
            texts = [c["text"] for c in got.json()["choices"]]
            assert texts == [c["text"] for c in reference.json()["choices"]]
            retries = await counter(client, coordinator, "trtdisagg_coordinator_retries_total", "")
            assert retries == 1
        await wait_idle(client, stalled, 10)


async def read_choices(
    client: httpx.AsyncClient, url: str, request: dict[str, Any], outs: list[Streamed]
) -> None:
    """Like `read_stream`, with each choice's tokens, text and finish in `outs[index]`."""
    async with client.stream("POST", url + "/v1/completions", json=request) as r:
        for out in outs:
            out.status = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            assert not outs[0].done, "an event after [DONE]"
            if line == "data: [DONE]":
                for out in outs:
                    out.done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                outs[0].errors.append(event["error"])
                continue
            for choice in event["choices"]:
                out = outs[choice["index"]]
                out.tokens += choice.get("token_ids") or []
                out.text += choice.get("text") or ""
                if choice.get("finish_reason") is not None:
                    out.finishes.append(choice["finish_reason"])


async def test_a_stream_of_two_choices_whose_gen_stalls_goes_on_choice_by_choice(
    cluster: Cluster, undisturbed: list[Streamed]
) -> None:
    """A streamed answer of two choices whose gen stalls mid-answer: each choice goes on from
    its own tokens on a continuation of its own on the other gen, and the client's stream
    completes without an error, each choice token for token and character for character the
    undisturbed greedy run (greedy: both choices are that run)."""
    stalled, reference = cluster.gens[0], undisturbed[3]
    request = body(3, n=2)
    outs = [Streamed(), Streamed()]
    with cluster.other_coordinator(  # round robin: its first gen is the first listed
        "choices-resumed", health_check_interval=3600, inter_token_timeout=1.0,
        generation_servers={"urls": [g.url for g in cluster.gens],
                            "router": {"type": "round_robin"}},
    ) as coordinator:  # fmt: skip
        async with httpx.AsyncClient(timeout=60) as client:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read_choices, client, coordinator.url, request, outs)
                    await wait_tokens(outs, 10)
                    stalled.proc.send_signal(signal.SIGSTOP)
                    cut = [len(out.tokens) for out in outs]
            finally:
                stalled.proc.send_signal(signal.SIGCONT)
            name = "trtdisagg_coordinator_migrations_total"
            assert await counter(client, coordinator, name, 'reason="deadline"') == 2
            await wait_idle(client, stalled, 10)
    assert all(count < MAX_TOKENS for count in cut), cut  # the cut came mid-answer
    for out in outs:
        assert_whole(out, reference)


async def test_each_choice_s_first_token_is_ctx_s_out_before_gen_answers(
    cluster: Cluster, undisturbed: list[Streamed]
) -> None:
    """A stream of two choices starts with ctx's first token of each, with its gen stopped;
    once the gen runs again both choices complete as the undisturbed greedy run."""
    held, reference = cluster.gens[0], undisturbed[4]
    outs = [Streamed(), Streamed()]
    with cluster.other_coordinator(
        "lead-choices", health_check_interval=3600, gen_first_token_timeout=60,
        generation_servers={"urls": [held.url]},
    ) as coordinator:  # fmt: skip
        async with httpx.AsyncClient(timeout=60) as client:
            held.proc.send_signal(signal.SIGSTOP)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read_choices, client, coordinator.url, body(4, n=2), outs)
                    await wait_tokens(outs, 1)
                    assert [out.tokens for out in outs] == [reference.tokens[:1]] * 2
                    held.proc.send_signal(signal.SIGCONT)
            finally:
                held.proc.send_signal(signal.SIGCONT)
    for out in outs:
        assert_whole(out, reference)


async def test_kill_9_of_a_gen_while_8_streams_decode_loses_and_repeats_no_token(
    cluster: Cluster, undisturbed: list[Streamed]
) -> None:
    """kill -9 of one gen while 8 streams decode, 4 of them on it: all 8 finish with HTTP 200,
    their tokens and text equal an undisturbed greedy run, with stop strings found across the
    cut as an undisturbed run finds them."""
    coordinator, victim = cluster.coordinator, cluster.gens[0]
    async with httpx.AsyncClient(timeout=60) as client:
        # One short request per gen first: a gen that was stalled long enough for ctx to forget
        # it meets ctx again with its next request (that one is refused, and resumed).
        await run_all(client, coordinator.url, [body(i, max_tokens=4) for i in range(2)])
        bodies = [body(i) for i in range(STREAMS)]
        references = undisturbed[:STREAMS]
        # Two requests also stop at a string that first shows up late in their text.
        stopping = [STREAMS - 2, STREAMS - 1]
        for i in stopping:
            text = undisturbed[i].text
            start = next(k for k in range(len(text) * 3 // 4, len(text) - 4)
                         if text.find(text[k : k + 4]) == k)  # fmt: skip
            bodies[i] = body(i, stop=[text[start : start + 4]])
        stopped = await run_all(client, coordinator.url, [bodies[i] for i in stopping])
        for i, reference in zip(stopping, stopped, strict=True):
            assert reference.status == 200 and reference.finishes == ["stop"], reference
            assert len(reference.tokens) > 100, i
            references[i] = reference
        migrations_before = await counter(
            client, coordinator, "trtdisagg_coordinator_migrations_total", 'reason="unreachable"'
        )
        outs = [Streamed() for _ in bodies]
        async with trio.open_nursery() as nursery:
            for request, out in zip(bodies, outs, strict=True):
                nursery.start_soon(read_stream, client, coordinator.url, request, out)
            await wait_tokens(outs, 10)
            running = metric((await client.get(victim.url + "/metrics")).text,
                             "trtdisagg_requests_running")  # fmt: skip
            victim.proc.send_signal(signal.SIGKILL)
        for out, reference in zip(outs, references, strict=True):
            assert_whole(out, reference)
        migrations = await counter(
            client, coordinator, "trtdisagg_coordinator_migrations_total", 'reason="unreachable"'
        )
        assert running > 0 and migrations - migrations_before == running, (running, migrations)
        await wait_idle(client, cluster.gens[1], 10)
    victim.proc.wait(10)
