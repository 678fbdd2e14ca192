"""The relay's accounting (`Ledger`): what the client gets from gen's events, leg after leg."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from trtdisagg.api.reasoning import ReasoningSplitter
from trtdisagg.coordinator.ledger import Ledger, StreamError
from trtdisagg.coordinator.split import ClientAsk

HEAD = {"id": "cmpl-a", "object": "text_completion", "created": 1, "model": "tiny"}
OTHER_HEAD = {"id": "cmpl-b", "object": "text_completion", "created": 9, "model": "tiny"}
CHAT_HEAD = {"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}


def ask(**kw: Any) -> ClientAsk:
    base = dict(chat=False, stream=True, include_usage=False, return_token_ids=False,
                return_perf_metrics=False, sent_disaggregated_params=False)  # fmt: skip
    return ClientAsk(**{**base, **kw})


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached},
    }  # fmt: skip


def chunk(
    text: str,
    ids: list[int],
    *,
    finish: str | None = None,
    head: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    choice = {"index": 0, "logprobs": None, "finish_reason": finish, "text": text,
              "token_ids": ids}  # fmt: skip
    return {**(head or HEAD), "choices": [choice], **extra}


def tail(completion: int, prompt: int = 5, head: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**(head or HEAD), "choices": [], "usage": usage(prompt, completion)}


def choices(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for e in events for c in e["choices"]]


def test_first_leg_strips_ids_drops_silent_chunks_and_merges_ctx_usage() -> None:
    ledger = Ledger(ask=ask(include_usage=True), ctx_usage=usage(5, 1, cached=3))
    out = ledger.gen_event(chunk(" a", [10], prompt_token_ids=[1, 2, 3, 4, 5]))
    assert out == [{**HEAD, "choices": [{"index": 0, "logprobs": None, "finish_reason": None,
                                         "text": " a"}]}]  # fmt: skip
    assert ledger.prompt_token_ids == [1, 2, 3, 4, 5]
    assert ledger.gen_event(chunk("", [11])) == []  # its text is held back: nothing to show
    out = ledger.gen_event(chunk(" bc", [12], finish="length"))
    assert choices(out)[0]["finish_reason"] == "length" and choices(out)[0]["text"] == " bc"
    (closing,) = ledger.gen_event(tail(3))
    assert closing == {**HEAD, "choices": [], "usage": usage(5, 3, cached=3)}
    assert ledger.token_ids == [10, 11, 12] and ledger.text == " a bc"
    assert ledger.closing() == []  # once


def test_ids_and_logprobs_show_what_a_client_asked_for() -> None:
    ledger = Ledger(ask=ask(return_token_ids=True))
    (first,) = ledger.gen_event(chunk(" a", [10], prompt_token_ids=[1, 2]))
    assert first["prompt_token_ids"] == [1, 2] and first["choices"][0]["token_ids"] == [10]
    (held,) = ledger.gen_event(chunk("", [11]))  # ids asked for: the chunk shows them
    assert held["choices"][0]["token_ids"] == [11] and "prompt_token_ids" not in held


def test_a_continuation_continues_the_stream_without_duplicates_or_gaps() -> None:
    lp = {"tokens": [" a"], "token_logprobs": [-0.1], "top_logprobs": [{" a": -0.1}],
          "text_offset": [0]}  # fmt: skip
    ledger = Ledger(ask=ask(return_token_ids=True, include_usage=True, logprobs=True),
                    ctx_usage=usage(5, 1, cached=2), prompt_token_ids=[1, 2, 3, 4, 5])  # fmt: skip
    ledger.gen_event({**HEAD, "choices": [{"index": 0, "logprobs": lp, "finish_reason": None,
                                           "text": " a", "token_ids": [10]}]})  # fmt: skip
    ledger.start_continuation(None)
    lp2 = {"tokens": [" bb"], "token_logprobs": [-0.2], "top_logprobs": [{" bb": -0.2}],
           "text_offset": [0]}  # fmt: skip
    (out,) = ledger.gen_event({**OTHER_HEAD, "prompt_token_ids": [1, 2, 3, 4, 5, 10],
                               "choices": [{"index": 0, "logprobs": lp2, "finish_reason": None,
                                            "text": " bb", "token_ids": [11]}]})  # fmt: skip
    assert {k: out[k] for k in HEAD} == HEAD  # the first leg's id, created, model
    assert out["prompt_token_ids"] == [1, 2, 3, 4, 5]  # the original prompt, shown once
    assert out["choices"][0]["logprobs"]["text_offset"] == [2]  # after " a"
    ledger.gen_event({**OTHER_HEAD, "choices": [{"index": 0, "logprobs": None,
                      "finish_reason": "length", "text": "", "token_ids": [12]}]})  # fmt: skip
    (closing,) = ledger.gen_event(tail(2, prompt=6, head=OTHER_HEAD))
    assert closing["usage"] == usage(5, 3, cached=2)  # the prompt once, every token relayed
    assert closing["id"] == "cmpl-a"
    assert ledger.token_ids == [10, 11, 12]
    whole = ledger.whole()
    assert whole["choices"][0]["token_ids"] == [10, 11, 12]
    assert whole["choices"][0]["logprobs"]["text_offset"] == [0, 2]
    assert whole["choices"][0]["text"] == " a bb" and whole["usage"] == usage(5, 3, cached=2)


def test_a_chat_continuation_drops_its_role_chunk_and_counts_usage() -> None:
    def delta(
        content: str, ids: list[int], *, role: bool = False, finish: str | None = None
    ) -> dict[str, Any]:
        d = {"role": "assistant", "content": content} if role else {"content": content}
        return {**CHAT_HEAD, "choices": [{"index": 0, "logprobs": None, "delta": d,
                                          "finish_reason": finish, "token_ids": ids}]}  # fmt: skip

    ledger = Ledger(ask=ask(chat=True, include_usage=True), prompt_token_ids=[1, 2, 3])
    (opening,) = ledger.gen_event(delta("", [], role=True))
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    ledger.gen_event({**delta("Hi", [7]), "usage": usage(3, 1)})
    ledger.start_continuation(None)
    assert ledger.gen_event(delta("", [], role=True)) == []  # the client has its role chunk
    (more,) = ledger.gen_event(delta(" there", [8], finish="stop"))
    assert more["choices"][0]["delta"] == {"content": " there"}
    assert "token_ids" not in more["choices"][0]
    (closing,) = ledger.gen_event({**tail(1, prompt=4), "object": "chat.completion.chunk"})
    assert closing["usage"] == usage(3, 2)
    whole = ledger.whole()
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hi there"}
    assert whole["choices"][0]["finish_reason"] == "stop"


SCORES = [None, {"5": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}]  # prompt_logprobs


def test_prompt_logprobs_pass_through_and_stay_in_the_whole_answer() -> None:
    """vLLM's prompt_logprobs: completions' in the choice, chat's at the top, from the first
    leg's first chunk, which goes out for them even when its text is held back."""
    ledger = Ledger(ask=ask())
    assert ledger.gen_event(chunk("", [11], prompt_logprobs=SCORES)) == []  # chat's place
    ledger = Ledger(ask=ask())
    held = chunk("", [11])
    held["choices"][0]["prompt_logprobs"] = SCORES
    (out,) = ledger.gen_event(held)
    assert out["choices"][0]["prompt_logprobs"] == SCORES
    ledger.start_continuation(None)
    again = chunk(" a", [12], finish="stop")
    again["choices"][0]["prompt_logprobs"] = [None, None, None]  # a continuation's own prompt
    (out,) = ledger.gen_event(again)
    assert "prompt_logprobs" not in out["choices"][0]
    assert ledger.whole()["choices"][0]["prompt_logprobs"] == SCORES

    chat = Ledger(ask=ask(chat=True, stream=False))
    role = {**CHAT_HEAD, "prompt_logprobs": SCORES, "choices": [{"index": 0, "logprobs": None,
            "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}]}  # fmt: skip
    (out,) = chat.gen_event(role)
    assert out["prompt_logprobs"] == SCORES
    whole = chat.whole()
    assert whole["prompt_logprobs"] == SCORES and "prompt_logprobs" not in whole["choices"][0]


def test_a_stop_string_found_by_the_coordinator_ends_the_answer() -> None:
    class StopAtSecond:
        def step(self, ids: Any, finish: str | None) -> tuple[str, str | None, int]:
            return "x", "stop", 1

    ledger = Ledger(ask=ask(return_token_ids=True, include_usage=True), prompt_token_ids=[1])
    ledger.gen_event(chunk(" a", [10]))
    ledger.start_continuation(StopAtSecond())
    (out,) = ledger.gen_event(chunk("ignored", [11, 12]))
    assert out["choices"][0]["text"] == "x" and out["choices"][0]["token_ids"] == [11]
    assert ledger.finished_here and ledger.finish_reason == "stop"
    assert ledger.gen_event(chunk(" late", [13])) == []  # nothing after the end
    (closing,) = ledger.closing()
    assert closing["usage"] == usage(1, 2)


def test_perf_metrics_ride_in_the_usage_chunk_or_their_own() -> None:
    seen: list[Any] = []

    def perf(gen: dict[str, Any] | None) -> dict[str, Any]:
        seen.append(gen)
        return {"merged": True}

    ledger = Ledger(ask=ask(return_perf_metrics=True), perf=perf)
    ledger.gen_event(chunk(" a", [10], finish="length"))
    (own,) = ledger.gen_event({**tail(1), "perf_metrics": {"decode_s": 2}})
    assert own == {**HEAD, "choices": [], "perf_metrics": {"merged": True}}
    assert seen == [{"decode_s": 2}]
    ledger = Ledger(ask=ask(return_perf_metrics=True, include_usage=True), perf=perf)
    ledger.gen_event(chunk(" a", [10], finish="length"))
    (both,) = ledger.gen_event(tail(1))
    assert both["perf_metrics"] == {"merged": True} and both["usage"] == usage(5, 1)


def test_an_error_event_raises_with_gen_s_body() -> None:
    ledger = Ledger(ask=ask())
    body = {"error": {"message": "KV transfer failed", "type": "upstream_error", "code": 502}}
    with pytest.raises(StreamError, match="KV transfer failed") as info:
        ledger.gen_event(body)
    assert info.value.body == body and info.value.status == 502
    assert ledger.gen_event("not json") == [] and ledger.gen_event({"choices": []}) == []


def test_an_answer_of_several_choices_keeps_each_apart() -> None:
    """A gen leg answers every choice of its prompt (n), interleaved: each is accounted on its
    own, the answer is whole once each is, and a chat choice's calls come back whole."""

    def delta(index: int, ids: list[int], finish: str | None = None, **d: Any) -> dict[str, Any]:
        return {**CHAT_HEAD, "choices": [{"index": index, "logprobs": None, "delta": d,
                                          "finish_reason": finish, "token_ids": ids}]}  # fmt: skip

    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}  # fmt: skip
    ledger = Ledger(ask=ask(chat=True, include_usage=True), num_choices=2)
    ledger.gen_event(delta(1, [], role="assistant", content=""))
    ledger.gen_event(delta(0, [], role="assistant", content=""))
    (shown,) = ledger.gen_event(delta(1, [7, 8], content="", tool_calls=[call]))
    assert shown["choices"][0]["delta"] == {"tool_calls": [call]}
    ledger.gen_event(delta(0, [5], content="Hi"))
    assert ledger.gen_event(delta(9, [1], content="x")) == []  # no such choice
    ledger.gen_event(delta(1, [], "tool_calls", content=""))
    assert ledger.finish_reason is None and ledger.token_ids == [5, 7, 8]
    ledger.gen_event(delta(0, [6], "stop", content="!"))
    assert ledger.finish_reason is not None
    (closing,) = ledger.gen_event({**tail(3, prompt=4), "object": "chat.completion.chunk"})
    assert closing["usage"] == usage(4, 3)
    first, second = ledger.whole()["choices"]
    assert first["message"] == {"role": "assistant", "content": "Hi!"}
    assert first["finish_reason"] == "stop" and second["finish_reason"] == "tool_calls"
    made = {k: v for k, v in call.items() if k != "index"}
    assert second["message"] == {"role": "assistant", "content": None, "tool_calls": [made]}


def test_each_choice_continues_on_a_leg_of_its_own() -> None:
    """After the leg of two choices died, each continues on a leg whose events say index 0:
    they are told as that choice's, each after its own tokens, and the usage counts the prompt
    once and every token of both."""

    def event(index: int, text: str, ids: list[int], finish: str | None = None) -> Any:
        return {**OTHER_HEAD, "choices": [{"index": index, "logprobs": None, "text": text,
                                           "finish_reason": finish, "token_ids": ids}]}  # fmt: skip

    ledger = Ledger(ask=ask(return_token_ids=True, include_usage=True), num_choices=2,
                    ctx_usage=usage(5, 1), prompt_token_ids=[1, 2, 3, 4, 5])  # fmt: skip
    ledger.gen_event({**event(0, " a", [10]), **HEAD})
    ledger.gen_event({**event(1, " b", [20]), **HEAD})
    ledger.gen_event({**event(1, " c", [21]), **HEAD})
    ledger.start_continuation(None, 1)
    ledger.start_continuation(None, 0)
    (one,) = ledger.gen_event(event(0, " d", [22], "length"), 1)
    assert one["choices"][0]["index"] == 1 and one["id"] == "cmpl-a"
    assert ledger.gen_event(tail(1, prompt=7, head=OTHER_HEAD), 1) == []  # choice 0 runs on
    (zero,) = ledger.gen_event(event(0, " e", [11], "length"), 0)
    assert zero["choices"][0]["index"] == 0
    (closing,) = ledger.gen_event(tail(1, prompt=6, head=OTHER_HEAD), 0)
    assert closing["usage"] == usage(5, 5)
    first, second = ledger.whole()["choices"]
    assert (first["token_ids"], first["text"]) == ([10, 11], " a e")
    assert (second["token_ids"], second["text"]) == ([20, 21, 22], " b c d")


class _Texts:
    """A continuation's text source that gives each token's text as written (tags and all)."""

    def __init__(self, texts: dict[int, str]) -> None:
        self.texts = texts

    def step(self, ids: Sequence[int], finish: str | None) -> tuple[str, str | None, int]:
        return "".join(self.texts[t] for t in ids), finish, len(ids)


@pytest.mark.parametrize("include", [True, False])
def test_a_rebuilt_continuation_tells_thinking_apart_where_the_first_leg_left_it(
    include: bool,
) -> None:
    """The coordinator rebuilds a continuation's text (it has the tokenizer): a reasoning
    model's is told apart here, from the thinking state the relayed text left (a `</think>`
    split across two chunks included), dropped when the client asked for no thinking."""
    texts = {1: " so", 2: " four</", 3: "think>", 4: "4"}
    ledger = Ledger(ask=ask(chat=True, include_reasoning=include))
    head = {**CHAT_HEAD, "choices": []}
    ledger.gen_event({**head, "choices": [{"index": 0, "finish_reason": None, "token_ids": [9],
                      "delta": {"role": "assistant", "reasoning_content": "Hmm"}}]})  # fmt: skip
    ledger.start_continuation(_Texts(texts), 0, ReasoningSplitter(thinking=True))
    deltas = []
    for token, finish in ((1, None), (2, None), (3, None), (4, "length")):
        event = {**head, "choices": [{"index": 0, "finish_reason": finish, "token_ids": [token],
                                      "delta": {"content": "worker's own"}}]}  # fmt: skip
        deltas += [e["choices"][0]["delta"] for e in ledger.gen_event(event)]
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    assert thought == (" so four" if include else "")
    assert "".join(d.get("content", "") for d in deltas) == "4"
    (choice,) = ledger.whole()["choices"]
    assert choice["message"]["content"] == "4"
    assert choice["message"]["reasoning_content"] == ("Hmm so four" if include else "Hmm")


CTX_HEAD = {"id": "cmpl-ctx", "object": "text_completion", "created": 3, "model": "tiny"}


def completion_logprobs(tokens: list[str], offsets: list[int]) -> dict[str, Any]:
    return {"tokens": tokens, "token_logprobs": [-0.5] * len(tokens),
            "top_logprobs": [{t: -0.5} for t in tokens], "text_offset": offsets}  # fmt: skip


def test_ctx_s_first_token_leads_and_gen_s_repeat_of_it_is_cut() -> None:
    ledger = Ledger(ask=ask(return_token_ids=True, include_usage=True, logprobs=True),
                    ctx_usage=usage(5, 1), prompt_token_ids=[1, 2, 3, 4, 5])  # fmt: skip
    answer = {**CTX_HEAD, "choices": [{"index": 0, "text": " a", "finish_reason": None,
              "logprobs": completion_logprobs([" a"], [0])}]}  # fmt: skip
    (lead,) = ledger.lead_with(answer, [10])
    assert lead == {**CTX_HEAD, "prompt_token_ids": [1, 2, 3, 4, 5], "choices": [{
        "index": 0, "text": " a", "token_ids": [10], "finish_reason": None,
        "logprobs": completion_logprobs([" a"], [0])}]}  # fmt: skip
    # gen's first event repeats ctx's token, here joined with the next one
    both = {"index": 0, "text": " a b", "token_ids": [10, 11], "finish_reason": None,
            "logprobs": completion_logprobs([" a", " b"], [0, 2])}  # fmt: skip
    (out,) = ledger.gen_event({**OTHER_HEAD, "choices": [both], "prompt_token_ids": [1, 2, 3]})
    assert out == {**CTX_HEAD, "choices": [{
        "index": 0, "text": " b", "token_ids": [11], "finish_reason": None,
        "logprobs": completion_logprobs([" b"], [2])}]}  # fmt: skip
    ledger.gen_event(chunk(" c", [12], finish="length", head=OTHER_HEAD))
    (closing,) = ledger.gen_event(tail(3, head=OTHER_HEAD))
    assert closing == {**CTX_HEAD, "choices": [], "usage": usage(5, 3)}
    assert ledger.token_ids == [10, 11, 12] and ledger.text == " a b c"
    assert ledger.gen_tokens == 3  # gen's leg sent every one of them
    whole = ledger.choices[0]
    assert [lp["text_offset"] for lp in whole.logprobs] == [[0], [2]]  # (" c" had none)


def test_in_chat_the_lead_is_a_role_chunk_then_the_token_and_gen_s_repeats_vanish() -> None:
    ledger = Ledger(ask=ask(chat=True))
    answer = {"id": "chatcmpl-ctx", "object": "chat.completion", "created": 3, "model": "tiny",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                           "logprobs": None, "finish_reason": None}]}  # fmt: skip
    role, token = ledger.lead_with(answer, [7])
    head = {**CHAT_HEAD, "id": "chatcmpl-ctx", "created": 3}
    empty = {"index": 0, "logprobs": None, "finish_reason": None}
    assert role == {**head, "choices": [{**empty, "delta": {"role": "assistant", "content": ""}}]}
    assert token == {**head, "choices": [{**empty, "delta": {"content": "Hi"}}]}

    def delta(content: str, ids: list[int], **extra: Any) -> dict[str, Any]:
        choice = {"index": 0, "logprobs": None, "finish_reason": None, "token_ids": ids,
                  "delta": {**extra, "content": content}}  # fmt: skip
        return {**CHAT_HEAD, "choices": [choice]}

    assert ledger.gen_event(delta("", [], role="assistant")) == []  # the client has the role
    assert ledger.gen_event(delta("Hi", [7])) == []  # and the token
    (out,) = ledger.gen_event(delta(" there", [8]))
    assert out["id"] == "chatcmpl-ctx" and out["choices"][0]["delta"] == {"content": " there"}
    assert ledger.text == "Hi there" and ledger.token_ids == [7, 8]


