"""HTTP fuzzing of real processes: a ctx and a gen worker (NIXL transceiver) and a coordinator.

Whatever a client sends (any method, path, headers and body; JSON of any shape; OpenAI bodies
whose fields hold wrong types, out-of-range numbers, unknown models or forged disaggregated
params), the answer is a 4xx with an OpenAI error body, or a real answer, never a 5xx, and every
process stays up and keeps serving correctly. Forged `ctx_info_endpoint`s that are well formed (a
closed port, a port that does not speak ZMQ, a ctx that never prefilled the id) end in a clean
502 once the rendezvous or transfer times out, with the worker's blocks all back.

The servers are started once for the module; workers limit the context to 64 tokens, so a
request that asks for a huge `max_tokens` still finishes in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import json
import socket
import string
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.edges import (
    TRANSFER_TIMEOUT_MS,
    Cluster,
    assert_alive,
    completion,
    info_endpoint,
    running_cluster,
    wait_idle,
)
from tests.procs import Server, free_port, metric
from trtdisagg.api.http import is_json_type

pytestmark = pytest.mark.timeout(240)

MAX_SEQ_LEN = 64
MAX_BODY = 64 * 1024
FUZZ = settings(
    max_examples=120,
    deadline=None,
    database=None,  # no .hypothesis/ directory in the repository
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

WORKER_ROUTES = [
    ("GET", "/health"), ("GET", "/version"), ("GET", "/metrics"), ("GET", "/prometheus/metrics"),
    ("GET", "/server_info"), ("POST", "/kv_cache_events"), ("GET", "/debug/kv_digests"),
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models/tiny"), ("POST", "/v1/responses"),
]  # fmt: skip
COORDINATOR_ROUTES = [
    ("GET", "/health"), ("GET", "/cluster_info"), ("GET", "/version"), ("GET", "/v1/models"),
    ("GET", "/metrics"), ("GET", "/prometheus/metrics"), ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"), ("GET", "/v1/models/tiny"), ("POST", "/v1/responses"),
]  # fmt: skip
OPENAI_POSTS = {"/v1/completions", "/v1/chat/completions", "/v1/responses"}
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
# Headers that frame the message itself: setting them by hand makes the client, not the server,
# refuse the request.
FRAMING = {"content-length", "transfer-encoding", "host", "connection", "upgrade", "te", "trailer"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("fuzz_http")
    worker = {"max_seq_len": MAX_SEQ_LEN, "max_request_body_bytes": MAX_BODY}
    coordinator = {"max_request_body_bytes": MAX_BODY, "request_timeout": 30}
    with running_cluster(tmp, worker=worker, coordinator=coordinator) as running:
        yield running


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30, trust_env=False) as http:
        yield http


# ---- strategies ----

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)
EDGE_INTS = st.sampled_from(
    [-(2**63) - 1, -(2**63), -1, 0, 1, 2**31, 2**63 - 1, 2**63, 2**64, 10**30]
)
SMALL_INTS = st.integers(-3, 70)
EDGE_FLOATS = st.sampled_from([0.0, 5e-324, 1e-300, 1e-8, 1e-5, 0.5, 1.0, 99.9, 100.0, 101.0, -0.5])


def _either(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes anything at all."""
    return st.one_of(valid, valid, JSON)


