"""Thinking told apart from the answer (`api/reasoning.py`): by the prompt's last tag, and the
same whatever pieces the text comes in."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from trtdisagg.api.reasoning import (
    ReasoningSplitter,
    Split,
    ThinkTokens,
    count_thinking,
    thinks_after,
)

TAGS = ThinkTokens(start=7, end=8)


def split_whole(text: str, *, thinking: bool) -> Split:
    splitter = ReasoningSplitter(thinking)
    return splitter.feed(text) + splitter.finish()


def test_the_prompt_s_last_tag_says_where_the_output_starts() -> None:
    assert thinks_after([1, 2, 7, 3], TAGS)  # the template opened the thinking
    assert not thinks_after([1, 7, 3, 8, 4], TAGS)  # it was closed (thinking switched off)
    assert not thinks_after([1, 2, 3], TAGS)  # no tag: the model may open it itself
    assert thinks_after([7, 8, 7], TAGS)


def test_thinking_tokens_are_counted_tags_included() -> None:
    assert count_thinking([1, 2, 8, 3, 4], True, TAGS) == (3, False)  # 1, 2 and </think>
    assert count_thinking([1, 7, 2, 8, 3], False, TAGS) == (3, False)  # <think> 2 </think>
    assert count_thinking([1, 7, 2], False, TAGS) == (2, True)
    assert count_thinking([8, 8], False, TAGS) == (0, False)  # an end tag outside is text


def test_thinking_then_answer() -> None:
    assert split_whole("<think>weigh it</think>The answer.", thinking=False) == Split(
        "weigh it", "The answer."
    )
    assert split_whole("weigh it</think>The answer.", thinking=True) == Split(
        "weigh it", "The answer."
    )
    assert split_whole("no thinking at all", thinking=False) == Split("", "no thinking at all")
    assert split_whole("still thinking <thi", thinking=True) == Split("still thinking <thi", "")
    assert split_whole("a < b and </thin", thinking=False) == Split("", "a < b and </thin")


def test_a_tag_across_pieces_is_held_until_told_apart() -> None:
    splitter = ReasoningSplitter(False)
    assert splitter.feed("Hi <th") == Split("", "Hi ")
    assert splitter.feed("ink>so") == Split("so", "")
    assert splitter.feed("</") == Split("", "")
    assert splitter.feed("b>") == Split("</b>", "")  # not the end tag after all
    assert splitter.feed("</think>ok") == Split("", "ok")


pieces = st.lists(
    st.sampled_from(["<think>", "</think>", "<", "</", "<th", "ink>", "think>", "a", " b", "\n"]),
    max_size=12,
)


@given(parts=pieces, cuts=st.lists(st.integers(0, 200), max_size=8), thinking=st.booleans())
def test_any_pieces_split_as_the_whole_text_does(
    parts: list[str], cuts: list[int], thinking: bool
) -> None:
    text = "".join(parts)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    splitter = ReasoningSplitter(thinking)
    total = Split()
    for a, b in itertools.pairwise(bounds):
        total = total + splitter.feed(text[a:b])
    total = total + splitter.finish()
    assert total == split_whole(text, thinking=thinking)
    assert len(total.reasoning) + len(total.content) <= len(text)
