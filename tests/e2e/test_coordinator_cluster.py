"""The coordinator as a real process in front of real workers (tiny model, NIXL transceiver).

Workers (2 ctx + 1 gen) are shared by the module; each test starts its own coordinator. Tests
that send a request through ctx → gen need the workers' KV transceiver; tests that only use
conditional disaggregation (gen alone), bad input or the fleet machinery do not.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.instances import running_instances
from tests.monitoring_pack import unknown_reads
from tests.procs import REPO, Server, free_port, metric, spawn

pytestmark = pytest.mark.timeout(300)

WORKER = {"cache_transceiver_config": {"backend": "NIXL", "nixl_progress_thread": False}}


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[Server]]]:
    # Started together: their start-ups overlap instead of queueing.
    specs = {"ctx-0": ("ctx", WORKER), "ctx-1": ("ctx", WORKER), "gen-0": ("gen", WORKER)}
    with running_instances(tmp_path_factory.mktemp("workers"), specs) as servers:
        yield {"ctx": [servers["ctx-0"], servers["ctx-1"]], "gen": [servers["gen-0"]]}


@contextlib.contextmanager
def coordinator(
    tmp_path: Path, workers: dict[str, list[Server]], *, ctx: int = 1, **config: Any
) -> Iterator[Server]:
    port = free_port()
    data = {
        "hostname": "127.0.0.1",
        "port": port,
        "context_servers": {"urls": [s.url for s in workers["ctx"][:ctx]]},
        "generation_servers": {"urls": [s.url for s in workers["gen"]]},
        "health_check_interval": 0.2,
        "server_start_timeout": 60,
        "request_timeout": 60,
        **config,
    }
    path = tmp_path / "disagg.yaml"
    path.write_text(yaml.safe_dump(data))
    with spawn(
        ["coordinator", "--config", str(path)], port=port, log_path=tmp_path / "coordinator.log"
    ) as server:
        yield server


def counts(server: Server, role: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return metric(text, "trtdisagg_requests_total", f'role="{role}",status="ok"')


def running(server: Server) -> float:
    return metric(httpx.get(server.url + "/metrics").text, "trtdisagg_requests_running")


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        time.sleep(0.02)  # polling an observable condition, bounded above


def aggregated(gen: Server, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(gen.url + "/v1/completions", json={**body, "stream": False}, timeout=120)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def body(prompt: str | list[int], max_tokens: int = 12, **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **kw}  # fmt: skip


@pytest.fixture(scope="module")
def shared_coordinator(
    tmp_path_factory: pytest.TempPathFactory, workers: dict[str, list[Server]]
) -> Iterator[Server]:
    """The default coordinator over ctx-0 and gen-0, for the tests that only send it requests
    and leave it idle (one start instead of one per test)."""
    with coordinator(tmp_path_factory.mktemp("coordinator"), workers) as server:
        yield server


@pytest.fixture(scope="module")
def two_ctx_coordinator(
    tmp_path_factory: pytest.TempPathFactory, workers: dict[str, list[Server]]
) -> Iterator[Server]:
    with coordinator(tmp_path_factory.mktemp("coordinator2"), workers, ctx=2) as server:
        yield server


# ---- without the KV transceiver ----


def test_conditional_disagg_short_prompt_is_served_by_gen_alone(
    tmp_path: Path, workers: dict[str, list[Server]]
) -> None:
    ctx, gen = workers["ctx"][0], workers["gen"][0]
    with coordinator(
        tmp_path, workers, conditional_disagg_config={"max_local_prefill_length": 64}
    ) as coord:
        ctx_before, gen_before = counts(ctx, "ctx"), counts(gen, "gen")
        request = body("The quick brown fox")
        r = httpx.post(coord.url + "/v1/completions", json=request, timeout=60)
        assert r.status_code == 200, r.text
        assert (
            r.json()["choices"][0]["token_ids"]
            == aggregated(gen, request)["choices"][0]["token_ids"]
        )
        assert counts(ctx, "ctx") == ctx_before
        assert counts(gen, "gen") == gen_before + 2  # ours and the aggregated reference
        metrics = httpx.get(coord.url + "/metrics").text
        assert metric(metrics, "trtdisagg_coordinator_local_prefill_total") == 1


def test_bad_input_is_400_naming_the_field(
    workers: dict[str, list[Server]], shared_coordinator: Server
) -> None:
    for bad, field in (
        ({"prompt": "x", "max_tokens": "4"}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": "x", "n": 129}, "n"),
    ):
        r = httpx.post(shared_coordinator.url + "/v1/completions", json=bad)
        assert r.status_code == 400, (bad, r.text)
        assert field in r.json()["error"]["message"] and r.json()["error"]["param"] == field
    r = httpx.post(shared_coordinator.url + "/v1/chat/completions", json={"messages": "hi"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert httpx.get(shared_coordinator.url + "/v1/models").json()["data"][0]["id"] == "tiny"


def test_fleet_of_two_shares_one_port_and_each_front_end_places_requests(
    tmp_path: Path, workers: dict[str, list[Server]]
) -> None:
    gen = workers["gen"][0]
    with coordinator(
        tmp_path, workers, num_workers=2,
        generation_servers={"urls": [gen.url], "router": {"type": "load_balancing"}},
        conditional_disagg_config={"max_local_prefill_length": 64},
    ) as coord:  # fmt: skip
        pids: set[int] = set()
        deadline = time.monotonic() + 30
        while len(pids) < 2 and time.monotonic() < deadline:
            with httpx.Client() as fresh:  # a new connection: the kernel picks a front end
                r = fresh.get(coord.url + "/health")
                if r.status_code == 200:
                    pids.add(r.json()["pid"])
        assert len(pids) == 2, "both front ends should answer on the shared port"
        served = counts(gen, "gen")
        for i in range(8):  # gen alone: each front end checks gen and places requests itself
            with httpx.Client() as fresh:
                r = fresh.post(coord.url + "/v1/completions", json=body(f"hello {i}"), timeout=60)
            assert r.status_code == 200, r.text
        assert counts(gen, "gen") == served + 8
        info = httpx.get(coord.url + "/cluster_info").json()
        assert info["server_lists"]["generation"] == [gen.url]

        def fleet_metric(name: str) -> float:
            with httpx.Client() as fresh:  # whichever front end takes this connection
                text = fresh.get(coord.url + "/metrics").text
            ok = 'role="coordinator",status="ok"'
            return metric(text, name, ok if name == "trtdisagg_requests_total" else "")

        # The 8 requests spread over both front ends; each scrape shows the fleet's totals.
        wait_until(lambda: fleet_metric("trtdisagg_requests_total") == 8, 5.0, "8 counted")
        for _ in range(6):
            assert fleet_metric("trtdisagg_requests_total") == 8
            assert fleet_metric("trtdisagg_coordinator_local_prefill_total") == 8


def _front_ends(supervisor: int) -> list[int]:
    """The fleet's front-end processes: `supervisor`'s spawned children (not its resource
    tracker)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
            if int(fields[1]) == supervisor and b"spawn_main" in cmdline:
                found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    """Not exited: zombies (nobody may reap an orphan here) count as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_killed_fleet_supervisor_takes_its_front_ends_along(
    tmp_path: Path, workers: dict[str, list[Server]]
) -> None:
    """A SIGKILLed supervisor cannot stop its front ends: each sees that it is gone and exits, so
    none is left serving the port (a new fleet there would share it with them, old settings and
    all)."""
    with coordinator(tmp_path, workers, num_workers=2) as coord:
        fronts = _front_ends(coord.proc.pid)
        assert len(fronts) == 2, fronts
        try:
            coord.proc.kill()
            coord.proc.wait(10)
            wait_until(lambda: not any(_running(pid) for pid in fronts), 10, "front ends gone")
        finally:
            for pid in fronts:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with pytest.raises(httpx.ConnectError):
            httpx.get(coord.url + "/health", timeout=2)
        assert "its parent process" in coord.log() and "is gone; exiting" in coord.log()


def test_front_ends_whose_supervisor_dies_while_they_start_exit_too(
    tmp_path: Path, workers: dict[str, list[Server]]
) -> None:
    """The supervisor SIGKILLed as soon as it has spawned its front ends, while they still
    import: they learn its pid from it (by the time one could ask getppid(), init is its
    parent), so they exit once up instead of serving the port for good."""
    port = free_port()
    path = tmp_path / "disagg.yaml"
    path.write_text(yaml.safe_dump({
        "hostname": "127.0.0.1", "port": port, "num_workers": 2,
        "context_servers": {"urls": [workers["ctx"][0].url]},
        "generation_servers": {"urls": [s.url for s in workers["gen"]]},
    }))  # fmt: skip
    with open(tmp_path / "coordinator.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trtdisagg", "coordinator", "--config", str(path)],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
    fronts: list[int] = []
    try:
        wait_until(lambda: len(_front_ends(proc.pid)) == 2, 30, "front ends spawned")
        fronts = _front_ends(proc.pid)
        proc.kill()
        proc.wait(10)
        wait_until(lambda: not any(_running(pid) for pid in fronts), 30, "front ends gone")
    finally:
        proc.kill()
        proc.wait(10)
        for pid in fronts:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# ---- through ctx → gen: these need the KV transceiver in the workers ----


def test_openai_client_through_ctx_and_gen_equals_aggregated(
    workers: dict[str, list[Server]], shared_coordinator: Server
) -> None:
    gen = workers["gen"][0]
    api = openai.OpenAI(base_url=shared_coordinator.url + "/v1", api_key="unused", max_retries=0)
    prompt = "Once upon a time there was a little robot who"
    reference = aggregated(gen, body(prompt, 24))
    done = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    assert done.choices[0].text == reference["choices"][0]["text"]
    assert done.usage is not None
    assert done.usage.prompt_tokens == reference["usage"]["prompt_tokens"]
    assert done.usage.completion_tokens == reference["usage"]["completion_tokens"]
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    stream = api.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == done.usage.prompt_tokens
    chat = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage is not None
    raw = httpx.post(
        shared_coordinator.url + "/v1/completions", json=body(prompt), timeout=60
    ).json()
    assert "disaggregated_params" not in raw["choices"][0]


def close_wait(port: int) -> int:
    """Server-side TCP connections on `port` whose client has closed and the server not yet
    (state CLOSE_WAIT in /proc/net/tcp*)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                count += int(local.rsplit(":", 1)[1], 16) == port and state == "08"
    return count