# Well-formed endpoints take a rendezvous timeout each, so the fuzzer only draws malformed ones;
# the well-formed forgeries are the explicit tests below.
BAD_ENDPOINTS = st.sampled_from([
    "", "tcp://", "tcp://foo", "tcp://a b:5", "tcp://*:5", "tcp://127.0.0.1:5;127.0.0.1:6",
    "ipc:///tmp/x", "inproc://x", "tcp://1.2.3.4:99999", "tcp://127.0.0.1:0", "tcp://[zz]:5",
    "tcp://-:5", "tcp://127.0.0.1:-1", "tcp://127.0.0.1:5/x", "udp://127.0.0.1:5",
]) | st.text(max_size=20)  # fmt: skip
DISAGG_PARAMS = st.fixed_dictionaries(
    {},
    optional={
        "request_type": _either(
            st.sampled_from(
                ["context_and_generation", "context_only", "generation_only", "both", ""]
            )
        ),
        "first_gen_tokens": _either(st.lists(EDGE_INTS | SMALL_INTS, max_size=2)),
        "ctx_request_id": _either(EDGE_INTS),
        "disagg_request_id": _either(EDGE_INTS | st.sampled_from([7, 2**40 + 7])),
        "ctx_dp_rank": _either(EDGE_INTS),
        "ctx_info_endpoint": _either(BAD_ENDPOINTS),
        "opaque_state": _either(st.text(max_size=10)),
        "draft_tokens": _either(st.lists(EDGE_INTS, max_size=2)),
    },
)
PROMPTS = (
    st.text(max_size=30)
    | st.lists(st.integers(0, 511), min_size=1, max_size=40)
    | st.lists(EDGE_INTS | SMALL_INTS, max_size=3)
    | st.lists(st.text(max_size=10), max_size=2)
    | st.lists(st.lists(st.integers(0, 511), max_size=5), max_size=2)
)
CONTENT = st.text(max_size=20) | st.lists(
    st.fixed_dictionaries(
        {
            "type": _either(st.sampled_from(["text", "image_url"])),
            "text": _either(st.text(max_size=8)),
        }
    ),
    max_size=2,
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": _either(st.sampled_from(["system", "user", "assistant", "tool", "robot"]))},
        optional={"content": _either(CONTENT), "name": _either(st.text(max_size=5))},
    ),
    max_size=3,
)
SAMPLING = {
    "model": _either(st.sampled_from(["tiny", "gpt-4", ""])),
    "max_tokens": _either(EDGE_INTS | st.integers(1, 4)),
    "temperature": _either(EDGE_FLOATS | EDGE_INTS),
    "top_p": _either(EDGE_FLOATS),
    "top_k": _either(EDGE_INTS | SMALL_INTS),
    "min_tokens": _either(SMALL_INTS | EDGE_INTS),
    "seed": _either(EDGE_INTS),
    "stop": _either(st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2)),
    "stop_token_ids": _either(st.lists(EDGE_INTS | SMALL_INTS, max_size=2)),
    "ignore_eos": _either(st.booleans()),
    "n": _either(st.sampled_from([1, 2, 0, -1])),
    "stream": _either(st.booleans()),
    "stream_options": _either(st.fixed_dictionaries({"include_usage": _either(st.booleans())})),
    "return_token_ids": _either(st.booleans()),
    "return_perf_metrics": _either(st.booleans()),
    "disaggregated_params": _either(DISAGG_PARAMS),
    "conversation_id": _either(st.text(max_size=6)),
    "prompt_token_ids": _either(st.lists(EDGE_INTS | st.integers(0, 511), max_size=4)),
}
COMPLETION_BODIES = st.fixed_dictionaries(
    {"prompt": _either(PROMPTS)},
    optional={
        **SAMPLING,
        "logprobs": _either(EDGE_INTS | SMALL_INTS),
        "echo": _either(st.booleans()),
    },
)
CHAT_BODIES = st.fixed_dictionaries(
    {"messages": _either(MESSAGES)},
    optional={
        **SAMPLING,
        "max_completion_tokens": _either(EDGE_INTS | st.integers(1, 4)),
        "logprobs": _either(st.booleans()),
        "top_logprobs": _either(EDGE_INTS | SMALL_INTS),
        "add_generation_prompt": _either(st.booleans()),
    },
)
RESPONSE_INPUT = st.text(max_size=20) | st.lists(
    st.fixed_dictionaries(
        {"role": _either(st.sampled_from(["user", "assistant", "system", "developer", "tool"]))},
        optional={
            "type": _either(st.sampled_from(["message", "function_call"])),
            "content": _either(CONTENT | st.lists(st.fixed_dictionaries(
                {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                 "text": _either(st.text(max_size=8))}), max_size=2)),
        },
    ),
    max_size=3,
)  # fmt: skip
RESPONSES_BODIES = st.fixed_dictionaries(
    {"input": _either(RESPONSE_INPUT)},
    optional={
        "model": SAMPLING["model"],
        "instructions": _either(st.text(max_size=10)),
        "max_output_tokens": _either(EDGE_INTS | st.integers(1, 4)),
        "temperature": SAMPLING["temperature"],
        "top_p": SAMPLING["top_p"],
        "stream": _either(st.booleans()),
        "store": _either(st.booleans()),
        "tools": _either(st.lists(JSON, max_size=1)),
        "metadata": _either(st.dictionaries(st.text(max_size=4), st.text(max_size=4))),
    },
)
HEADER_NAMES = st.text(alphabet=string.ascii_letters + "-", min_size=1, max_size=16).filter(
    lambda name: name.lower() not in FRAMING
)
HEADERS = st.dictionaries(
    HEADER_NAMES | st.sampled_from(["Content-Type", "Authorization", "Accept", "Expect"]),
    st.text(alphabet=string.printable.strip("\r\n\x0b\x0c") + " ", max_size=40).map(str.strip),
    max_size=4,
)
BODIES = (
    st.binary(max_size=300)
    | JSON.map(json.dumps).map(str.encode)
    | COMPLETION_BODIES.map(json.dumps).map(str.encode)
    | CHAT_BODIES.map(json.dumps).map(str.encode)
    | RESPONSES_BODIES.map(json.dumps).map(str.encode)
)


