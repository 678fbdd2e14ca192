"""What the OpenAI API end-to-end modules share: the cluster they start (a ctx and a gen worker
with NIXL behind a coordinator, on `tiny`), the two ways to reach it, and readers of streams.

"worker" is the ctx worker serving whole (aggregated) requests alone; "coordinator" splits
every choice into a ctx → gen pair.

The cluster is started once per test session (per xdist worker) by `shared_cluster` in
`tests/e2e/conftest.py`, and shared by the modules that only send it requests and leave it idle.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

from tests.edges import Cluster, running_cluster
from tests.procs import Server, free_port, spawn

TARGETS = ("worker", "coordinator")
PROMPTS = ["The quick brown fox", "Once upon a time there was", "Hello"]
CHAT = [{"role": "user", "content": "What is two plus two?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_TURNS = [
    *CHAT,
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]  # fmt: skip
IDS = {"return_token_ids": True}
LOGPROB_TOLERANCE = 1e-4  # ctx's prefill and gen's decode sum in different orders


@contextlib.contextmanager
def openai_cluster(tmp: Path) -> Iterator[tuple[Cluster, httpx.Client]]:
    with running_cluster(tmp) as cluster, httpx.Client(timeout=60, trust_env=False) as http:
        yield cluster, http


@contextlib.contextmanager
def generation_first_coordinator(cluster: Cluster, tmp: Path) -> Iterator[Server]:
    """A second coordinator over `cluster`'s workers, with schedule_style: generation_first."""
    port = free_port()
    config = {
        "hostname": "127.0.0.1", "port": port, "schedule_style": "generation_first",
        "context_servers": {"urls": [cluster.ctx.url]},
        "generation_servers": {"urls": [cluster.gen.url]},
        "request_timeout": 60,
    }  # fmt: skip
    path = tmp / "disagg.yaml"
    path.write_text(yaml.safe_dump(config))
    with spawn(
        ["coordinator", "--config", str(path), "--port", str(port)],
        port=port,
        log_path=tmp / "coordinator.log",
    ) as server:
        yield server


def url_of(cluster: Cluster, target: str) -> str:
    if target == "worker":
        return cluster.ctx.url
    assert cluster.coordinator is not None
    return cluster.coordinator.url


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def both(cluster: Cluster) -> tuple[openai.OpenAI, openai.OpenAI]:
    return api(url_of(cluster, "worker")), api(url_of(cluster, "coordinator"))


def tokens_of(answer: Any) -> list[list[int]]:
    return [list(choice.token_ids) for choice in answer.choices]


def sse(http: httpx.Client, url: str, body: dict[str, Any]) -> list[Any]:
    """Every `data:` of a stream, `[DONE]` as the string."""
    events: list[Any] = []
    with http.stream("POST", url, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def by_choice(events: list[Any]) -> dict[int, list[dict[str, Any]]]:
    choices: dict[int, list[dict[str, Any]]] = {}
    for event in events:
        if isinstance(event, dict):
            for choice in event.get("choices") or []:
                choices.setdefault(choice["index"], []).append(choice)
    return choices


def assert_stream_shape(events: list[Any], count: int) -> dict[str, Any]:
    """Choices 0..count-1, each ending with its one finish chunk; one usage chunk after every
    finish; `[DONE]` once, last. Returns the usage chunk."""
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    choices = by_choice(events)
    assert sorted(choices) == list(range(count))
    for chunks in choices.values():
        finishes = [c for c in chunks if c["finish_reason"] is not None]
        assert len(finishes) == 1 and finishes[0] is chunks[-1]
    usage = [e for e in events[:-1] if e.get("usage") and not e["choices"]]
    assert len(usage) == 1 and usage[0] is events[-2]
    return dict(usage[0]["usage"])
