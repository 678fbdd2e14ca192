"""A fake worker that speaks the worker's HTTP contract, for coordinator tests. No model, no KV.

It serves ``/health``, ``/server_info``, ``/kv_cache_events``, ``/metrics``, ``/v1/models`` and
``/v1/completions`` / ``/v1/chat/completions`` for all three request types, as DESIGN.md §2 and
§5 describe them: a ``context_only`` answer carries ``prompt_token_ids`` and the choice's
``disaggregated_params``; a ``generation_only`` answer starts with ctx's first token. Tokens come
from a deterministic function of the sequence so far, so aggregated and disaggregated answers
are equal exactly when the coordinator splits and merges correctly.

Knobs for failure tests live on the `FakeWorker` object: ``token_delay`` (seconds per token),
``fail_status``/``fail_count`` (answer the next N requests with that status), ``hang``
(accept requests and never answer), ``gate`` (requests wait for this event), ``stall_after``
(a stream stops after N tokens and stays open), ``error_after`` (a stream ends with an error
event after N tokens, as a worker whose step failed does) and ``health_hang`` (``/health``
alone never answers). A fake ctx records each ``/disagg/release`` it gets (``releases``) and
which of its answers still hold "KV" (``held``).

``kv_compat`` is published in ``/server_info`` as a worker's is. A fake ctx's info endpoint
carries it, so a fake gen with a ``kv_compat`` of its own answers 500 naming both to a
``generation_only`` request whose KV would come from a ctx that differs, as a real gen's
transceiver refuses such a peer.
"""

from __future__ import annotations

import itertools
import json
import math
import time
import urllib.parse
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import attrs
import trio
from quart import Response, request
from quart_trio import QuartTrio

from trtdisagg.kv.hashing import reusable_block_hashes

Json = dict[str, Any]


def fake_tokenize(text: str) -> list[int]:
    return [ord(c) % 500 + 10 for c in text]


def next_token(sequence: list[int]) -> int:
    return sum((i + 1) * t for i, t in enumerate(sequence[-8:])) % 997 + 7


def generate(prompt: list[int], count: int) -> list[int]:
    sequence = list(prompt)
    for _ in range(count):
        sequence.append(next_token(sequence))
    return sequence[len(prompt) :]


def text_of(tokens: list[int]) -> str:
    return "".join(f" t{t}" for t in tokens)


