"""The OpenAI API as real clients use it, against real processes: a ctx and a gen worker (NIXL)
behind a coordinator, all on `tiny`, started once for the module. "worker" is the ctx worker
serving whole (aggregated) requests alone; "coordinator" splits every choice into a ctx → gen
pair. Each feature is checked for OpenAI's shape (the official `openai` client parses every
answer) and for agreement: the same tokens split or not, greedy and seeded at temperature 1.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.edges import Cluster, running_cluster, wait_idle, wait_until
from tests.procs import Server, free_port, metric, spawn
from trtdisagg.api.fanout import choice_seed
from trtdisagg.worker.tokenization import Tokenizer

pytestmark = pytest.mark.timeout(300)

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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("openai_api")) as running:
        yield running


@pytest.fixture(scope="module")
def generation_first(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """A second coordinator over the same workers, with schedule_style: generation_first."""
    tmp = tmp_path_factory.mktemp("generation_first")
    port = free_port()
    config = {
        "hostname": "127.0.0.1", "port": port, "schedule_style": "generation_first",
        "context_servers": {"urls": [cluster.ctx.url]},
        "generation_servers": {"urls": [cluster.gen.url]},
        "health_check_interval": 0.2, "request_timeout": 60,
    }  # fmt: skip
    path = tmp / "disagg.yaml"
    path.write_text(yaml.safe_dump(config))
    with spawn(
        ["coordinator", "--config", str(path)], port=port, log_path=tmp / "coordinator.log"
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60, trust_env=False) as client:
        yield client


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


# ---- models ----


@pytest.mark.parametrize("target", TARGETS)
def test_models(cluster: Cluster, target: str) -> None:
    client = api(url_of(cluster, target))
    [model] = client.models.list().data
    assert model.id == "tiny" and model.object == "model" and model.created > 0
    assert model.max_model_len == 4096
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["param"] == "model" and "gpt-4" in info.value.body["message"]


# ---- batched prompts and n ----


def test_batched_prompts_and_n_agree_split_or_not(cluster: Cluster) -> None:
    worker, coordinator = both(cluster)
    ask = {
        "model": "tiny",
        "prompt": PROMPTS,
        "n": 2,
        "max_tokens": 5,
        "temperature": 0,
        "extra_body": {**IDS, "ignore_eos": True},
    }
    alone, split = worker.completions.create(**ask), coordinator.completions.create(**ask)
    for answer in (alone, split):
        assert [c.index for c in answer.choices] == list(range(6))
        prompt_ids = [c.prompt_token_ids for c in answer.choices]
        assert prompt_ids[0] == prompt_ids[1] != prompt_ids[2] == prompt_ids[3]
        assert answer.usage is not None
        assert answer.usage.prompt_tokens == sum(len(ids) for ids in prompt_ids[::2])
        assert answer.usage.completion_tokens == 6 * 5
    assert tokens_of(alone) == tokens_of(split)
    assert [c.text for c in alone.choices] == [c.text for c in split.choices]
    for p, prompt in enumerate(PROMPTS):  # a batch equals its prompts sent one by one
        one = worker.completions.create(**{**ask, "prompt": prompt, "n": 1})
        assert tokens_of(one)[0] == tokens_of(alone)[2 * p] == tokens_of(alone)[2 * p + 1]


def test_seeded_choices_agree_split_or_not_and_reproduce(cluster: Cluster) -> None:
    worker, coordinator = both(cluster)
    ask = {
        "model": "tiny",
        "prompt": PROMPTS[:2],
        "n": 3,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 1234,
        "extra_body": {**IDS, "ignore_eos": True},
    }
    alone, split = worker.completions.create(**ask), coordinator.completions.create(**ask)
    assert tokens_of(alone) == tokens_of(split)
    assert len({tuple(t) for t in tokens_of(alone)[:3]}) > 1  # the choices really sample
    for i in range(3):  # choice i samples with choice_seed(seed, i), as docs/API.md says
        one = worker.completions.create(
            **{**ask, "prompt": PROMPTS[1], "n": 1, "seed": choice_seed(1234, i)}
        )
        assert tokens_of(one)[0] == tokens_of(alone)[3 + i]


@pytest.mark.parametrize("seed", [None, 77])
def test_chat_n_streams_interleave_and_agree(
    cluster: Cluster, http: httpx.Client, seed: int | None
) -> None:
    body = {
        "messages": CHAT,
        "n": 3,
        "max_tokens": 6,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **IDS,
        **({"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}),
    }
    streamed: dict[str, dict[int, list[int]]] = {}
    for target in TARGETS:
        events = sse(http, url_of(cluster, target) + "/v1/chat/completions", body)
        usage = assert_stream_shape(events, 3)
        assert usage["completion_tokens"] == 18
        choices = by_choice(events)
        for chunks in choices.values():
            assert chunks[0]["delta"].get("role") == "assistant"
            assert all("role" not in c["delta"] for c in chunks[1:])
        streamed[target] = {i: [t for c in cs for t in c["token_ids"]] for i, cs in choices.items()}
        whole = api(url_of(cluster, target)).chat.completions.create(
            model="tiny", messages=CHAT, n=3, max_tokens=6, seed=seed,
            temperature=0 if seed is None else 1.0, extra_body={**IDS, "ignore_eos": True},
        )  # fmt: skip
        assert [list(c.token_ids) for c in whole.choices] == [streamed[target][i] for i in range(3)]
    assert streamed["worker"] == streamed["coordinator"]


@pytest.mark.parametrize("target", TARGETS)
def test_completion_stream_with_n_and_batch(
    cluster: Cluster, http: httpx.Client, target: str
) -> None:
    body = {
        "prompt": PROMPTS[:2],
        "n": 2,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **IDS,
    }
    events = sse(http, url_of(cluster, target) + "/v1/completions", body)
    usage = assert_stream_shape(events, 4)
    whole = api(url_of(cluster, target)).completions.create(
        model="tiny", prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=0,
        extra_body={**IDS, "ignore_eos": True},
    )  # fmt: skip
    assert whole.usage is not None and usage == whole.usage.model_dump(exclude_none=True)
    texts = {i: "".join(c["text"] for c in cs) for i, cs in by_choice(events).items()}
    assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]


def test_best_of_equal_to_n(cluster: Cluster) -> None:
    for client in both(cluster):
        answer = client.completions.create(
            model="tiny", prompt="Hi", n=2, best_of=2, max_tokens=2, temperature=0
        )
        assert len(answer.choices) == 2


# ---- logprobs ----


def _close(a: list[float | None], b: list[float | None]) -> bool:
    return len(a) == len(b) and all(
        x is not None and y is not None and abs(x - y) < LOGPROB_TOLERANCE
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completion_logprobs_are_whole_through_the_split(
    cluster: Cluster, temperature: float
) -> None:
    worker, coordinator = both(cluster)
    ask = {
        "model": "tiny",
        "prompt": PROMPTS[1],
        "max_tokens": 6,
        "logprobs": 3,
        "seed": 5,
        "temperature": temperature,
        "extra_body": {**IDS, "ignore_eos": True},
    }
    alone, split = worker.completions.create(**ask), coordinator.completions.create(**ask)
    assert tokens_of(alone) == tokens_of(split)
    a, s = alone.choices[0].logprobs, split.choices[0].logprobs
    assert a is not None and s is not None
    assert s.token_logprobs is not None and s.token_logprobs[0] is not None  # ctx's token
    assert _close(list(a.token_logprobs or []), list(s.token_logprobs))
    assert s.tokens == a.tokens and s.text_offset == a.text_offset
    assert s.top_logprobs is not None and a.top_logprobs is not None
    for top_a, top_s, token in zip(a.top_logprobs, s.top_logprobs, s.tokens or [], strict=True):
        # 3 best plus the sampled token, fewer when tokens share a text (a dict by text)
        assert set(top_a) == set(top_s) and token in top_s and len(top_s) <= 4


def test_logprobs_0_give_the_sampled_token_alone(cluster: Cluster) -> None:
    for client in both(cluster):
        answer = client.completions.create(
            model="tiny", prompt="Hi", max_tokens=3, logprobs=0, temperature=0
        )
        lp = answer.choices[0].logprobs
        assert lp is not None and lp.tokens and lp.top_logprobs and lp.token_logprobs
        assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_have_one_entry_per_token_through_the_split(
    cluster: Cluster, http: httpx.Client, stream: bool
) -> None:
    body = {
        "messages": CHAT,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
        **IDS,
    }
    entries: dict[str, list[dict[str, Any]]] = {}
    for target in TARGETS:
        url = url_of(cluster, target) + "/v1/chat/completions"
        if stream:
            events = sse(http, url, {**body, "stream": True})
            chunks = by_choice(events)[0]
            with_tokens = [c for c in chunks if c["token_ids"]]
            assert all(c["logprobs"] is not None for c in with_tokens)  # the first one too
            entries[target] = [e for c in with_tokens for e in c["logprobs"]["content"]]
        else:
            answer = api(url_of(cluster, target)).chat.completions.create(
                model="tiny", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                top_logprobs=2, extra_body={**IDS, "ignore_eos": True},
            )  # fmt: skip
            content = answer.choices[0].logprobs.content
            entries[target] = [e.model_dump() for e in content or []]
        assert len(entries[target]) == 5
    alone, split = entries["worker"], entries["coordinator"]
    assert [e["token"] for e in alone] == [e["token"] for e in split]
    assert _close([e["logprob"] for e in alone], [e["logprob"] for e in split])
    assert all(len(e["top_logprobs"]) == 2 for e in split)


def test_generation_first_serves_logprobs_context_first(
    cluster: Cluster, generation_first: Server
) -> None:
    worker, coordinator = api(cluster.ctx.url), api(generation_first.url)
    ask = {
        "model": "tiny",
        "prompt": PROMPTS[0],
        "max_tokens": 6,
        "logprobs": 2,
        "temperature": 0,
        "extra_body": {**IDS, "ignore_eos": True},
    }
    alone, split = worker.completions.create(**ask), coordinator.completions.create(**ask)
    assert tokens_of(alone) == tokens_of(split)
    lp = split.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and None not in lp.token_logprobs
    seeded = {**ask, "temperature": 1.0, "seed": 99}  # seeded, without logprobs: gen first
    del seeded["logprobs"]
    assert tokens_of(worker.completions.create(**seeded)) == tokens_of(
        coordinator.completions.create(**seeded)
    )


# ---- echo ----


@pytest.mark.parametrize("target", TARGETS)
def test_echo(cluster: Cluster, http: httpx.Client, target: str) -> None:
    client = api(url_of(cluster, target))
    plain = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=4, temperature=0)
    echoed = client.completions.create(
        model="tiny", prompt=PROMPTS[:2], max_tokens=4, temperature=0, echo=True
    )
    for prompt, a, b in zip(PROMPTS, plain.choices, echoed.choices, strict=False):
        assert b.text == prompt + a.text
    prompt_ids = client.completions.create(
        model="tiny", prompt="Hi!", max_tokens=1, extra_body=IDS
    ).prompt_token_ids
    ids = client.completions.create(
        model="tiny", prompt=[prompt_ids], max_tokens=2, temperature=0, echo=True
    )
    assert ids.choices[0].text.startswith("<|bos|>Hi!")  # token ids: decoded as they are
    events = sse(
        http,
        url_of(cluster, target) + "/v1/completions",
        {"prompt": PROMPTS[:2], "max_tokens": 4, "temperature": 0, "echo": True, "stream": True},
    )
    for index, chunks in by_choice(events).items():
        assert chunks[0]["text"] == PROMPTS[index]
        assert "".join(c["text"] for c in chunks) == echoed.choices[index].text


# ---- usage in every chunk ----


@pytest.mark.parametrize("target", TARGETS)
def test_continuous_usage_stats(cluster: Cluster, http: httpx.Client, target: str) -> None:
    body = {
        "prompt": PROMPTS[:2],
        "n": 2,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = sse(http, url_of(cluster, target) + "/v1/completions", body)
    chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
    assert chunks and all("usage" in e for e in chunks)
    seen: dict[int, int] = {}
    for event in chunks:
        index, used = event["choices"][0]["index"], event["usage"]["completion_tokens"]
        assert used >= seen.get(index, 0)
        seen[index] = used
    assert seen == {i: 5 for i in range(4)}
    assert assert_stream_shape(events, 4)["completion_tokens"] == 20


# ---- tools ----


def _template_ids(http: httpx.Client, cluster: Cluster, tools: Any, messages: Any) -> list[int]:
    info = http.get(cluster.ctx.url + "/server_info").json()
    tokenizer = Tokenizer.from_dir(Path(info["model_path"]))
    text = tokenizer.apply_chat_template(messages, tools=tools)
    return tokenizer.encode(text, add_special_tokens=False)


def test_tools_and_tool_turns_reach_the_chat_template(cluster: Cluster, http: httpx.Client) -> None:
    rendered = [
        {k: v if v is not None else "" for k, v in m.items()} for m in TOOL_TURNS
    ]  # the worker renders a null content as ""
    expected = _template_ids(http, cluster, TOOLS, rendered)
    without = _template_ids(http, cluster, None, rendered)
    assert expected != without
    results = []
    for client in both(cluster):
        for choice, ids in (("auto", expected), ("none", without)):
            answer = client.chat.completions.create(
                model="tiny", messages=TOOL_TURNS, tools=TOOLS, tool_choice=choice,
                max_tokens=3, temperature=0, extra_body=IDS,
            )  # fmt: skip
            assert answer.prompt_token_ids == ids
            results.append(list(answer.choices[0].token_ids))
    assert results[:2] == results[2:]  # split or not


# ---- /v1/responses ----


def test_responses_agree_split_or_not(cluster: Cluster) -> None:
    answers = [
        client.responses.create(
            model="tiny",
            instructions="Be brief.",
            max_output_tokens=6,
            input=[{"role": "user", "content": "Hello there"}],
            temperature=0,
        )
        for client in both(cluster)
    ]
    for answer in answers:
        assert answer.object == "response" and answer.status in ("completed", "incomplete")
        assert answer.output[0].type == "message"
        assert answer.usage is not None and 1 <= answer.usage.output_tokens <= 6
        assert answer.usage.total_tokens == answer.usage.input_tokens + answer.usage.output_tokens
    assert answers[0].output_text == answers[1].output_text
    assert answers[0].usage.input_tokens == answers[1].usage.input_tokens


@pytest.mark.parametrize("target", TARGETS)
def test_responses_stream(cluster: Cluster, target: str) -> None:
    client = api(url_of(cluster, target))
    whole = client.responses.create(
        model="tiny", input="Once upon a time", max_output_tokens=5, temperature=0
    )
    events = list(
        client.responses.create(
            model="tiny", input="Once upon a time", max_output_tokens=5, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("target", TARGETS)
def test_responses_refuse_what_they_do_not_support(cluster: Cluster, target: str) -> None:
    client = api(url_of(cluster, target))
    for field, value in (
        ("store", True),
        ("previous_response_id", "resp_1"),
        ("tools", TOOLS),
        ("reasoning", {"effort": "low"}),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="tiny", input="x", **{field: value})
        assert info.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="x", max_output_tokens=5000)
    assert info.value.body["param"] == "max_output_tokens"


# ---- validation: one list, the worker and the coordinator ----

COMPLETE = {"prompt": "Hello", "max_tokens": 2}
CHATTING = {"messages": CHAT, "max_tokens": 2}
REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"max_tokens": 4095}, "max_tokens"),  # + the prompt: beyond 4096
    ("/v1/completions", {"max_tokens": 2**31}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 4096}, "max_completion_tokens"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"stop_token_ids": [512]}, "stop_token_ids"),  # tiny has 512 ids
    ("/v1/completions", {"seed": 2**63}, "seed"),
    ("/v1/completions", {"logit_bias": {"5": 1}}, "logit_bias"),
    ("/v1/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -1}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("/v1/completions", {"min_p": 0.1}, "min_p"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"n": 129}, "n"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"logit_bias": {"5": -100}}, "logit_bias"),
    ("/v1/responses", {"input": "x", "store": True}, "store"),
]  # fmt: skip
NEUTRAL = [
    ("/v1/completions", {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
                         "repetition_penalty": 1, "min_p": 0, "best_of": 1, "suffix": "",
                         "response_format": {"type": "text"}, "user": "u"}),
    ("/v1/chat/completions", {"tool_choice": "auto", "response_format": {"type": "text"},
                              "parallel_tool_calls": True, "store": False, "modalities": ["text"],
                              "service_tier": "auto", "metadata": {"a": "b"}}),
]  # fmt: skip


def _base(path: str) -> dict[str, Any]:
    return dict(CHATTING if path == "/v1/chat/completions" else COMPLETE)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("path", "change", "field"), REFUSALS)
def test_each_refusal_is_a_400_naming_the_field(
    cluster: Cluster, http: httpx.Client, target: str, path: str, change: Any, field: str
) -> None:
    body = change if path == "/v1/responses" else {**_base(path), **change}
    r = http.post(url_of(cluster, target) + path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(field), error
    assert error["type"] == "invalid_request_error" and error["code"] == 400


@pytest.mark.parametrize("target", TARGETS)
def test_neutral_values_are_served(cluster: Cluster, http: httpx.Client, target: str) -> None:
    for path, change in NEUTRAL:
        r = http.post(url_of(cluster, target) + path, json={**_base(path), **change})
        assert r.status_code == 200, (change, r.text)


@pytest.mark.parametrize("target", TARGETS)
def test_bad_text_and_content_types(cluster: Cluster, http: httpx.Client, target: str) -> None:
    url = url_of(cluster, target)
    for path, raw, field in (
        ("/v1/completions", b'{"prompt": "a\\ud800", "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}', "messages"),
        ("/v1/responses", b'{"input": "x\\ud800y"}', "input"),
    ):  # fmt: skip
        r = http.post(url + path, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    for declared in ("text/plain", "application/x-www-form-urlencoded"):
        r = http.post(
            url + "/v1/completions",
            content=json.dumps(COMPLETE).encode(),
            headers={"Content-Type": declared},
        )
        assert r.status_code == 415 and r.json()["error"]["param"] == "Content-Type", r.text
    r = http.post(url + "/v1/completions", content=json.dumps(COMPLETE).encode())
    assert r.status_code == 200, r.text  # no Content-Type at all: read as JSON


# ---- clients that leave ----


@pytest.mark.parametrize("target", TARGETS)
def test_leaving_a_stream_of_several_choices_frees_everything(
    cluster: Cluster, http: httpx.Client, target: str
) -> None:
    url = url_of(cluster, target)
    aborted = 'role="coordinator",status="aborted"'

    def counts() -> tuple[float, float]:
        text = http.get(url + "/metrics").text
        return metric(text, "trtdisagg_requests_total", aborted), metric(
            text, "trtdisagg_requests_running"
        )

    before = counts()[0]
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    stream = http.stream("POST", url + "/v1/completions", json=body)
    with stream as r, contextlib.suppress(httpx.HTTPError):
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the choices are running: hang up
    for worker in cluster.workers:
        wait_idle(http, worker, timeout=30)
    if target == "coordinator":  # the client's request is counted once, however many choices
        wait_until(lambda: counts() == (before + 1, 0), 10, "the request counted as aborted")
