"""Which tokens a request may sample next under vLLM's `allowed_token_ids` and `bad_words`. Pure.

`allowed_token_ids` is a fixed set: a bitmask in the layout of a grammar's (`grammar.py`), so
that both meet in one mask (`intersect`). `bad_words` are strings; the tokens that spell them
(`bad_word_ids`) are banned where they would complete one: a word of one token is never sampled,
and the last token of a longer one is not sampled right after the others (`banned_next`). As in
vLLM, only the request's output counts: a word begun at the end of the prompt may be finished.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

import numpy as np
import numpy.typing as npt

BITS = 32  # tokens per word of an allowed-token mask


def bad_word_ids(
    words: Iterable[str], encode: Callable[[str], list[int]]
) -> tuple[tuple[int, ...], ...]:
    """The token sequences that spell `words` in an output (`encode`: text → ids, no special
    tokens). Each word is taken without its leading spaces, as at the start of the text, and
    with one space before it, as after another word, where BPE vocabularies spell it with other
    tokens (" larger" may be one token where "larger" is three). vLLM keeps the spaced form only
    when it has as many tokens as the bare one, and so lets " larger" through; here it counts
    whenever it differs (a spaced form that is a space token before the bare form bans nothing
    more)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        if not bare:
            continue
        sequences.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced != bare:
            sequences.append(spaced)
    return tuple(sequences)


def banned_next(sequences: Iterable[Sequence[int]], output: Sequence[int]) -> frozenset[int]:
    """The tokens that would complete one of `sequences` as the next token after `output`."""
    banned = set()
    for ids in sequences:
        before = len(ids) - 1
        if before == 0:
            banned.add(ids[0])
        elif before <= len(output) and list(output[len(output) - before :]) == list(ids[:-1]):
            banned.add(ids[-1])
    return frozenset(banned)


def allowed_mask(tokens: Collection[int], width: int) -> npt.NDArray[np.int32]:
    """An int32 bitmask of `width` tokens, bit t of word t // 32 set for each token of `tokens`
    (each below `width`)."""
    ids = np.fromiter(tokens, dtype=np.int64, count=len(tokens))
    if ids.size and (ids.min() < 0 or ids.max() >= width):
        raise ValueError(f"allowed tokens must be in [0, {width})")
    words = np.zeros(-(-width // BITS), dtype=np.uint32)
    np.bitwise_or.at(
        words, ids // BITS, np.left_shift(np.uint32(1), (ids % BITS).astype(np.uint32))
    )
    return words.view(np.int32)


def intersect(first: npt.NDArray[np.int32], second: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
    """The tokens both bitmasks allow; past the shorter one's last word, none."""
    size = min(first.size, second.size)
    return np.bitwise_and(first[:size], second[:size])