def _usage(prompt: int, completion: int, cached: int = 0) -> Json:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@attrs.define(eq=False, kw_only=True)
class FakeWorker:
    role: str
    model: str = "fake"
    tokens_per_block: int = 4
    max_batch_size: int = 64
    token_delay: float = 0.0
    fail_status: int | None = None
    fail_count: int = 0
    hang: bool = False
    gate: trio.Event | None = None  # requests wait for it to be set before anything else
    stall_after: int | None = None  # a stream sends this many tokens, then nothing, for ever
    error_after: int | None = None  # a stream sends this many tokens, then an error event
    health_hang: bool = False  # /health never answers (everything else still does)
    health_checks: int = 0  # /health requests received
    unhealthy: str | None = None  # /health answers 503 with this reason, as a stopped worker does
    kv_compat: dict[str, str | int] | None = None  # None: not published (taken as able to pair)
    boot_id: str = "boot-1"  # what /health names; a test changes it to play a restart
    running: int = 0
    requests: Counter[str] = attrs.Factory(Counter)
    """Requests served, by request_type."""
    bodies: list[Json] = attrs.Factory(list)
    held: set[int] = attrs.Factory(set)
    """ctx: transfer keys of the context_only answers not released since (a fake gen takes
    nothing, so the keys of requests that succeeded stay here)."""
    releases: list[int] = attrs.Factory(list)
    """ctx: the transfer keys of every `/disagg/release` received, in order."""
    _stored: set[int] = attrs.Factory(set)
    _events: list[Json] = attrs.Factory(list)  # every event (ids 0, 1, ...): tests are short
    _drained: int = 0  # events a drain returned
    _event_ids: itertools.count[int] = attrs.Factory(itertools.count)
    _ctx_ids: itertools.count[int] = attrs.Factory(lambda: itertools.count(1))
    running_changed: trio.Event = attrs.Factory(trio.Event)

    def _set_running(self, delta: int) -> None:
        self.running += delta
        self.running_changed.set()
        self.running_changed = trio.Event()

    async def wait_running(self, value: int) -> None:
        while self.running != value:
            await self.running_changed.wait()

    async def wait_releases(self, count: int) -> None:
        while len(self.releases) < count:
            await self.running_changed.wait()

    async def wait_bodies(self, count: int) -> None:
        while len(self.bodies) < count:
            await self.running_changed.wait()

    async def wait_health_checks(self, count: int) -> None:
        while self.health_checks < count:
            await self.running_changed.wait()

    @property
    def ctx_info_endpoint(self) -> str:
        return _info_endpoint(self.role, self.kv_compat)

    def refuses_kv_from(self, ctx_info_endpoint: object) -> str | None:
        """gen: why KV from that ctx cannot come here, or None when it can."""
        if self.kv_compat is None or ctx_info_endpoint == _info_endpoint("ctx", self.kv_compat):
            return None
        return f"fake gen: ctx {ctx_info_endpoint} differs from gen's kv_compat {self.kv_compat}"

    def _store(self, prompt: list[int]) -> int:
        """Register the prompt's blocks; returns how many prompt tokens were cached before."""
        hashes = reusable_block_hashes(prompt, self.tokens_per_block)
        matched = 0
        for h in hashes:
            if h not in self._stored:
                break
            matched += 1
        new = [h for h in hashes if h not in self._stored]
        if new:
            self._stored.update(new)
            event = {"event_id": next(self._event_ids), "kind": "stored", "block_hashes": new}
            self._events.append({**event, "parent_hash": None})
        return matched * self.tokens_per_block

    def restart(self, boot_id: str) -> None:
        """Come back as a new process at once: nothing cached, no events, another boot id."""
        self.boot_id = boot_id
        self._stored.clear()
        self._events.clear()
        self._drained = 0
        self._event_ids = itertools.count()

    def drain_events(self) -> list[Json]:
        events = self._events[self._drained :]
        self._drained = len(self._events)
        return events

    def events_after(self, cursor: int) -> list[Json]:
        return self._events[max(0, cursor + 1) :]

    def metrics_text(self) -> str:
        total = sum(self.requests.values())
        lines = [
            f'trtdisagg_requests_total{{role="{self.role}",status="ok"}} {float(total)}',
            f"trtdisagg_requests_running {float(self.running)}",
        ]
        for kind, n in sorted(self.requests.items()):
            lines.append(f'fake_requests_total{{request_type="{kind}"}} {float(n)}')
        return "\n".join(lines) + "\n"

    def server_info(self) -> Json:
        compat = {"kv_compat": self.kv_compat} if self.kv_compat is not None else {}
        return {
            **compat,
            "role": self.role,
            "model": self.model,
            "model_path": "/nonexistent/fake-model",
            "max_batch_size": self.max_batch_size,
            "tokens_per_block": self.tokens_per_block,
            "kv_hash_algorithm": "blake2b-63-chained-v1",
            "disaggregated_params": {"ctx_info_endpoint": self.ctx_info_endpoint},
        }


def _info_endpoint(role: str, kv_compat: dict[str, str | int] | None) -> str:
    endpoint = f"tcp://fake-{role}:1"
    if kv_compat is None:
        return endpoint
    return endpoint + "?" + urllib.parse.urlencode(sorted(kv_compat.items()))


def _prompt_ids(body: Json, chat: bool) -> list[int]:
    if body.get("prompt_token_ids") is not None:
        return list(body["prompt_token_ids"])
    if chat:
        text = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in body["messages"])
        return fake_tokenize(text)
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        prompt = prompt[0]
    return fake_tokenize(prompt) if isinstance(prompt, str) else list(prompt)


def _error(status: int, message: str) -> Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return Response(json.dumps(body), status=status, content_type="application/json")