# ---- checks ----


def _json_object(body: bytes) -> bool:
    try:
        return isinstance(json.loads(body), dict)
    except ValueError:
        return False


def _check(response: httpx.Response, *, method: str) -> None:
    """Never a 5xx; an error is an OpenAI error body naming its own status; a stream ends."""
    status = response.status_code
    event(f"HTTP {status}")  # --hypothesis-show-statistics: how deep the fuzzer got
    assert status < 500, f"{status}: {response.text[:2000]}"
    if status >= 400 and method != "HEAD":
        error = response.json()["error"]
        assert error["code"] == status and error["message"] and error["type"], response.text
    if status == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
        if response.url.path == "/v1/responses":  # a Responses stream ends with its last event
            last = response.text.rstrip("\n").rsplit("\n\n", 1)[-1]
            assert last.split("\n")[0] in END_EVENTS, response.text[-500:]
        else:
            assert response.text.endswith("data: [DONE]\n\n"), response.text[-500:]


END_EVENTS = {f"event: response.{end}" for end in ("completed", "incomplete", "failed")}


def _target(cluster: Cluster, name: str) -> Server:
    server = {"ctx": cluster.ctx, "gen": cluster.gen, "coordinator": cluster.coordinator}[name]
    assert server is not None
    return server


# ---- fuzzing ----


@FUZZ
@given(
    data=st.data(),
    target=st.sampled_from(["ctx", "gen", "coordinator"]),
    headers=HEADERS,
    body=BODIES,
)
def test_anything_on_any_route_is_never_a_5xx(
    cluster: Cluster,
    client: httpx.Client,
    data: st.DataObject,
    target: str,
    headers: dict[str, str],
    body: bytes,
) -> None:
    routes = COORDINATOR_ROUTES if target == "coordinator" else WORKER_ROUTES
    known = st.sampled_from(routes)
    paths = st.text(string.ascii_letters + "/_.%-", max_size=20).map(lambda p: "/" + p)
    method, path = data.draw(known | known | st.tuples(st.sampled_from(METHODS), paths))
    server = _target(cluster, target)
    response = client.request(method, server.url + path, content=body, headers=headers)
    _check(response, method=method)
    if method == "POST" and path in OPENAI_POSTS and not _json_object(body):
        declared = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
        refused = 415 if declared.strip() and not is_json_type(declared) else 400
        assert response.status_code in (400, refused), response.text


@FUZZ
@given(
    target=st.sampled_from(["ctx", "gen", "coordinator"]),
    chat=st.booleans(),
    data=st.data(),
)
def test_hostile_openai_bodies_are_refused_or_served(
    cluster: Cluster, client: httpx.Client, target: str, chat: bool, data: st.DataObject
) -> None:
    body = data.draw(CHAT_BODIES if chat else COMPLETION_BODIES)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = client.post(_target(cluster, target).url + path, json=body)
    _check(response, method="POST")
    assert response.status_code in (200, 400, 404, 409, 413), response.text
    if response.status_code == 200 and not body.get("stream"):
        choices = response.json()["choices"]
        assert [c["index"] for c in choices] == list(range(_choices_asked(body, chat=chat)))
        assert all(c["finish_reason"] in (None, "stop", "length") for c in choices)


@FUZZ
@given(target=st.sampled_from(["ctx", "gen", "coordinator"]), body=RESPONSES_BODIES)
def test_hostile_responses_bodies_are_refused_or_served(
    cluster: Cluster, client: httpx.Client, target: str, body: dict[str, Any]
) -> None:
    response = client.post(_target(cluster, target).url + "/v1/responses", json=body)
    _check(response, method="POST")
    assert response.status_code in (200, 400, 404, 409, 413), response.text
    if response.status_code == 200 and not body.get("stream"):
        answer = response.json()
        assert answer["object"] == "response" and answer["status"] in ("completed", "incomplete")


