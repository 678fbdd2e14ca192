"""A request field this server does not know is ignored, and named in one warning per process;
the names a client can make it keep are bounded."""

from __future__ import annotations

from typing import Any

import pytest

from trtdisagg.api.codec import parse_request
from trtdisagg.api.protocol import ChatCompletionRequest, CompletionRequest
from trtdisagg.api.unknown_fields import MAX_NAME_CHARS, UnknownFields

KNOWN = frozenset({"model", "prompt", "max_tokens"})


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trtdisagg.api"]


def test_each_unknown_name_is_told_once(caplog: pytest.LogCaptureFixture) -> None:
    unknown = UnknownFields()
    body: dict[str, Any] = {"model": "m", "prompt": "x", "max_token": 5, "tempreature": 0}
    unknown.note(body, KNOWN, "/v1/completions")
    unknown.note(body, KNOWN, "/v1/completions")
    unknown.note({"model": "m", "max_token": 1}, KNOWN, "/v1/chat/completions")
    told = _warnings(caplog)
    assert len(told) == 2
    assert "/v1/completions" in told[0] and "'max_token'" in told[0]
    assert "'tempreature'" in told[1]


def test_known_names_are_never_told(caplog: pytest.LogCaptureFixture) -> None:
    UnknownFields().note({"model": "m", "prompt": "x", "max_tokens": 3}, KNOWN, "/v1/completions")
    assert _warnings(caplog) == []


def test_names_kept_are_bounded_in_number_and_length(caplog: pytest.LogCaptureFixture) -> None:
    unknown = UnknownFields(limit=3)
    long = "x" * 10_000
    unknown.note({long: 1, long + "y": 2}, KNOWN, "/v1/completions")  # one name, cut
    unknown.note({f"f{i}": i for i in range(10)}, KNOWN, "/v1/completions")
    unknown.note({"g": 1}, KNOWN, "/v1/completions")
    told = _warnings(caplog)
    assert len(told) == 4  # the cut name, f0, f1, then that no more are named
    assert repr("x" * MAX_NAME_CHARS) in told[0] and "x" * (MAX_NAME_CHARS + 1) not in told[0]
    assert "no more are named" in told[3]
    assert len(unknown._told) == 3


def test_parsing_a_request_tells_of_its_unknown_fields(caplog: pytest.LogCaptureFixture) -> None:
    name = "max_tokns_only_in_this_test"  # the parser's memory is per process
    req = parse_request({"prompt": "hi", "max_tokens": 4, name: 9}, CompletionRequest)
    assert req.max_tokens == 4
    (told,) = _warnings(caplog)
    assert "/v1/completions" in told and repr(name) in told
    # this server's extensions and OpenAI's ignored fields are known: none of them is told
    caplog.clear()
    extensions = {"ignore_eos": True, "return_token_ids": True, "min_tokens": 1, "top_k": 5,
                  "repetition_penalty": 1.1, "user": "u", "stream_options": None}  # fmt: skip
    parse_request({"prompt": "hi", **extensions}, CompletionRequest)
    chat = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}
    parse_request({**chat, **extensions}, ChatCompletionRequest)
    assert _warnings(caplog) == []