def create_fake_app(worker: FakeWorker) -> QuartTrio:
    app = QuartTrio(__name__)
    app.config["RESPONSE_TIMEOUT"] = None

    def as_json(value: Any, status: int = 200) -> Response:
        return Response(json.dumps(value), status=status, content_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        worker.health_checks += 1
        worker._set_running(0)  # wakes `wait_health_checks`
        if worker.health_hang:
            await trio.sleep_forever()
        if worker.unhealthy is not None:
            return as_json({"status": "unhealthy", "reason": worker.unhealthy}, status=503)
        return as_json({"status": "ok", "boot_id": worker.boot_id})

    @app.get("/server_info")
    async def server_info() -> Response:
        return as_json(worker.server_info())

    @app.post("/kv_cache_events")
    async def kv_cache_events() -> Response:
        body = await request.get_json(silent=True)
        if isinstance(body, dict) and isinstance(body.get("after"), int):
            return as_json(worker.events_after(body["after"]))
        return as_json(worker.drain_events())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(worker.metrics_text(), content_type="text/plain")

    @app.post("/disagg/release")
    async def release() -> Response:
        key = (await request.get_json())["transfer_key"]
        released = key in worker.held
        worker.held.discard(key)
        worker.releases.append(key)
        worker._set_running(0)  # wakes `wait_releases`
        return as_json({"transfer_key": key, "released": released})

    @app.get("/v1/models")
    async def models() -> Response:
        return as_json({"object": "list", "data": [{"id": worker.model, "object": "model"}]})

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await _serve(worker, await request.get_json(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        return await _serve(worker, await request.get_json(), chat=True)

    return app


async def _serve(worker: FakeWorker, body: Json, *, chat: bool) -> Response:
    worker.bodies.append(body)
    worker._set_running(0)  # wakes `wait_bodies`
    if worker.gate is not None:
        await worker.gate.wait()
    if worker.hang:
        await trio.sleep_forever()
    if worker.fail_count > 0 and worker.fail_status is not None:
        worker.fail_count -= 1
        return _error(worker.fail_status, f"fake {worker.role} failure")
    if not isinstance(body.get("max_tokens", 16), int):
        return _error(400, "max_tokens: expected an integer")
    params = body.get("disaggregated_params") or {}
    kind = params.get("request_type", "context_and_generation")
    prompt = _prompt_ids(body, chat)
    max_tokens = int(body.get("max_tokens") or 16)
    worker.requests[kind] += 1
    choice_extra: Json = {}
    if kind == "context_only":
        cached = worker._store(prompt)
        tokens = generate(prompt, 1)
        finish = "length" if max_tokens == 1 else None
        if finish is None:
            worker.held.add(int(params["transfer_key"]))
            choice_extra["disaggregated_params"] = {
                "request_type": "context_only",
                "first_gen_tokens": tokens,
                "ctx_request_id": next(worker._ctx_ids),
                "disagg_request_id": params.get("disagg_request_id"),
                "transfer_key": params.get("transfer_key"),
                "ctx_dp_rank": 0,
                "ctx_info_endpoint": worker.ctx_info_endpoint,
            }
        answer = _whole(chat, tokens, finish, _usage(len(prompt), 1, cached), worker.model)
        answer["choices"][0].update(choice_extra)
        answer["prompt_token_ids"] = prompt
        return Response(json.dumps(answer), content_type="application/json")
    if kind == "generation_only":
        if refused := worker.refuses_kv_from(params.get("ctx_info_endpoint")):
            return _error(500, refused)
        worker._store(prompt)  # the received KV is reusable on gen from now on
        first = params.get("first_gen_tokens") or generate(prompt, 1)
        tokens = first + generate(prompt + first, max_tokens - len(first))
        usage = _usage(len(prompt), max_tokens, 0)
    else:
        cached = worker._store(prompt)
        tokens = generate(prompt, max_tokens)
        usage = _usage(len(prompt), max_tokens, cached)
    if body.get("stream"):
        response = Response(
            _stream(worker, body, chat, tokens, usage), content_type="text/event-stream"
        )
        response.timeout = None
        return response
    worker._set_running(+1)
    try:
        await trio.sleep(worker.token_delay * len(tokens))
    finally:
        worker._set_running(-1)
    answer = _whole(chat, tokens, "length", usage, worker.model)
    if body.get("return_perf_metrics"):
        answer["perf_metrics"] = {"first_token_s": 0.001, "decode_s": 0.002}
    return Response(json.dumps(answer), content_type="application/json")


def _whole(chat: bool, tokens: list[int], finish: str | None, usage: Json, model: str) -> Json:
    choice: Json = {"index": 0, "finish_reason": finish, "logprobs": None, "token_ids": tokens}
    if chat:
        choice["message"] = {"role": "assistant", "content": text_of(tokens)}
    else:
        choice["text"] = text_of(tokens)
    return {
        "id": "cmpl-fake",
        "object": "chat.completion" if chat else "text_completion",
        "created": math.floor(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


async def _stream(
    worker: FakeWorker, body: Json, chat: bool, tokens: list[int], usage: Json
) -> AsyncIterator[bytes]:
    head = {
        "id": "cmpl-fake",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": math.floor(time.time()),
        "model": worker.model,
    }
    worker._set_running(+1)
    try:
        for i, token in enumerate(tokens):
            if i == worker.stall_after:
                await trio.sleep_forever()
            if i == worker.error_after:
                error = {"error": {"message": "fake gen failure", "type": "internal_server_error",
                                   "code": 500}}  # fmt: skip
                yield b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"
                return
            await trio.sleep(worker.token_delay)
            finish = "length" if i == len(tokens) - 1 else None
            choice: Json = {"index": 0, "finish_reason": finish, "token_ids": [token]}
            if chat:
                choice["delta"] = {"content": text_of([token])}
            else:
                choice["text"] = text_of([token])
            yield b"data: " + json.dumps({**head, "choices": [choice]}).encode() + b"\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk: Json = {**head, "choices": [], "usage": usage}
            if body.get("return_perf_metrics"):
                chunk["perf_metrics"] = {"first_token_s": 0.001, "decode_s": 0.002}
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        worker._set_running(-1)