def _choices_asked(body: dict[str, Any], *, chat: bool) -> int:
    """n × prompts of a body the server accepted (so every field has its right type)."""
    prompt = body.get("prompt")
    batched = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    return int(body.get("n") or 1) * (len(prompt) if batched and not chat else 1)


# ---- semantically hostile cases, one by one ----


@pytest.mark.parametrize("target", ["ctx", "coordinator"])
def test_edge_values_get_a_400_naming_the_field(
    cluster: Cluster, client: httpx.Client, target: str
) -> None:
    url = _target(cluster, target).url + "/v1/completions"
    cases = [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 129}, "n"),
        ({"n": 65, "prompt": [[5], [6]]}, "n"),  # n × prompts above 128
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"max_tokens": MAX_SEQ_LEN}, "max_tokens"),  # with the prompt, beyond the context
        ({"seed": 2**63}, "seed"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"best_of": 129}, "best_of"),
        ({"guided_regex": "("}, "guided_regex"),
        ({"disaggregated_params": {"disagg_request_id": 2**63}}, "disagg_request_id"),
        ({"disaggregated_params": {"disagg_request_id": -5}}, "disagg_request_id"),
        ({"prompt": [1, 2, 99999]}, "prompt"),
        ({"prompt": [1] * MAX_SEQ_LEN}, "prompt"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
        ({"stop": "x" * 257}, "stop"),
    ]
    for change, field in cases:
        r = client.post(url, json={**completion([5, 6, 7], 2), **change})
        assert r.status_code == 400, (change, r.text)
        assert field in r.json()["error"]["message"], (change, r.text)
    deep = {"prompt": [5], "nested": json.loads("[" * 40 + "]" * 40)}
    r = client.post(url, json=deep)
    assert r.status_code == 400 and "nests deeper" in r.text, r.text
    r = client.post(url, json={**completion([5, 6, 7], 2), "model": "gpt-4"})
    assert r.status_code == 404 and "gpt-4" in r.text, r.text
    r = client.post(url, content=b'{"prompt": "' + b"a" * MAX_BODY + b'"}')
    assert r.status_code == 413, r.text


@pytest.mark.parametrize("target", ["ctx", "coordinator"])
def test_extreme_but_valid_values_are_served(
    cluster: Cluster, client: httpx.Client, target: str
) -> None:
    url = _target(cluster, target).url + "/v1/completions"
    greedy = client.post(url, json=completion([5, 6, 7], 4)).json()["choices"][0]["token_ids"]
    for temperature in (5e-324, 1e-300, 1e-8):  # below float32's reach: sampled greedily
        r = client.post(url, json={**completion([5, 6, 7], 4), "temperature": temperature})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == greedy
    prompt = list(range(10, 10 + MAX_SEQ_LEN - 3))
    r = client.post(url, json=completion(prompt, 3, top_k=2**40, seed=2**63 - 1,
                                         temperature=0.7))  # fmt: skip
    assert r.status_code == 200, r.text  # exactly the room left in the context
    assert r.json()["usage"]["completion_tokens"] == 3
    for max_tokens in (4, 2**31, 2**63, 10**30):  # beyond it: peers answer 400 too
        r = client.post(url, json=completion(prompt, max_tokens))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "max_tokens", r.text


def test_context_only_with_an_id_in_use_is_a_409(cluster: Cluster, client: httpx.Client) -> None:
    body = {**completion([5, 6, 7, 8], 4), "disaggregated_params": {
        "request_type": "context_only", "disagg_request_id": 2**45 + 1}}  # fmt: skip
    first = client.post(cluster.ctx.url + "/v1/completions", json=body)
    assert first.status_code == 200, first.text  # its blocks stay pinned for gen
    second = client.post(cluster.ctx.url + "/v1/completions", json=body)
    assert second.status_code == 409, second.text
    assert str(2**45 + 1) in second.json()["error"]["message"]
    wait_idle(client, cluster.ctx, timeout=TRANSFER_TIMEOUT_MS / 1000 + 10)


def _post_all(
    client: httpx.Client, url: str, bodies: list[dict[str, Any]]
) -> list[tuple[httpx.Response, float]]:
    """POST every body at once (one thread each); (response, seconds) in order."""
    results: list[tuple[httpx.Response, float] | None] = [None] * len(bodies)

    def post(i: int) -> None:
        start = time.monotonic()
        response = client.post(url, json=bodies[i])
        results[i] = (response, time.monotonic() - start)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(r is not None for r in results), "a request did not finish within 60 s"
    return [r for r in results if r is not None]


