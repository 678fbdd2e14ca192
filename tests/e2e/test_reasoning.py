"""A reasoning model's thinking told apart from its answer (`api/reasoning.py`), on a worker and
through the coordinator (ctx → gen over NIXL), whole and streamed, with the `tiny` model made a
reasoning model (`tests/think_model.py`).

The prompt ends inside the thinking (an assistant turn `<think>…` continued), so what the model
writes is thinking until it writes `</think>`: `logit_bias` makes every token `</think>` when a
test needs the answer part. What the model wrote is read back from `/v1/completions` on the same
prompt ids, which tells nothing apart.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio
import yaml

from tests.edges import NIXL
from tests.fault_checks import processes, wait_all_healthy
from tests.openai_cluster import TARGETS, sse
from tests.procs import Server, free_port, metric, worker_config
from tests.think_model import write_think_model
from trtdisagg.api.reasoning import ReasoningSplitter, Split, ThinkTokens, count_thinking

pytestmark = pytest.mark.timeout(300)

END = 473  # `</think>` in tests/think_model.py's vocabulary
TAGS = ThinkTokens(start=472, end=END)
MIGRATED_TOKENS = 600  # a second or more of decoding on a CPU: the stall lands mid-answer
THINKING = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "<think>Let me see"},
]


@attrs.define(eq=False)
class Cluster:
    ctx: Server
    gens: list[Server]
    coordinator: Server


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """ctx, two gens and a coordinator (round robin: the first leg goes to gen 0)."""
    tmp = tmp_path_factory.mktemp("reasoning")
    model = {"model": str(write_think_model(tmp / "model")), "served_model_name": "tiny"}
    with processes(tmp) as procs:
        workers = []
        for role in ("ctx", "gen", "gen"):
            port = free_port()
            path = tmp / f"{role}-{port}.yaml"
            path.write_text(yaml.safe_dump(worker_config(cache_transceiver_config=NIXL, **model)))
            args = [role, "--config", str(path), "--port", str(port)]
            workers.append(procs.start(args, port, f"{role}-{port}.log"))
        wait_all_healthy(*workers)
        ctx, *gens = workers
        port = free_port()
        path = tmp / "coordinator.yaml"
        round_robin = {"urls": [g.url for g in gens], "router": {"type": "round_robin"}}
        path.write_text(yaml.safe_dump({
            "hostname": "127.0.0.1", "port": port, "request_timeout": 60,
            "context_servers": {"urls": [ctx.url]}, "generation_servers": round_robin,
            "health_check_interval": 3600, "inter_token_timeout": 1.0,
        }))  # fmt: skip
        coordinator = procs.start(["coordinator", "--config", str(path)], port, "coordinator.log")
        wait_all_healthy(coordinator)
        yield Cluster(ctx=ctx, gens=gens, coordinator=coordinator)


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60, trust_env=False) as client:
        yield client


def url_of(cluster: Cluster, target: str) -> str:
    return cluster.ctx.url if target == "worker" else cluster.coordinator.url


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": THINKING, "continue_final_message": True,
            "add_generation_prompt": False, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True, **extra}  # fmt: skip


def written(http: httpx.Client, cluster: Cluster, answer: dict[str, Any], **extra: Any) -> str:
    """The text the model wrote for `answer`'s prompt, as /v1/completions gives it."""
    body = {"model": "tiny", "prompt": answer["prompt_token_ids"], "max_tokens": 8,
            "temperature": 0, **extra}  # fmt: skip
    r = http.post(cluster.ctx.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def streamed(events: list[Any]) -> tuple[str, str]:
    reasoning = content = ""
    for event in events:
        for choice in event.get("choices", []) if isinstance(event, dict) else []:
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    return reasoning, content


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bias", [{}, {"logit_bias": {str(END): 100}}], ids=["think", "answer"])
def test_thinking_and_answer_come_apart_whole_and_streamed(
    cluster: Cluster, http: httpx.Client, target: str, bias: dict[str, Any]
) -> None:
    url = url_of(cluster, target) + "/v1/chat/completions"
    r = http.post(url, json=chat(**bias))
    assert r.status_code == 200, r.text
    answer = r.json()
    message = answer["choices"][0]["message"]
    splitter = ReasoningSplitter(thinking=True)  # the prompt's last tag is <think>
    expected = splitter.feed(written(http, cluster, answer, **bias)) + splitter.finish()
    assert expected.reasoning if not bias else expected.content  # the case this tests
    assert Split(message["reasoning_content"] or "", message["content"]) == expected
    thought, _ = count_thinking(answer["choices"][0]["token_ids"], True, TAGS)
    assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought}
    usage = {"stream_options": {"include_usage": True}}
    events = sse(http, url, chat(stream=True, **bias, **usage))
    assert streamed(events) == (expected.reasoning, expected.content)
    details = events[-2]["usage"]["completion_tokens_details"]  # (the prompt is cached now)
    assert details == answer["usage"]["completion_tokens_details"]


