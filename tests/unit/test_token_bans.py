"""vLLM's `allowed_token_ids` and `bad_words` as masks and bans (`worker/token_bans.py`), and how
they meet a grammar's mask and min_tokens in a step's spec."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trtdisagg.worker.token_bans import allowed_mask, bad_word_ids, banned_next, intersect

# A toy tokenizer: a leading space makes a word one token of its own, a bare word is spelt by
# its letters (as BPE vocabularies spell " larger" as one token and "larger" as three).
SPACED = {" cat": 90, " larger": 91}


def encode(text: str) -> list[int]:
    if text in SPACED:
        return [SPACED[text]]
    return [ord(c) for c in text]


def test_each_word_is_spelt_bare_and_after_a_space() -> None:
    assert bad_word_ids(["cat"], encode) == ((99, 97, 116), (90,))
    # leading spaces are the word's own no more; a spaced form equal to the bare one is not kept
    assert bad_word_ids(["  dog"], encode) == ((100, 111, 103), (32, 100, 111, 103))
    assert bad_word_ids(["ab", "larger"], encode)[2:] == ((108, 97, 114, 103, 101, 114), (91,))


def test_a_word_of_one_token_is_banned_always_a_longer_one_after_its_start() -> None:
    words = ((5,), (1, 2, 3), (2, 4))
    assert banned_next(words, []) == {5}
    assert banned_next(words, [7, 1]) == {5}
    assert banned_next(words, [7, 1, 2]) == {5, 3, 4}
    assert banned_next(words, [2]) == {5, 4}
    assert banned_next(words, [1, 2, 9]) == {5}


@given(
    words=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), min_size=1, max_size=4),
    picks=st.lists(st.integers(0, 5), max_size=30),
)
def test_an_output_that_avoids_each_ban_never_spells_a_word(
    words: list[list[int]], picks: list[int]
) -> None:
    """Build an output token by token, each time taking the wanted token unless banned, then
    the first token not banned: no word appears anywhere in it."""
    output: list[int] = []
    for want in picks:
        banned = banned_next(words, output)
        free = [t for t in (want, *range(6)) if t not in banned]
        if not free:
            break  # every token completes a word: nothing may follow
        output.append(free[0])
    for word in words:
        n = len(word)
        assert all(output[i : i + n] != word for i in range(len(output) - n + 1)), (word, output)


def _allowed(mask: np.ndarray, width: int) -> set[int]:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return {int(t) for t in np.flatnonzero(bits) if t < width}


def test_allowed_tokens_are_the_bits_of_a_grammar_layout_mask() -> None:
    mask = allowed_mask({0, 31, 32, 99}, 100)
    assert mask.dtype == np.int32 and mask.size == 4  # 100 tokens in words of 32
    assert _allowed(mask, 100) == {0, 31, 32, 99}
    with pytest.raises(ValueError, match=r"\[0, 100\)"):
        allowed_mask({100}, 100)
    other = allowed_mask({31, 99, 5}, 128)
    assert _allowed(intersect(mask, other), 128) == {31, 99}
    assert _allowed(intersect(mask, allowed_mask({32, 63}, 64)), 128) == {32}  # none past 64