def _gen_only(endpoint: str, key: int, prompt: list[int]) -> dict[str, Any]:
    params = {"request_type": "generation_only", "first_gen_tokens": [9], "ctx_request_id": 12345,
              "disagg_request_id": key, "ctx_info_endpoint": endpoint}  # fmt: skip
    return {**completion(prompt, 4), "prompt_token_ids": prompt, "disaggregated_params": params}


def test_forged_disaggregated_params_end_in_a_clean_error(
    cluster: Cluster, client: httpx.Client, tmp_path: Path
) -> None:
    prompt = [11, 12, 13, 14, 15]
    with socket.socket() as silent:  # accepts TCP connections, never speaks
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        forged = {
            "unknown id at the real ctx": info_endpoint(client, cluster.ctx),
            "closed port": f"tcp://127.0.0.1:{free_port()}",
            "an HTTP port": f"tcp://127.0.0.1:{cluster.ctx.port}",
            "a silent port": f"tcp://127.0.0.1:{silent.getsockname()[1]}",
            "an unresolvable name": "tcp://nonexistent.invalid:5555",
        }
        bodies = [_gen_only(ep, 2**50 + i, prompt) for i, ep in enumerate(forged.values())]
        results = _post_all(client, cluster.gen.url + "/v1/completions", bodies)
    for what, (response, seconds) in zip(forged, results):
        assert response.status_code == 502, (what, response.text)
        message = response.json()["error"]["message"]
        assert "timed out" in message or "cannot reach ctx" in message or "no request" in message
        assert seconds < 15, (what, seconds)
    wait_idle(client, cluster.gen)
    # Only the real ctx keeps a control connection: the failed rendezvous closed theirs.
    text = client.get(cluster.gen.url + "/metrics").text
    assert metric(text, "trtdisagg_control_connections") <= 1


def test_generation_only_with_an_id_in_use_is_a_409(cluster: Cluster, client: httpx.Client) -> None:
    closed = f"tcp://127.0.0.1:{free_port()}"  # the first waits for its rendezvous timeout
    bodies = [_gen_only(closed, 2**51 + 3, [21, 22, 23]) for _ in range(2)]
    responses = _post_all(client, cluster.gen.url + "/v1/completions", bodies)
    results = sorted(r.status_code for r, _ in responses)
    assert results == [409, 502], results
    wait_idle(client, cluster.gen)


def test_malformed_endpoints_are_a_400(cluster: Cluster, client: httpx.Client) -> None:
    for endpoint in ("tcp://foo", "tcp://127.0.0.1:5;127.0.0.1:6", "tcp://*:5", "tcp://a b:1",
                     "tcp://127.0.0.1:0", "ipc:///tmp/ctx"):  # fmt: skip
        body = _gen_only(endpoint, 2**52, [1, 2, 3])
        r = client.post(cluster.gen.url + "/v1/completions", json=body)
        assert r.status_code == 400, (endpoint, r.text)
        assert "ctx_info_endpoint" in r.json()["error"]["message"]


RAW_REQUESTS = [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 100_000 + b"\r\n\r\n",
    b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
    b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"pro',
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # a TLS ClientHello
]


@pytest.mark.parametrize("target", ["ctx", "gen", "coordinator"])
def test_malformed_http_is_refused_without_harm(
    cluster: Cluster, client: httpx.Client, target: str
) -> None:
    server = _target(cluster, target)
    for raw in RAW_REQUESTS:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            answer = b""
            # The server may refuse and close before all is sent or the write side is shut (a
            # 100 kB header line): a reset here is a refusal too, not a failure.
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                sock.sendall(raw)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)  # a truncated body ends here: the server must cope
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(65536):
                    answer += chunk
        if answer:  # a server may also just close a connection that is not HTTP
            status = int(answer.split(b" ", 2)[1])
            assert status < 500, (raw[:60], answer[:300])  # h11 takes HTTP/9.9 as 1.1: a 200
    assert client.get(server.url + "/health").status_code == 200


def test_everything_still_serves_and_no_block_leaked(
    cluster: Cluster, client: httpx.Client
) -> None:
    """Runs last in this module: after all of the above, correct answers and every block back."""
    assert_alive(client, cluster)
    for worker in cluster.workers:
        # context_only requests of the fuzzer pin their blocks until the transfer timeout
        wait_idle(client, worker, timeout=TRANSFER_TIMEOUT_MS / 1000 + 15)