def test_text_ctx_held_back_or_gen_split_differently_is_cut_once() -> None:
    held = Ledger(ask=ask())  # ctx's token ends in part of a character: no text yet
    held.lead_with({**CTX_HEAD, "choices": [{"index": 0, "text": ""}]}, [200])
    assert held.gen_event(chunk("", [200])) == []
    assert choices(held.gen_event(chunk("\u00e9", [201])))[0]["text"] == "\u00e9"
    split = Ledger(ask=ask())
    split.lead_with({**CTX_HEAD, "choices": [{"index": 0, "text": "ab"}]}, [5])
    assert split.gen_event(chunk("a", [5])) == []  # gen gave part of it with the token
    assert choices(split.gen_event(chunk("bc", [6])))[0]["text"] == "c"
    assert split.text == "abc"


@pytest.mark.parametrize(
    ("gen_text", "gen_ids", "error"),
    [(" a", [11], "first token [11] is not ctx's [10]"), (" x", [10], "first text")],
)
def test_a_first_leg_that_does_not_repeat_ctx_s_token_is_an_error(
    gen_text: str, gen_ids: list[int], error: str
) -> None:
    ledger = Ledger(ask=ask())
    ledger.lead_with({**CTX_HEAD, "choices": [{"index": 0, "text": " a"}]}, [10])
    with pytest.raises(StreamError, match=error.replace("[", r"\[").replace("]", r"\]")):
        ledger.gen_event(chunk(gen_text, gen_ids))