@pytest.mark.parametrize("target", TARGETS)
def test_include_reasoning_false_drops_the_thinking(
    cluster: Cluster, http: httpx.Client, target: str
) -> None:
    url = url_of(cluster, target) + "/v1/chat/completions"
    r = http.post(url, json=chat(include_reasoning=False))
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"] == ""
    events = sse(http, url, chat(include_reasoning=False, stream=True))
    assert streamed(events) == ("", "")
    assert any(c.get("token_ids") for e in events[:-1] for c in e["choices"])  # it ran


def test_without_a_thinking_prompt_the_output_is_the_answer(
    cluster: Cluster, http: httpx.Client
) -> None:
    """The prompt's last tag closes the thinking (as Qwen3's template does with
    `enable_thinking: false`): what the model writes is the answer."""
    closed = [THINKING[0], {"role": "assistant", "content": "<think></think>Sure"}]
    r = http.post(url_of(cluster, "worker") + "/v1/chat/completions", json=chat(messages=closed))
    assert r.status_code == 200, r.text
    answer = r.json()
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] is None
    assert message["content"] == written(http, cluster, answer)


async def read_thinking(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], out: Any
) -> None:
    """Stream `body`, adding to `out` (a dict) its thinking, answer, tokens and errors."""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            out["errors"] += [event["error"]] if "error" in event else []
            for choice in event.get("choices", []):
                out["reasoning"] += choice["delta"].get("reasoning_content") or ""
                out["content"] += choice["delta"].get("content") or ""
                out["tokens"] += choice.get("token_ids") or []


async def test_thinking_stays_thinking_across_a_migration(cluster: Cluster) -> None:
    """gen stalls mid-thinking: the answer resumes on the other gen, and the coordinator, which
    rebuilds the continuation's text, tells its thinking apart from where the first leg left
    it: the client's stream is an undisturbed run's, thinking and answer alike."""
    body = chat(max_tokens=MIGRATED_TOKENS, stream=True, ignore_eos=True)
    fresh = lambda: {"reasoning": "", "content": "", "tokens": [], "errors": []}  # noqa: E731
    reference, out = fresh(), fresh()
    stalled = cluster.gens[0]
    async with httpx.AsyncClient(timeout=60) as client:
        await read_thinking(client, cluster.ctx.url, body, reference)  # the worker, aggregated
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_thinking, client, cluster.coordinator.url, body, out)
                with trio.fail_after(30):
                    while len(out["tokens"]) < 10:  # noqa: ASYNC110  (the client's own state)
                        await trio.sleep(0.01)
                text = (await client.get(stalled.url + "/metrics")).text
                assert metric(text, "trtdisagg_requests_running") == 1  # still thinking
                stalled.proc.send_signal(signal.SIGSTOP)
        finally:
            stalled.proc.send_signal(signal.SIGCONT)
    assert not out["errors"]
    assert out == reference
    assert reference["reasoning"]  # (600 tokens of tiny may close the thinking: that too)
    log = cluster.coordinator.log()
    assert "resuming the answer" in log and "gen's text is used" not in log


@pytest.mark.parametrize("target", TARGETS)
def test_an_answer_held_to_a_grammar_is_the_answer_alone(
    cluster: Cluster, http: httpx.Client, target: str
) -> None:
    """Structured output: the grammar shapes all the model writes, so none of it is thinking,
    though the prompt's last tag is <think>."""
    body = chat(response_format={"type": "json_object"}, max_tokens=12)
    r = http.post(url_of(cluster, target) + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"].startswith("{")


@pytest.mark.parametrize("target", TARGETS)
def test_the_responses_api_answers_with_a_reasoning_item_first(
    cluster: Cluster, target: str
) -> None:
    client = openai.OpenAI(base_url=url_of(cluster, target) + "/v1", api_key="unused")
    asked: Any = {"model": "tiny", "input": THINKING, "max_output_tokens": 8, "temperature": 0}
    first = client.responses.create(**asked)
    thought = first.output[0]
    assert thought.type == "reasoning" and thought.content
    assert first.usage is not None and first.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(**asked, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thought.content[0].text
    # An agent's next turn sends the answer's items back, the reasoning item among them.
    items = [item.model_dump(exclude_none=True) for item in first.output]
    turn = [*THINKING[:1], *items, {"role": "user", "content": "And then?"}]
    again = client.responses.create(**{**asked, "input": turn})
    assert again.status in ("completed", "incomplete") and again.output
