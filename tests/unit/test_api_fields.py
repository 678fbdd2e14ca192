"""Every OpenAI request field has a rule, the rules act as docs/API.md says, and the document's
tables are the code's."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from trtdisagg.api.codec import parse_json, parse_request
from trtdisagg.api.errors import ApiError
from trtdisagg.api.fields import CHAT, COMPLETIONS, json_equal
from trtdisagg.api.fields_base import FieldRule, Support
from trtdisagg.api.http import is_json_type
from trtdisagg.api.protocol import ChatCompletionRequest, CompletionRequest
from trtdisagg.api.responses_api import ResponsesRequest
from trtdisagg.api.responses_fields import RESPONSES

# tools/ is a directory of scripts, not a package (as in test_bench_tools.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from api_doc import DOC, TABLES, rendered, tables_in

BASES: dict[str, tuple[dict[str, Any], type]] = {
    "completions": ({"prompt": "hi"}, CompletionRequest),
    "chat": ({"messages": [{"role": "user", "content": "hi"}]}, ChatCompletionRequest),
    "responses": ({"input": "hi"}, ResponsesRequest),
}
OPENAI_FIELDS = {
    "completions": completion_create_params.CompletionCreateParamsBase,
    "chat": chat_create_params.CompletionCreateParamsBase,
    "responses": response_create_params.ResponseCreateParamsBase,
}


def _cases(kinds: tuple[Support, ...]) -> list[tuple[str, FieldRule]]:
    return [
        (route, rule)
        for route, rules in TABLES.items()
        for rule in rules.values()
        if rule.support in kinds
    ]


def _id(case: tuple[str, FieldRule]) -> str:
    return f"{case[0]}.{case[1].name}"


def test_docs_tables_are_the_code_s() -> None:
    text = DOC.read_text()
    assert tables_in(text) == set(TABLES)
    assert rendered(text) == text, "run: python tools/api_doc.py"


@pytest.mark.parametrize("route", sorted(OPENAI_FIELDS))
def test_every_openai_field_has_a_rule(route: str) -> None:
    """The openai package's request type lists what clients send; each field has a rule."""
    fields = set(OPENAI_FIELDS[route].__annotations__) | {"stream"}
    missing = fields - set(TABLES[route])
    assert not missing, f"{route}: no rule for {sorted(missing)} in trtdisagg/api/fields.py"


@pytest.mark.parametrize(
    "case", _cases((Support.NEUTRAL, Support.REFUSED, Support.PARTIAL)), ids=_id
)
def test_a_refused_value_is_a_400_naming_the_field(case: tuple[str, FieldRule]) -> None:
    route, rule = case
    assert rule.refusal is not None, f"{route}.{rule.name}: give it a refusal example"
    base, cls = BASES[route]
    with pytest.raises(ApiError) as info:
        parse_request({**base, **rule.refusal}, cls)
    assert info.value.status == 400
    assert info.value.param == rule.name
    assert info.value.message.startswith(rule.name)


@pytest.mark.parametrize("case", _cases((Support.NEUTRAL,)), ids=_id)
def test_neutral_values_and_null_pass(case: tuple[str, FieldRule]) -> None:
    route, rule = case
    base, cls = BASES[route]
    for value in (*rule.neutral, None):
        parse_request({**base, rule.name: value}, cls)


def test_supported_fields_with_refusal_examples_are_limits() -> None:
    """A supported field's example is a value beyond its limits, not the field refused."""
    for route, rule in _cases((Support.SUPPORTED,)):
        if rule.refusal is None:
            continue
        base, cls = BASES[route]
        with pytest.raises(ApiError) as info:
            parse_request({**base, **rule.refusal}, cls)
        assert info.value.param == rule.name, (route, rule.name, info.value.message)


