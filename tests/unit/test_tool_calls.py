"""The tool-call parser and format (`api/tool_calls.py`): calls found whole in text fed in any
pieces, text outside them kept, what is not a call left as text."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trtdisagg.api.tool_calls import (
    HERMES,
    ToolCallParser,
    parse_tool_calls,
    tool_call_deltas,
    tool_call_format,
)
from trtdisagg.model.tiny_tokenizer import CHAT_TEMPLATE

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_the_tiny_template_documents_the_hermes_format() -> None:
    assert tool_call_format(CHAT_TEMPLATE) is HERMES
    assert tool_call_format("{{ messages }}") is None and tool_call_format(None) is None


def test_calls_and_the_text_before_them() -> None:
    parsed = parse_tool_calls(
        "Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"), HERMES
    )
    assert parsed.content == "Let me look.\n"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert all(c.id.startswith("call_") for c in parsed.calls)
    assert len({c.id for c in parsed.calls}) == 2


def test_a_newline_inside_the_tags_and_string_arguments() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    (call,) = parse_tool_calls(text, HERMES).calls
    assert (call.name, call.arguments) == ("f", '{"a": 1}')


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>["f"]</tool_call>',
        '<tool_call>{"name": "f"',  # never closed
        "a < b and <tool",
    ],
)
def test_what_is_not_a_call_stays_text(text: str) -> None:
    parsed = parse_tool_calls(text, HERMES)
    assert parsed.calls == () and parsed.content == text


@given(cuts=st.lists(st.integers(0, len(CALL) + 10), max_size=6), before=st.text(max_size=8))
def test_any_pieces_give_the_same_answer(cuts: list[int], before: str) -> None:
    text = before.replace("<", "") + CALL + " "
    parser = ToolCallParser(format=HERMES)
    content, calls = "", []
    points = sorted({0, *(min(c, len(text)) for c in cuts), len(text)})
    for start, end in itertools.pairwise(points):
        piece = parser.feed(text[start:end])
        content += piece.content
        calls += piece.calls
        assert "<tool" not in piece.content  # a possible call is held back, never shown
    content += parser.finish().content
    assert content == text[: text.index("<tool_call>")]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]


def test_a_held_back_start_that_is_no_call_comes_out() -> None:
    parser = ToolCallParser(format=HERMES)
    assert parser.feed("x <tool_").content == "x "
    assert parser.feed("cal").content == ""
    assert parser.feed("m").content == "<tool_calm"
    assert parser.feed("<").content == ""
    assert parser.finish().content == "<"


def test_stream_deltas_number_the_calls_on() -> None:
    calls = parse_tool_calls(CALL + CALL, HERMES).calls
    deltas = tool_call_deltas(calls[1:], 1)
    assert deltas == [{"index": 1, "id": calls[1].id, "type": "function",
                       "function": {"name": "get_weather",
                                    "arguments": '{"city": "Paris"}'}}]  # fmt: skip
