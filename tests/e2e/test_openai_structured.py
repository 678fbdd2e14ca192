"""Structured output and tool calls through real processes (`tests/openai_cluster.py`: a ctx and a
gen worker behind a coordinator, on the random `tiny` model, shared with the other modules that only
send it requests), with the official `openai` client: output always parses and validates against its
schema (20 of them), aggregated and disaggregated alike (the mask of the first token is ctx's, gen's
after it replays that token); tool calls come back in OpenAI's shape, whole and streamed.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest

from tests.edges import Cluster
from tests.json_schemas import SCHEMAS
from tests.openai_cluster import CHAT, TARGETS, api, both, url_of

pytestmark = pytest.mark.timeout(300)

CITY = {"type": "string", "maxLength": 8}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": what, "parameters": {
        "type": "object", "properties": {"city": CITY}, "required": ["city"],
        "additionalProperties": False}}}
    for name, what in (("get_weather", "Weather now."), ("get_time", "Local time."))
]  # fmt: skip
SAMPLING = [{"temperature": 0}, {"temperature": 1.0, "seed": 123}]


@pytest.fixture(scope="module")
def cluster(shared_cluster: tuple[Cluster, httpx.Client]) -> Cluster:
    return shared_cluster[0]


@pytest.fixture(scope="module")
def http(shared_cluster: tuple[Cluster, httpx.Client]) -> httpx.Client:
    return shared_cluster[1]


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_output_validates_against_each_schema_split_or_not(cluster: Cluster, index: int) -> None:
    """Each schema under one of the two samplings, in turn: how the mask is applied does not
    depend on the schema (tests/unit/test_grammar.py walks every schema's grammar), so every
    schema and both samplings are covered without running each schema twice."""
    schema = SCHEMAS[index]
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": f"schema_{index}", "schema": schema, "strict": True},
    }
    sampling = SAMPLING[index % len(SAMPLING)]
    texts = []
    for client in both(cluster):
        answer = client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=300, n=2,
            response_format=response_format, **sampling,
        )  # fmt: skip
        for choice in answer.choices:
            assert choice.finish_reason == "stop"
            content = choice.message.content
            assert content is not None
            jsonschema.validate(json.loads(content), schema)
            texts.append(content)
    assert texts[:2] == texts[2:]  # split or not, the same output


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    "response_format",
    [{"type": "json_object"},
     {"type": "json_schema", "json_schema": {"name": "nested", "schema": SCHEMAS[10]}}],
)  # fmt: skip
def test_streamed_json_parses(cluster: Cluster, target: str, response_format: Any) -> None:
    # `json_object` bounds nothing: a random model may write one key forever (then `length`);
    # this seed closes the object.
    stream = api(url_of(cluster, target)).chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=300, temperature=1.0, seed=1, stream=True,
        response_format=response_format,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert isinstance(json.loads(text), dict)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_regex": r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"},
         lambda t: re.fullmatch(r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", t)),
        ({"structured_outputs": {"choice": ["alpha", "beta", "gamma delta"]}},
         lambda t: t in ("alpha", "beta", "gamma delta")),
        ({"guided_grammar": 'start: "x" num\nnum: /[0-9]{1,3}/'},
         lambda t: re.fullmatch(r"x[0-9]{1,3}", t)),
    ],
)  # fmt: skip
def test_vllm_structured_outputs_split_or_not(cluster: Cluster, extra: Any, check: Any) -> None:
    texts = []
    for client in both(cluster):
        answer = client.completions.create(
            model="tiny", prompt="Answer:", max_tokens=40, temperature=1.0, seed=9, n=3,
            extra_body=extra,
        )  # fmt: skip
        for choice in answer.choices:
            assert choice.finish_reason == "stop" and check(choice.text), choice.text
        texts.append([c.text for c in answer.choices])
    assert texts[0] == texts[1]


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    calls = message.tool_calls or []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [("required", {"get_weather", "get_time"}),
     ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})],
)  # fmt: skip
def test_forced_tool_calls_split_or_not(cluster: Cluster, tool_choice: Any, names: Any) -> None:
    found = []
    for client in both(cluster):
        answer = client.chat.completions.create(
            model="tiny", messages=CHAT, tools=TOOLS, tool_choice=tool_choice,
            parallel_tool_calls=False, max_tokens=100, temperature=1.0, seed=4,
        )  # fmt: skip
        (choice,) = answer.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = _calls(choice.message)
        assert len(calls) == 1 and calls[0][0] in names
        jsonschema.validate(calls[0][1], TOOLS[0]["function"]["parameters"])
        found.append(calls)
    assert found[0] == found[1]


@pytest.mark.parametrize("target", TARGETS)
def test_streamed_tool_calls_have_openai_s_deltas(cluster: Cluster, target: str) -> None:
    client = api(url_of(cluster, target))
    ask = {"model": "tiny", "messages": CHAT, "tools": TOOLS, "tool_choice": "required",
           "max_tokens": 200, "temperature": 1.0, "seed": 6}  # fmt: skip
    whole = client.chat.completions.create(**ask)
    chunks = [c for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == list(range(len(deltas))) and deltas
    streamed = [(d.function.name, json.loads(d.function.arguments)) for d in deltas]
    assert all(d.id and d.type == "function" for d in deltas)
    assert streamed == _calls(whole.choices[0].message)
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"


RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # flat


@pytest.mark.parametrize("target", TARGETS)
def test_responses_call_functions_and_read_their_output(cluster: Cluster, target: str) -> None:
    """An agent's loop over /v1/responses: a forced call comes back as a `function_call` item
    (streamed: added, arguments delta and done, item done), and the next turn, sending that
    call and the function's output back as items, reads as chat's tool turns do."""
    client = api(url_of(cluster, target))
    question = {"role": "user", "content": "Weather in Oslo?"}
    ask: dict[str, Any] = {"model": "tiny", "input": [question], "tools": RESPONSES_TOOLS,
                           "tool_choice": "required", "parallel_tool_calls": False,
                           "max_output_tokens": 100, "temperature": 0}  # fmt: skip
    first = client.responses.create(**ask)
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    assert call.type == "function_call" and call.name in {"get_weather", "get_time"}
    jsonschema.validate(json.loads(call.arguments), RESPONSES_TOOLS[0]["parameters"])
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    items = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in items] == [
        ("function_call", call.name, call.arguments)
    ]
    answer = "rain, 4 degrees"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": answer}
    turn = [question, call.model_dump(exclude_none=True), output]
    second = client.responses.create(
        model="tiny", input=turn, tools=RESPONSES_TOOLS, max_output_tokens=6, temperature=0
    )
    calls = [{"id": call.call_id, "type": "function",
              "function": {"name": call.name, "arguments": call.arguments}}]  # fmt: skip
    chat = client.chat.completions.create(
        model="tiny", tools=TOOLS, max_tokens=6, temperature=0,
        messages=[question, {"role": "assistant", "content": None, "tool_calls": calls},
                  {"role": "tool", "tool_call_id": call.call_id, "content": answer}],
    )  # fmt: skip
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens  # the same prompt
    assert second.output_text == (chat.choices[0].message.content or "")


def test_auto_parses_the_calls_the_output_makes(cluster: Cluster, http: httpx.Client) -> None:
    """`auto`: calls in the output become tool_calls, the text before them the content (the
    output is pinned by a regex here, as a model trained for tools would write it)."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    body = {"messages": CHAT, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 100,
            "temperature": 0, "guided_regex": re.escape("Let me check. " + call)}  # fmt: skip
    for target in TARGETS:
        answer = http.post(url_of(cluster, target) + "/v1/chat/completions", json=body).json()
        (choice,) = answer["choices"]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Let me check. "
        [made] = choice["message"]["tool_calls"]
        assert made["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
        plain = http.post(
            url_of(cluster, target) + "/v1/chat/completions",
            json={**body, "tool_choice": "none", "tools": None},
        ).json()["choices"][0]  # without tools the same text stays text
        assert plain["message"]["content"] == "Let me check. " + call
        assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"]


def test_a_responses_text_format_is_enforced_split_or_not(cluster: Cluster) -> None:
    schema = SCHEMAS[0]
    texts = []
    for client in both(cluster):
        answer = client.responses.create(
            model="tiny", input="Who?", max_output_tokens=200, temperature=0,
            text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                             "strict": True}},
        )  # fmt: skip
        jsonschema.validate(json.loads(answer.output_text), schema)
        texts.append(answer.output_text)
    assert texts[0] == texts[1]