@pytest.mark.parametrize(
    ("route", "change", "field"),
    [
        ("completions", {"n": 0}, "n"),
        ("completions", {"n": 129}, "n"),
        ("completions", {"n": 3, "prompt": ["a"] * 43}, "n"),
        ("completions", {"prompt": ["a", ""]}, "prompt"),
        ("completions", {"prompt": [[1], []]}, "prompt"),
        ("completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ("completions", {"max_tokens": 0, "echo": False}, "max_tokens"),
        ("completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("completions", {"logprob_token_ids": [1]}, "logprob_token_ids"),  # without logprobs
        ("chat", {"logprob_token_ids": [1], "logprobs": False}, "logprob_token_ids"),
        ("completions", {"logprob_token_ids": list(range(21)), "logprobs": 0},
         "logprob_token_ids"),
        ("chat", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("completions", {"best_of": 1, "n": 2}, "best_of"),
        ("completions", {"seed": -(2**63) - 1}, "seed"),
        ("completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
        ("completions", {"stop": ["x"] * 17}, "stop"),
        ("chat", {"stop": "x" * 257}, "stop"),
        ("completions", {"stream": False, "stream_options": {}}, "stream_options"),
        ("completions", {"logit_bias": {"1": "x"}}, "logit_bias"),
        ("completions", {"logit_bias": {"05": 1}}, "logit_bias"),  # no two keys name one token
        ("completions", {"logit_bias": {"-1": 1}}, "logit_bias"),
        ("completions", {"logit_bias": {"+1": 1}}, "logit_bias"),
        ("completions", {"logit_bias": {"x": 1}}, "logit_bias"),
        ("completions", {"logit_bias": {"1": -100.5}}, "logit_bias"),
        ("completions", {"presence_penalty": False}, "presence_penalty"),
        ("completions", {"presence_penalty": 2.01}, "presence_penalty"),
        ("completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
        ("completions", {"repetition_penalty": -1}, "repetition_penalty"),
        ("completions", {"min_p": -0.1}, "min_p"),
        ("chat", {"min_p": 1.01}, "min_p"),
        ("completions", {"prompt": ["a", "b"],
                         "disaggregated_params": {"request_type": "context_only"}},
         "disaggregated_params"),
        ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
        ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
                  "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
                  "tool_choice": {"type": "function"}}, "tool_choice"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"tool_choice": "sometimes"}, "tool_choice"),
        ("chat", {"response_format": {"type": "yaml"}}, "response_format"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ("chat", {"response_format": {"type": "json_schema",
                                      "json_schema": {"schema": {}, "strict": "yes"}}},
         "response_format"),
        ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
         "structured_outputs"),
        ("completions", {"structured_outputs": {"json_object": True}}, "structured_outputs"),
        ("completions", {"guided_choice": []}, "guided_choice"),
        ("completions", {"guided_json": "{not json"}, "guided_json"),
        ("completions", {"guided_grammar": ""}, "guided_grammar"),
        ("completions", {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
         "guided_regex"),
        ("chat", {"tools": [{"type": "function"}]}, "tools"),
        ("responses", {"input": []}, "input"),
        ("responses", {"input": 5}, "input"),
        ("responses", {"input": [{"role": []}]}, "input"),  # found by the fuzzer: a 500
        ("responses", {"input": [{"role": "user", "content": [{"type": ["x"]}]}]}, "input"),
        ("responses", {"max_output_tokens": "9"}, "max_output_tokens"),
    ],
)  # fmt: skip
def test_limits_are_a_400_naming_the_field(route: str, change: dict[str, Any], field: str) -> None:
    base, cls = BASES[route]
    with pytest.raises(ApiError) as info:
        parse_request({**base, **change}, cls)
    assert info.value.status == 400 and info.value.param == field, info.value.message


def test_accepted_edges() -> None:
    parse_request({"prompt": ["a"] * 64, "n": 2}, CompletionRequest)
    parse_request({"prompt": "a", "n": 128, "best_of": 128, "seed": 2**63 - 1}, CompletionRequest)
    parse_request({"prompt": "a", "stop": ["x" * 256] * 16}, CompletionRequest)
    streamed = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    parse_request({"prompt": "a", "max_tokens": 2**31 - 1, **streamed}, CompletionRequest)
    parse_request({"prompt": "a", "max_tokens": 0, "echo": True, **streamed}, CompletionRequest)
    parse_request({"prompt": "a", "prompt_logprobs": 0, **streamed}, CompletionRequest)
    chat = {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 0}
    parse_request({**chat, "tool_choice": "none", "tools": []}, ChatCompletionRequest)
    controls = {"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 1e-3,
                "min_p": 1, "logit_bias": {"0": -100, "17": 100, "5": 0.5}}  # fmt: skip
    parse_request({"prompt": "a", **controls}, CompletionRequest)
    parse_request({**chat, **controls}, ChatCompletionRequest)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"prompt": "a\\ud800"}', "prompt"),
        (b'{"prompt": ["ok", "\\udfff x"]}', "prompt"),
        (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\uDC00"}]}]}',
         "messages"),
        (b'{"stop": "\\ud83d", "prompt": "x"}', "stop"),
        (b'{"prompt": "x", "\\ud800": 1}', None),
    ],
)  # fmt: skip
def test_lone_surrogates_are_a_400_naming_where(body: bytes, field: str | None) -> None:
    with pytest.raises(ApiError) as info:
        parse_json(body)
    assert info.value.status == 400 and info.value.param == field
    assert "lone surrogate" in info.value.message
    with pytest.raises(ApiError):  # a str body takes the same path
        parse_json(body.decode())


def test_paired_surrogates_and_escaped_backslashes_pass() -> None:
    assert parse_json(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\N{GRINNING FACE}"}
    assert parse_json(b'{"prompt": "\\\\ud800"}') == {"prompt": "\\ud800"}


def test_json_content_types() -> None:
    for ok in ("application/json", "application/json; charset=utf-8", "Application/JSON",
               "application/vnd.api+json"):  # fmt: skip
        assert is_json_type(ok), ok
    for bad in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "json"):
        assert not is_json_type(bad), bad


def test_json_equal_keeps_booleans_apart() -> None:
    assert json_equal(0, 0.0) and json_equal({"a": [1]}, {"a": [1.0]})
    assert not json_equal(False, 0) and not json_equal(True, 1) and not json_equal([], {})


def test_rules_are_unique_per_route() -> None:
    for rules in (COMPLETIONS, CHAT, RESPONSES):
        assert all(name == rule.name for name, rule in rules.items())
