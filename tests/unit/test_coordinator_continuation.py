"""The continuation request and the text state carried across a migration, as pure functions.

`worker_run` follows the worker's per-token rules (`Executor._after_token`) with the worker's own
detokenizer and stop strings; a continuation cut anywhere must give the text, tokens and finish
reason of one uninterrupted run.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from typing import Any

import pytest

from trtdisagg.api.fanout import choice_seed
from trtdisagg.coordinator.continuation import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    TextReplay,
    continuation_request,
    continuation_seed,
    stop_strings,
)
from trtdisagg.worker.stopping import StopStrings
from trtdisagg.worker.tokenization import IncrementalDetokenizer

EOS = 0
# Byte-level vocabulary: some tokens are half of a multi-byte character, some spell stop strings.
VOCAB: dict[int, bytes] = {
    EOS: b"",
    1: b" the",
    2: b" cat",
    3: b"S",
    4: b"TO",
    5: b"P",
    6: "é".encode()[:1],
    7: "é".encode()[1:],
    8: b" sat",
    9: b"\n",
    10: "日".encode()[:2],
    11: "日".encode()[2:],
    12: b"END",
}


class ByteTokenizer:
    """The surface of `worker.tokenization.Tokenizer` that the detokenizer uses."""

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        kept = [i for i in ids if not (skip_special_tokens and i == EOS)]
        return b"".join(VOCAB[i] for i in kept).decode("utf-8", errors="replace")


def detokenizer() -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer=ByteTokenizer())  # type: ignore[arg-type]


def worker_run(
    tokens: Sequence[int], stops: tuple[str, ...], max_tokens: int, include: bool = False
) -> tuple[list[int], list[str], str | None]:
    """What one worker streams for `tokens` (sampled in this order): tokens and text per chunk,
    and the finish reason, by the rules of `Executor._after_token` (`include`: the request's
    `include_stop_str_in_output`)."""
    detok, stop = detokenizer(), StopStrings(stops=stops, include=include)
    sent: list[int] = []
    texts: list[str] = []
    for token in tokens:
        sent.append(token)
        reason = None
        text = ""
        if token == EOS:
            reason = "stop"
        else:
            text = stop.feed(detok.add(token))
            if stop.stopped:
                reason = "stop"
        if reason is None and len(sent) >= max_tokens:
            reason = "length"
        if reason is not None and not stop.stopped:
            text += stop.feed(detok.flush())
            if not stop.stopped:
                text += stop.flush()
        texts.append(text)
        if reason is not None:
            return sent, texts, reason
    return sent, texts, None


def resumed_run(
    tokens: Sequence[int], stops: tuple[str, ...], max_tokens: int, cut: int, include: bool = False
) -> tuple[list[int], str, str | None]:
    """The first leg streams `cut` tokens and dies; the continuation's worker, asked without stop
    strings and for the tokens left, streams the rest; `TextReplay` turns them into text."""
    sent, texts, reason = worker_run(tokens[:cut], stops, max_tokens, include)
    if reason is not None:
        return sent, "".join(texts), reason
    replay = TextReplay.rebuild(detokenizer(), stops, sent, "".join(texts), include_stop=include)
    assert replay is not None
    rest, _, worker_reason = worker_run(tokens[cut:], (), max_tokens - len(sent))
    out_tokens, text = list(sent), "".join(texts)
    for i, token in enumerate(rest):
        finish = worker_reason if i == len(rest) - 1 else None
        chunk_text, reason, kept = replay.step([token], finish)
        out_tokens += [token][:kept]
        text += chunk_text
        if reason is not None:
            return out_tokens, text, reason
    return out_tokens, text, None


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stops", [(), ("STOP",), ("STOP", "é"), ("\n",), ("日END",)])
def test_a_continuation_cut_anywhere_gives_the_uninterrupted_text(
    stops: tuple[str, ...], include: bool
) -> None:
    rng = random.Random(zlib.crc32("|".join(stops).encode()))
    for _ in range(300):
        length = rng.randint(1, 14)
        tokens = [rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]) for _ in range(length)]
        if rng.random() < 0.3:
            tokens.insert(rng.randrange(len(tokens) + 1), EOS)
        max_tokens = rng.randint(1, len(tokens) + 2)
        whole_tokens, texts, whole_reason = worker_run(tokens, stops, max_tokens, include)
        whole_text = "".join(texts)
        if include and whole_reason == "stop" and tokens[len(whole_tokens) - 1] != EOS:
            assert whole_text.endswith(stops), (tokens, stops)  # the stop string kept
        for cut in range(1, len(whole_tokens) + 1):
            got = resumed_run(tokens, stops, max_tokens, cut, include)
            assert got == (whole_tokens, whole_text, whole_reason), (tokens, stops, cut)


def test_held_back_text_comes_out_after_the_cut() -> None:
    """The dead leg held back "ST" (maybe "STOP") and half of "é": the continuation releases
    them when the next tokens settle it, and a stop string across the cut ends the answer."""
    sent = [1, 3, 4]  # " the", "S", "TO": " the" relayed, "STO" held back
    replay = TextReplay.rebuild(detokenizer(), ("STOP",), sent, " the")
    assert replay is not None
    assert replay.step([5], None) == ("", "stop", 1)  # "P" completes "STOP" across the cut
    replay = TextReplay.rebuild(detokenizer(), ("STOP",), sent, " the")
    assert replay is not None
    assert replay.step([2], None) == ("STO cat", None, 1)
    replay = TextReplay.rebuild(detokenizer(), (), [1, 6], " the")  # half of "é" held back
    assert replay is not None
    assert replay.step([7], None) == ("é", None, 1)
    assert replay.step([8], "length") == (" sat", "length", 1)


def test_stop_strings_end_at_the_earliest_match_before_or_after_it() -> None:
    for include in (False, True):
        stops = StopStrings(stops=("cd", "bc", "b"), include=include)
        assert stops.feed("a b") == ("a b" if include else "a ") and stops.stopped
        assert stops.feed("c") == ""  # nothing after a match
        stops = StopStrings(stops=("bc", "cd"), include=include)
        assert stops.feed("a b") == "a "  # "b" may begin "bc": held back
        assert stops.feed("cd") == ("bc" if include else "") and stops.stopped  # "bc" is first
    first_listed = StopStrings(stops=("b", "bc"), include=True)
    assert first_listed.feed("abc") == "ab"  # two at one place: the first listed


def test_a_replay_that_disagrees_with_the_relayed_text_is_refused() -> None:
    assert TextReplay.rebuild(detokenizer(), (), [1, 2], " the dog") is None
    assert TextReplay.rebuild(detokenizer(), ("cat",), [1, 2], " the ") is None  # already stopped


BODY: dict[str, Any] = {
    "model": "tiny", "prompt": "hi", "max_tokens": 10, "min_tokens": 4, "seed": 7,
    "temperature": 0.8, "stop": ["STOP"], "echo": True, "n": 1, "best_of": 1,
    "stream": False, "return_token_ids": False, "logprobs": 2,
    "disaggregated_params": {"request_type": "generation_only"},
    "stream_options": {"continuous_usage_stats": True}, "truncate_prompt_tokens": 2,
}  # fmt: skip


def test_continuation_request_asks_for_what_is_left() -> None:
    out = continuation_request(
        BODY, chat=False, prompt_token_ids=[5, 6], sent=[7, 8, 9], stops_here=True,
        max_seq_len=64,
    )  # fmt: skip
    assert out["prompt_token_ids"] == [5, 6, 7, 8, 9]
    assert out["max_tokens"] == 7 and out["min_tokens"] == 1
    assert out["seed"] == continuation_seed(7, 3) != 7
    assert out["stream"] is True and out["return_token_ids"] is True
    assert out["stream_options"] == {"include_usage": True}
    for gone in ("stop", "echo", "best_of", "disaggregated_params", "truncate_prompt_tokens"):
        assert gone not in out
    assert out["logprobs"] == 2 and out["temperature"] == 0.8 and out["prompt"] == "hi"
    assert BODY["max_tokens"] == 10 and "stop" in BODY  # the client's body is not changed
    kept = continuation_request(
        BODY, chat=False, prompt_token_ids=[5], sent=[], stops_here=False, max_seq_len=None
    )
    assert kept["stop"] == ["STOP"] and kept["seed"] == 7 and kept["max_tokens"] == 10


def test_a_choice_s_continuation_samples_from_that_choice_s_seed() -> None:
    """Choice i of an answer samples with choice_seed(seed, i): its continuation goes on from
    that seed, and one before its first token draws exactly as the undisturbed choice did."""
    request = {**BODY, "n": 3}

    def seed(choice: int, sent: list[int]) -> int:
        return int(
            continuation_request(
                request, chat=False, prompt_token_ids=[5], sent=sent, stops_here=False,
                max_seq_len=None, choice=choice,
            )["seed"]
        )  # fmt: skip

    assert [seed(i, []) for i in range(3)] == [choice_seed(7, i) for i in range(3)]
    assert seed(2, [8, 9]) == continuation_seed(choice_seed(7, 2), 2)
    assert len({seed(i, [8, 9]) for i in range(3)}) == 3  # no two choices draw alike


def test_continuation_request_defaults_and_chat_limits() -> None:
    plain = {"prompt": "hi"}
    out = continuation_request(
        plain, chat=False, prompt_token_ids=[1] * 60, sent=[2], stops_here=False, max_seq_len=64
    )
    assert out["max_tokens"] == min(DEFAULT_COMPLETION_MAX_TOKENS, 64 - 60) - 1
    out = continuation_request(
        plain, chat=False, prompt_token_ids=[1], sent=[2, 3], stops_here=False, max_seq_len=None
    )
    assert out["max_tokens"] == DEFAULT_COMPLETION_MAX_TOKENS - 2
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9}
    out = continuation_request(
        chat, chat=True, prompt_token_ids=[1], sent=[2, 3], stops_here=False, max_seq_len=None
    )
    assert out["max_completion_tokens"] == 7 and "max_tokens" not in out
    out = continuation_request(
        {"messages": []}, chat=True, prompt_token_ids=[1], sent=[2], stops_here=False,
        max_seq_len=None,
    )  # fmt: skip
    assert "max_tokens" not in out  # the worker's default, the context left, already counts


def test_stop_strings_and_seeds() -> None:
    assert stop_strings({"stop": "x"}) == ("x",)
    assert stop_strings({"stop": ["a", "", "b"]}) == ("a", "b")
    assert stop_strings({}) == ()
    assert continuation_seed(7, 3) == continuation_seed(7, 3) != continuation_seed(7, 4)
    assert -(2**63) <= continuation_seed(-5, 100) < 2**63