def test_a_continuation_after_the_lead_starts_after_ctx_s_token() -> None:
    ledger = Ledger(ask=ask(return_token_ids=True))
    ledger.lead_with({**CTX_HEAD, "choices": [{"index": 0, "text": " a"}]}, [10])
    ledger.start_continuation(None)  # the first leg failed before it repeated the token
    (out,) = ledger.gen_event(chunk(" b", [11], head=OTHER_HEAD))
    assert out["choices"][0]["text"] == " b" and out["choices"][0]["token_ids"] == [11]
    assert ledger.token_ids == [10, 11] and ledger.gen_tokens == 1


def test_each_choice_leads_with_its_own_first_token() -> None:
    ledger = Ledger(ask=ask(chat=True, return_token_ids=True), num_choices=2,
                    prompt_token_ids=[1, 2])  # fmt: skip
    wholes = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None}
              for i, text in enumerate(["Hi", "Yo"])]  # fmt: skip
    answer = {"id": "chatcmpl-ctx", "created": 3, "model": "tiny", "choices": wholes}
    events = ledger.lead_with(answer, [7, 9])
    assert [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in events] == [
        (0, {"role": "assistant", "content": ""}), (0, {"content": "Hi"}),
        (1, {"role": "assistant", "content": ""}), (1, {"content": "Yo"}),
    ]  # fmt: skip
    assert events[0]["prompt_token_ids"] == [1, 2]
    assert all("prompt_token_ids" not in e for e in events[1:])
    assert [e["choices"][0]["token_ids"] for e in events] == [[], [7], [], [9]]

    def delta(index: int, content: str, ids: list[int]) -> dict[str, Any]:
        choice = {"index": index, "logprobs": None, "finish_reason": None, "token_ids": ids,
                  "delta": {"content": content}}  # fmt: skip
        return {**CHAT_HEAD, "choices": [choice]}

    (out,) = ledger.gen_event(delta(1, "Yo!", [9, 4]))  # choice 1's repeat, joined
    assert out["choices"][0]["delta"] == {"content": "!"} and out["choices"][0]["token_ids"] == [4]
    assert ledger.gen_event(delta(0, "Hi", [7])) == []
    assert [c.text for c in ledger.choices] == ["Hi", "Yo!"]