def test_a_connection_its_client_closes_is_closed_at_once(
    workers: dict[str, list[Server]], shared_coordinator: Server
) -> None:
    """A client that connects and leaves, before a request or after one, costs the coordinator
    and a worker no descriptor beyond that moment (hypercorn alone would hold each for its
    75 s keep-alive: a client opening a connection per request ran a server out of them)."""
    for server in (shared_coordinator, workers["ctx"][0]):
        host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
        for _ in range(10):
            socket.create_connection((host, port)).close()
        for _ in range(10):
            with httpx.Client() as client:  # one connection, closed after its request
                assert client.get(server.url + "/health").status_code == 200
        wait_until(lambda port=port: close_wait(port) == 0, 5, f"{server.url}'s sockets closed")


def test_an_answer_with_connection_close_ends_the_connection(
    workers: dict[str, list[Server]], shared_coordinator: Server
) -> None:
    """A client that asks for `Connection: close` and reads to the end of the stream gets it
    right after the answer, from the coordinator and from a worker."""
    for server in (shared_coordinator, workers["ctx"][0]):
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := sock.recv(65536):  # until the server closes (or the 10 s timeout)
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


def test_the_monitoring_pack_reads_only_what_the_processes_export(
    workers: dict[str, list[Server]], shared_coordinator: Server
) -> None:
    """deploy/monitoring/'s alerts and dashboard panels read metrics and labels that a real
    coordinator, ctx and gen export after serving a request each way: a renamed metric or label
    would leave an alert that never fires, or an empty panel."""
    for stream in (False, True):
        r = httpx.post(shared_coordinator.url + "/v1/completions",
                       json=body("Watch this", 6, stream=stream), timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
    servers = [shared_coordinator, workers["ctx"][0], workers["gen"][0]]
    texts = [httpx.get(server.url + "/metrics", timeout=10).text for server in servers]
    assert unknown_reads(texts) == []


def test_32_concurrent_requests_equal_aggregated(
    workers: dict[str, list[Server]], two_ctx_coordinator: Server
) -> None:
    gen = workers["gen"][0]
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
    bodies = [body(" ".join(words[(i * 3) % 13 :] + words[: i % 7]), 4 + i % 9) for i in range(32)]
    expected = [aggregated(gen, b)["choices"][0]["token_ids"] for b in bodies]
    results: list[Any] = [None] * 32

    def one(i: int) -> None:
        r = httpx.post(two_ctx_coordinator.url + "/v1/completions", json=bodies[i], timeout=120)
        results[i] = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert results == expected


def test_first_chunk_arrives_while_gen_is_still_generating(
    workers: dict[str, list[Server]], shared_coordinator: Server
) -> None:
    gen = workers["gen"][0]
    request = body("Once upon a time", 400, stream=True, ignore_eos=True)
    with httpx.stream(
        "POST", shared_coordinator.url + "/v1/completions", json=request, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                assert running(gen) == 1  # gen has not finished: the chunk was not buffered
                break
        for _ in lines:
            pass


def test_usage_prompt_and_cached_from_ctx_completion_from_gen(
    workers: dict[str, list[Server]], shared_coordinator: Server
) -> None:
    prompt = "The context server sends the cache to the generation server over a fast network"
    first = httpx.post(
        shared_coordinator.url + "/v1/completions", json=body(prompt, 5), timeout=60
    ).json()
    again = httpx.post(
        shared_coordinator.url + "/v1/completions", json=body(prompt, 5), timeout=60
    ).json()
    n = len(first["prompt_token_ids"])
    assert first["usage"]["prompt_tokens"] == n and first["usage"]["completion_tokens"] == 5
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # ctx's prefix cache
    request = body(prompt, 5, stream=True, stream_options={"include_usage": True})
    with httpx.stream(
        "POST", shared_coordinator.url + "/v1/completions", json=request, timeout=60
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    assert events[-1]["usage"]["completion_tokens"] == 5
    assert events[-1]["usage"]["prompt_tokens"] == n
    cached = again["usage"]["prompt_tokens_details"]
    assert events[-1]["usage"]["prompt_tokens_details"] == cached  # ctx's, streamed too


def test_kv_cache_aware_routes_a_shared_prefix_to_the_same_ctx(
    tmp_path: Path, workers: dict[str, list[Server]]
) -> None:
    ctxs = workers["ctx"]
    with coordinator(
        tmp_path, workers, ctx=2,
        context_servers={"urls": [s.url for s in ctxs], "router": {"type": "kv_cache_aware"}},
    ) as coord:  # fmt: skip
        for p in range(4):
            prefix = [100 + p * 50 + i for i in range(48)]  # three 16-token blocks
            before = [counts(s, "ctx") for s in ctxs]
            r = httpx.post(coord.url + "/v1/completions", json=body(prefix, 2), timeout=60)
            assert r.status_code == 200, r.text
            home = next(i for i, s in enumerate(ctxs) if counts(s, "ctx") > before[i])
            for tail in ([1, 2, 3], [4, 5, 6, 7, 8]):
                before = [counts(s, "ctx") for s in ctxs]
                r = httpx.post(
                    coord.url + "/v1/completions", json=body(prefix + tail, 2), timeout=60
                )
                assert r.status_code == 200, r.text
                assert counts(ctxs[home], "ctx") == before[home] + 1


def test_round_robin_alternates_ctx_servers(
    workers: dict[str, list[Server]], two_ctx_coordinator: Server
) -> None:
    ctxs = workers["ctx"]
    served = []
    for i in range(4):
        before = [counts(s, "ctx") for s in ctxs]
        r = httpx.post(
            two_ctx_coordinator.url + "/v1/completions", json=body(f"hello {i}", 3), timeout=60
        )
        assert r.status_code == 200, r.text
        served.append(next(j for j, s in enumerate(ctxs) if counts(s, "ctx") > before[j]))
    assert served in ([0, 1, 0, 1], [1, 0, 1, 0])


def test_client_disconnect_mid_stream_frees_gen_within_a_second(
    workers: dict[str, list[Server]], shared_coordinator: Server
) -> None:
    gen = workers["gen"][0]
    request = body("Once upon a time", 2000, stream=True, ignore_eos=True)
    with httpx.stream(
        "POST", shared_coordinator.url + "/v1/completions", json=request, timeout=60
    ) as r:
        # Hold the iterator: a dropped one closes the connection and would hang up early. The
        # first token may be ctx's (the lead), sent before gen has the request: wait for two.
        lines = r.iter_lines()
        tokens = 0
        for line in lines:
            tokens += line.startswith("data: {")
            if tokens == 2:
                break
        assert running(gen) == 1
    wait_until(lambda: running(gen) == 0, 1.0, "gen running 0")


def held(server: Server) -> float:
    """KV blocks held by a request or a transfer (neither free nor kept by the prefix cache)."""
    text = httpx.get(server.url + "/metrics").text
    return (
        metric(text, "trtdisagg_kv_cache_total_blocks")
        - metric(text, "trtdisagg_kv_cache_free_blocks")
        - metric(text, "trtdisagg_kv_cache_reusable_blocks")
    )


def test_generation_first_equals_aggregated_and_frees_gen_when_ctx_finishes(
    tmp_path: Path, workers: dict[str, list[Server]]
) -> None:
    ctx, gen = workers["ctx"][0], workers["gen"][0]
    words = "a small model answers every prompt the same way twice in a row".split()
    bodies = [body(" ".join(words[i % 5 :] + words[: i % 4]), 3 + i % 7) for i in range(12)]
    expected = [aggregated(gen, b)["choices"][0]["token_ids"] for b in bodies]
    with coordinator(tmp_path, workers, schedule_style="generation_first") as coord:
        results: list[Any] = [None] * len(bodies)

        def one(i: int) -> None:
            r = httpx.post(coord.url + "/v1/completions", json=bodies[i], timeout=120)
            results[i] = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        assert results == expected  # each gen leg had only the first token the KV brought
        api = openai.OpenAI(base_url=coord.url + "/v1", api_key="unused", max_retries=0)
        prompt = "Once upon a time there was a little robot who"
        reference = aggregated(gen, body(prompt, 16))
        stream = api.completions.create(
            model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        assert (
            "".join(c.choices[0].text for c in chunks if c.choices)
            == reference["choices"][0]["text"]
        )
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.prompt_tokens == reference["usage"]["prompt_tokens"]
        chat = api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=6, temperature=0
        )
        assert chat.choices[0].message.content and chat.usage is not None
        # ctx finishes the request itself (max_tokens 1): gen's leg, already waiting for KV
        # that never comes, is cancelled and its blocks return at once, not at the timeout.
        gen_ok = counts(gen, "gen")
        r = httpx.post(coord.url + "/v1/completions", json=body(prompt, 1), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"][:1]
        wait_until(lambda: held(gen) == 0 and running(gen) == 0, 5.0, "gen idle")
        wait_until(lambda: held(ctx) == 0, 5.0, "ctx idle")
        assert counts(gen, "gen") == gen_ok  # the cancelled leg is not an ok gen request
