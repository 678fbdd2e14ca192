"""The validation list, one parametrised test each, against the worker alone and through the
coordinator (`tests/openai_cluster.py`, shared with the other modules that only send it requests):
every refusal is a 400 in OpenAI's shape naming the field, neutral values are served, bad text is a
400, a non-JSON body a 415.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.edges import Cluster
from tests.openai_cluster import CHAT, TARGETS, TOOLS, url_of

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(shared_cluster: tuple[Cluster, httpx.Client]) -> Cluster:
    return shared_cluster[0]


@pytest.fixture(scope="module")
def http(shared_cluster: tuple[Cluster, httpx.Client]) -> httpx.Client:
    return shared_cluster[1]


COMPLETE = {"prompt": "Hello", "max_tokens": 2}
CHATTING = {"messages": CHAT, "max_tokens": 2}
REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"max_tokens": 4095}, "max_tokens"),  # + the prompt: beyond 4096
    ("/v1/completions", {"max_tokens": 2**31}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 4096}, "max_completion_tokens"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"stop_token_ids": [512]}, "stop_token_ids"),  # tiny has 512 ids
    ("/v1/completions", {"seed": 2**63}, "seed"),
    ("/v1/completions", {"logit_bias": {"512": 1}}, "logit_bias"),  # tiny has 512 ids
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"05": 1}}, "logit_bias"),
    ("/v1/completions", {"priority": 1}, "priority"),
    ("/v1/completions", {"truncate_prompt_tokens": 4097}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/v1/completions", {"allowed_token_ids": [3, 512]}, "allowed_token_ids"),
    ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/chat/completions", {"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ("/v1/completions", {"bad_words": ["fine", " "]}, "bad_words"),
    ("/v1/chat/completions", {"bad_words": ["w"] * 129}, "bad_words"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -2.01}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"best_of": 129}, "best_of"),
    ("/v1/completions", {"n": 129}, "n"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, "response_format"),  # llguidance refuses it
    ("/v1/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),  # the last message is the user's
    ("/v1/chat/completions", {"chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"logit_bias": {"5": -100.5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/responses", {"input": "x", "store": True}, "store"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]},
     "messages"),  # a text-only model: an image left out would change the question
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages"),
]  # fmt: skip
NEUTRAL = [
    ("/v1/completions", {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
                         "repetition_penalty": 1, "min_p": 0, "best_of": 1, "suffix": "",
                         "response_format": {"type": "text"}, "user": "u"}),
    ("/v1/chat/completions", {"tool_choice": "auto", "response_format": {"type": "text"},
                              "parallel_tool_calls": True, "store": False, "modalities": ["text"],
                              "service_tier": "auto", "metadata": {"a": "b"}}),
    ("/v1/chat/completions", {"messages": [{"role": "developer", "content": "Be brief."},
                                           {"role": "user", "content": "Hi"}]}),
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
