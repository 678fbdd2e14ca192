"""`api_server_count`: the worker's HTTP API in front processes, the engine in its own.

One module-scoped set of servers: an aggregated `tiny` worker with 2 fronts, a ctx/gen pair with
1 front each behind a coordinator, and the session's shared cluster, whose ctx worker serves in
one process (`api_server_count: 0`) and is the reference for greedy tokens. Which process holds
a connection is read from /proc (each front's open sockets), not from anything the API shows.
The lifecycle tests come last and end the module's own workers: a front of the aggregated worker
is killed, the pair's ctx is stopped (starting workers of their own would cost two more starts).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from tests.edges import Cluster, running_cluster, wait_idle, wait_until
from tests.openai_cluster import CHAT, LOGPROB_TOLERANCE, PROMPTS, by_choice, sse
from tests.procs import Server, children, cpus_of_threads, metric, running_worker

pytestmark = pytest.mark.slow

IDS = {"return_token_ids": True}
# The aggregated worker's engine is pinned here (`cpu_affinity`); its fronts take the CPUs left.
AVAILABLE = frozenset(os.sched_getaffinity(0))
ENGINE_CPU = max(AVAILABLE)


@attrs.frozen
class Servers:
    fronts: Server  # aggregated, api_server_count: 2
    pair: Cluster  # ctx and gen with api_server_count: 1, and a coordinator
    reference: Server  # api_server_count: 0


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, shared_cluster: tuple[Cluster, httpx.Client]
) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("api_servers")
    with (
        running_worker(tmp, api_server_count=2, cpu_affinity=[ENGINE_CPU]) as fronts,
        running_cluster(tmp, worker={"api_server_count": 1}) as pair,
    ):
        yield Servers(fronts=fronts, pair=pair, reference=shared_cluster[0].ctx)


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60, trust_env=False) as client:
        yield client


# ---- processes and their sockets, from /proc ----


def sockets_of(pid: int) -> set[str]:
    """The sockets process `pid` holds open (their inodes): a set, so that sockets closed
    meanwhile (an earlier test's keep-alive connections) do not hide new ones."""
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            found.add(target)
    return found


def fronts_of(server: Server) -> list[int]:
    """The worker's front processes: its children that multiprocessing spawned to run code
    (its resource tracker is a child too)."""
    return [
        pid
        for pid in children(server.proc.pid)
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# ---- answers, stripped of what differs between two servers ----


def completion(http: httpx.Client, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(url + path, json=body)
    assert r.status_code == 200, r.text
    answer = dict(r.json())
    for volatile in ("id", "created"):
        answer.pop(volatile)
    return answer


def streamed(http: httpx.Client, url: str, path: str, body: dict[str, Any]) -> dict[int, Any]:
    """Each choice's text, token ids, logprobs and finish reason, joined over its chunks."""
    events = sse(http, url + path, {**body, "stream": True})
    assert events[-1] == "[DONE]"
    joined: dict[int, Any] = {}
    for index, chunks in by_choice(events).items():
        text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in chunks)
        ids = [t for c in chunks for t in c.get("token_ids") or []]
        # How many tokens a chunk carries depends on timing (a reader that falls behind gets
        # them joined): the logprobs are compared joined too.
        logprobs: dict[str, list[Any]] = {}
        for chunk in chunks:
            for key, values in (chunk.get("logprobs") or {}).items():
                logprobs.setdefault(key, []).extend(values or [])
        joined[index] = (text, ids, chunks[-1]["finish_reason"], logprobs)
    return joined


def assert_same(got: Any, want: Any) -> None:
    """Equal, floats within the logprob tolerance (the two engines batch differently)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=LOGPROB_TOLERANCE)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), (got, want)
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), (got, want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    else:
        assert got == want


BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, **IDS}),
    ("/v1/completions", {"prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "n": 2, **IDS}),
    ("/v1/completions",
     {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "logprobs": 3, "echo": True}),
    ("/v1/chat/completions",
     {"messages": CHAT, "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "temperature": 0, "n": 2}),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body"), BODIES)
def test_answers_equal_a_one_process_worker_s(
    servers: Servers, http: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    assert_same(
        completion(http, servers.fronts.url, path, body),
        completion(http, servers.reference.url, path, body),
    )
    assert_same(
        streamed(http, servers.fronts.url, path, body),
        streamed(http, servers.reference.url, path, body),
    )


def test_concurrent_streams_spread_over_both_fronts(servers: Servers) -> None:
    """Many streams at once all succeed, each is served by a front, and each front serves some
    (the front that holds a stream's connection is found from /proc at its first chunk: a
    finished stream's idle connection may be closed by the time the last one starts)."""
    server = servers.fronts
    fronts = fronts_of(server)
    assert len(fronts) == 2, fronts
    count, tokens = 16, 24
    body = {"prompt": PROMPTS[2], "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, **IDS}  # fmt: skip
    first_chunks = threading.Barrier(count, timeout=60)

    def stream() -> tuple[int, int | None]:
        """The tokens of one stream and the front that served it; after its first chunk it
        waits until all have one."""
        received, front = 0, None
        with (
            httpx.Client(timeout=60, trust_env=False) as client,
            client.stream("POST", server.url + "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            local_port = r.extensions["network_stream"].get_extra_info("client_addr")[1]
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    if received == 0:
                        front = holder(fronts, local_port)
                        first_chunks.wait()
                    received += sum(len(c.get("token_ids") or []) for c in
                                    json.loads(line[6:])["choices"])  # fmt: skip
        return received, front

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        results = [r.result(60) for r in [pool.submit(stream) for _ in range(count)]]
    assert [received for received, _ in results] == [tokens] * count
    served = [front for _, front in results]
    assert all(front in fronts for front in served), served  # each by a front
    assert set(served) == set(fronts), served  # and each front serves some of them


def test_every_front_names_the_worker_s_one_boot_in_health(servers: Servers) -> None:
    """A coordinator tells a restart from the boot id in /health, so a worker's fronts all name
    the same one, whichever takes the connection (new connections spread over both)."""
    boots, pids = set(), set()
    fronts = fronts_of(servers.fronts)
    for _ in range(24):
        with httpx.Client(timeout=10, trust_env=False) as fresh:
            with fresh.stream("GET", servers.fronts.url + "/health") as r:
                local_port = r.extensions["network_stream"].get_extra_info("client_addr")[1]
                pids.add(holder(fronts, local_port))
                r.read()
            assert r.status_code == 200
            boots.add(r.json()["boot_id"])
    assert pids == set(fronts), pids  # both fronts answered
    assert len(boots) == 1 and len(boots.pop()) == 16


def test_a_front_process_loads_no_torch(servers: Servers) -> None:
    """A front tokenizes, validates, compiles grammars and relays: after answers with logprobs
    and a JSON grammar it has mapped no torch library, which would add seconds to each front's
    start and hundreds of MiB to its memory. The engine's process has (what the check sees)."""
    body = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "response_format": {"type": "json_object"}}  # fmt: skip
    for _ in range(4):  # new connections: both fronts serve some
        with httpx.Client(timeout=60, trust_env=False) as fresh:
            r = fresh.post(servers.fronts.url + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
    fronts = fronts_of(servers.fronts)
    assert len(fronts) == 2, fronts
    for pid in fronts:
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), pid
    assert "libtorch" in Path(f"/proc/{servers.fronts.proc.pid}/maps").read_text()


def test_the_engine_runs_on_its_cpu_affinity_and_its_fronts_on_the_cpus_left(
    servers: Servers, http: httpx.Client
) -> None:
    """Every thread of the engine's process, the step thread among them (started when it
    first steps, after the pinning), runs on the CPU listed; the fronts' threads do not."""
    r = http.post(servers.fronts.url + "/v1/completions",
                  json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    engine = cpus_of_threads(servers.fronts.proc.pid)
    assert len(engine) > 3, engine  # the loop, the step thread, torch's and ZMQ's threads
    assert set(engine.values()) == {(ENGINE_CPU,)}, engine
    left = tuple(sorted(AVAILABLE - {ENGINE_CPU})) or (ENGINE_CPU,)
    for pid in fronts_of(servers.fronts):
        assert set(cpus_of_threads(pid).values()) == {left}, pid


def holder(pids: list[int], client_port: int) -> int | None:
    """Which of `pids` holds the server side of the TCP connection from `client_port`."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pids[0]}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == client_port:  # its remote end
                inodes.add(f"socket:[{fields[9]}]")
    return next((pid for pid in pids if sockets_of(pid) & inodes), None)


def test_metrics_show_the_engine_s_and_each_name_once(servers: Servers, http: httpx.Client) -> None:
    def families(url: str) -> list[str]:
        """Its metric families; not the `_created` ones, which come with a first sample."""
        text = http.get(url + "/metrics").text
        names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
        return [name for name in names if not name.endswith("_created")]

    # A worker with a transceiver, one process and with a front: the same names, each once,
    # plus the front's own event-loop lag.
    one_process = families(servers.reference.url)
    with_front = families(servers.pair.ctx.url)
    assert len(with_front) == len(set(with_front)), with_front
    assert set(with_front) == set(one_process) | {"trtdisagg_api_server_event_loop_lag_seconds"}
    text = http.get(servers.fronts.url + "/metrics").text
    total = metric(text, "trtdisagg_kv_cache_total_blocks")
    assert total > 0 and metric(text, "trtdisagg_kv_cache_free_blocks") > 0
    assert metric(text, "trtdisagg_requests_total", 'role="ctx",status="ok"') > 0


@pytest.mark.parametrize("layout", ["fronts", "reference"])
def test_kv_event_readers_with_cursors_each_read_every_event(
    servers: Servers, http: httpx.Client, layout: str
) -> None:
    """`POST /kv_cache_events {"after": id}` reads the events after a reader's own cursor; a
    drain (no body) in between takes nothing from it. Through fronts and in one process."""
    server = servers.fronts if layout == "fronts" else servers.reference
    url = server.url + "/kv_cache_events"

    def read(after: int) -> list[dict[str, Any]]:
        r = http.post(url, json={"after": after})
        assert r.status_code == 200, r.text
        events: list[dict[str, Any]] = r.json()
        return events

    kept = read(-1)
    cursor = kept[-1]["event_id"] if kept else -1
    prompt = f"{layout}: " + " ".join(f"word{i}" for i in range(160))  # several full blocks
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    assert http.post(server.url + "/v1/completions", json=body).status_code == 200
    first, again = read(cursor), read(cursor)
    assert first and first == again and first[0]["event_id"] == cursor + 1
    assert any(event["kind"] == "stored" for event in first)
    assert http.post(url).status_code == 200  # a drain
    assert read(cursor) == first
    assert read(first[-1]["event_id"]) == []
    for bad in ({"after": -2}, {"after": "1"}, {"since": 1}):
        r = http.post(url, json=bad)
        assert r.status_code == 400 and "after" in r.json()["error"]["message"], r.text


def test_a_client_that_leaves_mid_stream_frees_its_blocks(
    servers: Servers, http: httpx.Client
) -> None:
    server = servers.fronts
    wait_idle(http, server)

    def aborted() -> float:
        text = http.get(server.url + "/metrics").text
        return metric(text, "trtdisagg_requests_total", 'role="ctx",status="aborted"')

    before = aborted()
    body = {"prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with http.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        running = metric(http.get(server.url + "/metrics").text, "trtdisagg_requests_running")
        assert running == 1
    # The connection is closed: its front aborts the request, the engine frees its blocks.
    wait_until(lambda: aborted() == before + 1, 30, "the request aborted")
    wait_idle(http, server)


def test_a_pair_with_fronts_gives_the_aggregated_tokens(
    servers: Servers, http: httpx.Client
) -> None:
    coordinator = servers.pair.coordinator
    assert coordinator is not None
    body = {"prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "n": 2, **IDS}  # fmt: skip
    want = completion(http, servers.reference.url, "/v1/completions", body)
    got = completion(http, coordinator.url, "/v1/completions", body)
    assert [c["token_ids"] for c in got["choices"]] == [c["token_ids"] for c in want["choices"]]
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    stream = streamed(http, coordinator.url, "/v1/completions", body)
    assert [stream[i][1] for i in (0, 1)] == [c["token_ids"] for c in want["choices"]]
    for worker in servers.pair.workers:
        wait_idle(http, worker)


# ---- lifecycle: the module's workers, ended (these tests stay last) ----


def test_a_killed_front_stops_the_worker_and_leaves_no_orphan(servers: Servers) -> None:
    server = servers.fronts
    fronts = fronts_of(server)
    assert len(fronts) == 2, fronts
    os.kill(fronts[0], signal.SIGKILL)
    server.proc.wait(30)
    assert server.proc.returncode == 1
    wait_until(lambda: not any(alive(pid) for pid in fronts), 15, "every front gone")
    assert "api server 0" in server.log() or "api server 1" in server.log()


def test_stopping_the_worker_stops_its_fronts(servers: Servers) -> None:
    """A second SIGTERM while it stops (a script or supervisor that signals again) is no kill:
    the worker finishes stopping and exits 0."""
    server = servers.pair.ctx
    fronts = fronts_of(server)
    assert len(fronts) == 1, fronts
    server.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "received SIGTERM, stopping" in server.log(), 15, "the stop begun")
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(30)
    assert server.proc.returncode == 0, server.log()[-3000:]
    wait_until(lambda: not alive(fronts[0]), 15, "the front gone")
