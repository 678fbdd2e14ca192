"""A reasoning model's thinking, told apart from its answer: `<think>` … `</think>`. Pure.

Reasoning models (DeepSeek-R1 and its distills, Qwen3 and QwQ) write their thinking between
`<think>` and `</think>`, each one token of their vocabulary, and then the answer. With a
`reasoning_parser` a chat answer carries the thinking in `reasoning_content` (a message's, a
delta's: the field DeepSeek's API, vLLM and SGLang use) and the rest in `content`.

Whether the output starts inside the thinking is read from the prompt, not guessed from the
output: the output starts thinking when the prompt's last tag is `<think>` (`thinks_after`).
That covers a template that opens the thinking itself (DeepSeek-R1's ends its prompt with
`<think>`), one that closes it to switch thinking off (Qwen3's `enable_thinking: false` puts an
empty `<think></think>` in the prompt), a model that opens it in its output, and a continuation
that resumes an answer from prompt + the tokens already sent (`coordinator/continuation.py`):
its prompt holds them, tags included.

`ReasoningSplitter` splits text as it is streamed. A tag may arrive across pieces of text (the
detokenizer holds bytes back): text that may be the start of a tag is held until it is told
apart, and `finish` releases what is held. Splitting the text in any pieces gives what
splitting it whole gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs

THINK_START: Final = "<think>"
THINK_END: Final = "</think>"
PARSERS: Final = ("deepseek_r1", "qwen3")
"""The `reasoning_parser` names (vLLM's); both read `<think>` … `</think>` as above."""


@attrs.frozen(kw_only=True)
class ThinkTokens:
    """The vocabulary's ids of the two tags."""

    start: int
    end: int


def thinks_after(token_ids: Sequence[int], tags: ThinkTokens) -> bool:
    """Whether text that follows `token_ids` is inside the thinking: their last tag opens it."""
    for token in reversed(token_ids):
        if token == tags.end:
            return False
        if token == tags.start:
            return True
    return False


def count_thinking(token_ids: Sequence[int], thinking: bool, tags: ThinkTokens) -> tuple[int, bool]:
    """How many of `token_ids` are thinking (the tags included: OpenAI's `reasoning_tokens`),
    starting `thinking` or not; and whether the thinking is open after them."""
    count = 0
    for token in token_ids:
        if thinking or token == tags.start:
            count += 1
            thinking = token != tags.end
    return count, thinking


@attrs.frozen
class Split:
    reasoning: str = ""
    content: str = ""

    def __add__(self, other: Split) -> Split:
        return Split(self.reasoning + other.reasoning, self.content + other.content)


@attrs.define(eq=False)
class ReasoningSplitter:
    thinking: bool  # inside the thinking now
    _held: str = ""  # the end of the text so far, which may be the start of a tag

    def feed(self, text: str) -> Split:
        """`text`'s thinking and answer parts; what may start a tag is held back."""
        text = self._held + text
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            tag = THINK_END if self.thinking else THINK_START
            at = text.find(tag)
            if at >= 0:
                (reasoning if self.thinking else content).append(text[:at])
                text = text[at + len(tag) :]
                self.thinking = not self.thinking
                continue
            keep = _partial_tag(text)
            (reasoning if self.thinking else content).append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            break
        return Split("".join(reasoning), "".join(content))

    def finish(self) -> Split:
        """What is held back, once the text has ended: not a tag after all."""
        held, self._held = self._held, ""
        return Split(held, "") if self.thinking else Split("", held)


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` may begin a tag (either one)."""
    for size in range(min(len(text), len(THINK_END) - 1), 0, -1):
        tail = text[-size:]
        if THINK_START.startswith(tail) or THINK_END.startswith(tail):
            return size
    return 0
