"""Answers with several choices, whole and streamed, and Responses answers. Pure functions."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from trtdisagg.api.chat import chat_messages
from trtdisagg.api.codec import SSE_DONE, parse_request, sse_event
from trtdisagg.api.errors import ApiError
from trtdisagg.api.fanout import choice_seed, plan_choices, prompt_body
from trtdisagg.api.protocol import ChatCompletionRequest, CompletionRequest
from trtdisagg.api.responses_api import ResponsesRequest, chat_body, responses_rejection
from trtdisagg.api.responses_events import ResponseHead, ResponsesStream, response_body
from trtdisagg.api.sse import DONE, SseSplitter, parse_event
from trtdisagg.coordinator.choices import ChoiceSseMerger, merge_answers
from trtdisagg.coordinator.split import ClientAsk
from trtdisagg.worker.http import responses
from trtdisagg.worker.http.prompt_scores import LOWEST_LOGPROB, prompt_scores, with_top
from trtdisagg.worker.token_logprobs import TokenLogprobs

META = responses.ResponseMeta(
    response_id="cmpl-1", created=1, model="tiny", chat=False, return_token_ids=True
)
CHAT_META = responses.ResponseMeta(
    response_id="chatcmpl-1", created=1, model="tiny", chat=True, return_token_ids=False
)


def text_of(token: int) -> str:
    return f"<{token}>"


def tokens(prompt_index: int, prompt: int, completion: int, cached: int = 0) -> Any:
    return responses.ChoiceTokens(
        prompt_index=prompt_index,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
    )


# ---- fan-out ----


def test_choices_follow_openai_order_and_seeds() -> None:
    req = parse_request({"prompt": ["a", "b", "c"], "n": 2, "seed": 7}, CompletionRequest)
    plans = plan_choices(req)
    assert [(p.index, p.prompt_index, p.sample_index) for p in plans] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1), (4, 2, 0), (5, 2, 1),
    ]  # fmt: skip
    assert [p.prompt for p in plans[::2]] == ["a", "b", "c"]
    tokens_req = parse_request({"prompt": [[5, 6], [7]]}, CompletionRequest)
    assert [p.prompt for p in plan_choices(tokens_req)] == [[5, 6], [7]]
    assert [p.seed for p in plans[:2]] == [7, choice_seed(7, 1)]
    assert plans[2].seed == plans[0].seed and plans[3].seed == plans[1].seed
    unseeded = plan_choices(parse_request({"prompt": "a", "n": 3}, CompletionRequest))
    assert [p.seed for p in unseeded] == [None] * 3


def test_choice_seeds_are_fixed_int64s() -> None:
    assert choice_seed(7, 0) == 7
    # The derivation is part of the API (docs/API.md): these values must never change.
    assert choice_seed(7, 1) == choice_seed(7, 1) != choice_seed(8, 1)
    seeds = {choice_seed(s, i) for s in (-(2**63), -1, 0, 1, 2**63 - 1) for i in range(1, 40)}
    assert len(seeds) == 5 * 39
    assert all(-(2**63) <= s < 2**63 for s in seeds)


def test_prompt_body_is_one_prompt_with_the_client_s_n_and_seed() -> None:
    raw = {"prompt": ["a", "b"], "n": 2, "best_of": 2, "seed": 3, "echo": True, "foo": 1}
    req = parse_request(raw, CompletionRequest)
    assert prompt_body(raw, "b", req) == {**raw, "prompt": "b"}
    assert raw["prompt"] == ["a", "b"]  # the client's body is untouched
    chat = {"messages": [{"role": "user", "content": "x"}], "n": 2}
    chat_req = parse_request(chat, ChatCompletionRequest)
    assert prompt_body(chat, [1], chat_req) == chat


# ---- the worker's answers ----


def test_usage_counts_each_prompt_once() -> None:
    usage = responses.total_usage(
        [tokens(0, 10, 3, cached=4), tokens(0, 10, 5, cached=9), tokens(1, 7, 2)]
    )
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (17, 10, 27)
    assert usage.prompt_tokens_details.cached_tokens == 4


def test_completion_logprobs_hold_the_sampled_token_and_offsets_go_on() -> None:
    lps = [TokenLogprobs(logprob=-0.5, top=()), TokenLogprobs(logprob=-2.0, top=((9, -0.1),))]
    built = responses.completion_logprobs([3, 44], lps, text_of, offset=10)
    assert built == {
        "tokens": ["<3>", "<44>"],
        "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"<3>": -0.5}, {"<9>": -0.1, "<44>": -2.0}],
        "text_offset": [10, 13],
    }
    assert responses.completion_logprobs([3], [None], text_of) is None


def test_whole_body_orders_choices_and_puts_prompt_ids_per_choice() -> None:
    results = [
        responses.ChoiceResult(
            index=i,
            text=f"t{i}",
            token_ids=[i],
            logprobs=None,
            finish_reason="length",
            prompt_token_ids=[i, i],
        )
        for i in (2, 0, 1)
    ]
    body = responses.whole_body(
        META, choices=results, usage=responses.total_usage([]), prompt_token_ids=None
    )
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["choices"][1] == {
        "index": 1,
        "logprobs": None,
        "finish_reason": "length",
        "text": "t1",
        "token_ids": [1],
        "prompt_token_ids": [1, 1],
    }
    assert "prompt_token_ids" not in body


def _assembler(meta: responses.ResponseMeta, **kw: Any) -> responses.StreamAssembler:
    choices = [
        responses.ChoiceStream(
            index=i,
            prompt_token_ids=[1, 2, 3],
            tokens=tokens(i // 2, 3, 0),
            echo=kw.pop("echo", None) if i == 1 else None,
        )
        for i in range(3)
    ]
    return responses.StreamAssembler(meta=meta, choices=choices, text_of=text_of, **kw)


def _output(
    assembler: responses.StreamAssembler, index: int, text: str, done: int, finish: str | None
) -> Any:
    return assembler.output(index, text=text, token_ids=[40 + done], logprobs=[None],
                            finish_reason=finish, tokens=tokens(index // 2, 3, done))  # fmt: skip


def test_a_chat_stream_opens_each_choice_with_its_role() -> None:
    assembler = _assembler(CHAT_META, include_usage=True)
    opening = assembler.opening()
    assert [c["choices"][0]["index"] for c in opening] == [0, 1, 2]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for c in opening)
    chunk = _output(assembler, 2, "hi", 1, None)
    assert chunk["choices"][0] == {"index": 2, "logprobs": None, "finish_reason": None,
                                   "delta": {"content": "hi"}}  # fmt: skip
    assert _output(assembler, 2, "", 2, None) is None  # nothing to show yet
    for i in range(3):
        assert _output(assembler, i, "!", 3, "stop")["choices"][0]["finish_reason"] == "stop"
    [usage] = assembler.closing(None)
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 6  # 2 prompts of 3
    assert usage["usage"]["completion_tokens"] == 9


def test_continuous_usage_and_echo_in_a_completion_stream() -> None:
    assembler = _assembler(META, continuous_usage=True, echo="Hello",
                           prompt_ids_in_first_chunk=True)  # fmt: skip
    [echo] = assembler.opening()
    assert echo["choices"][0]["index"] == 1 and echo["choices"][0]["text"] == "Hello"
    assert echo["prompt_token_ids"] == [1, 2, 3]
    assert echo["usage"]["completion_tokens"] == 0
    later = _output(assembler, 1, "x", 1, None)
    assert "prompt_token_ids" not in later  # only the choice's first chunk has them
    assert later["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                              "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    first_of_0 = _output(assembler, 0, "y", 1, None)
    assert first_of_0["prompt_token_ids"] == [1, 2, 3] and first_of_0["choices"][0]["index"] == 0
    assert assembler.closing(None) == []  # no include_usage: no usage chunk


def test_an_echo_with_logprobs_goes_out_with_the_first_output() -> None:
    assembler = _assembler(META, echo="Hello", echo_logprobs=True, echo_top=1, logprobs=True)
    assert assembler.opening() == []  # the prompt's logprobs come with the first output
    prompt = (TokenLogprobs(logprob=-1.0, top=((7, -0.5),)), TokenLogprobs(logprob=-2.0, top=()))
    first = assembler.output(1, text="x", token_ids=[9], finish_reason=None, tokens=tokens(0, 3, 1),
                             logprobs=[TokenLogprobs(logprob=-3.0, top=())],
                             prompt_logprobs=prompt)  # fmt: skip
    choice = first["choices"][0]
    assert choice["text"] == "Hellox"
    assert choice["logprobs"]["tokens"] == ["<1>", "<2>", "<3>", "<9>"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -2.0, -3.0]
    assert choice["logprobs"]["top_logprobs"][:2] == [None, {"<7>": -0.5, "<2>": -1.0}]
    assert choice["logprobs"]["text_offset"] == [0, 3, 6, 9]
    later = assembler.output(1, text="y", token_ids=[8], finish_reason="stop",
                             tokens=tokens(0, 3, 2), logprobs=[None])  # fmt: skip
    assert later["choices"][0]["text"] == "y"  # the echo went out once


# vLLM's prompt_logprobs of prompt [1, 2, 3]: token 2 is the most likely after 1, token 3 the
# third after [1, 2] (ranked below 7 and 8)
SCORED = (
    TokenLogprobs(logprob=-0.5, top=((2, -0.5), (6, -1.5)), rank=1),
    TokenLogprobs(logprob=-3.0, top=((7, -0.25), (8, -1.0)), rank=3),
)
SCORES = [
    None,
    {"2": {"logprob": -0.5, "rank": 1, "decoded_token": "<2>"},
     "6": {"logprob": -1.5, "rank": 2, "decoded_token": "<6>"}},
    {"3": {"logprob": -3.0, "rank": 3, "decoded_token": "<3>"},
     "7": {"logprob": -0.25, "rank": 1, "decoded_token": "<7>"},
     "8": {"logprob": -1.0, "rank": 2, "decoded_token": "<8>"}},
]  # fmt: skip


def test_prompt_logprobs_are_vllm_s_map_per_token() -> None:
    assert prompt_scores([1, 2, 3], SCORED, 2, text_of) == SCORES
    one = prompt_scores([1, 2, 3], SCORED, 1, text_of)
    assert [list(entry) for entry in one[1:]] == [["2"], ["3", "7"]]  # the token, then the top
    assert prompt_scores([1, 2, 3], None, 2, text_of) == [None, None, None]  # none computed
    masked = TokenLogprobs(logprob=float("-inf"), top=(), rank=5)
    assert prompt_scores([1, 9], [masked], 0, text_of)[1]["9"]["logprob"] == LOWEST_LOGPROB
    assert [len(lp.top) for lp in with_top(SCORED, 1) or ()] == [1, 1]  # echo's count


@pytest.mark.parametrize("meta", [META, CHAT_META], ids=["completions", "chat"])
def test_prompt_logprobs_stream_with_the_first_output(meta: responses.ResponseMeta) -> None:
    """Completions: in each choice's first chunk with an output (each choice has a prompt);
    chat: once, at the top of the answer's first such chunk. A first output whose text is held
    back still goes out with them, and the plain fast path never drops them."""
    assembler = _assembler(meta, prompt_scores=2)
    assembler.opening()
    kw: Any = dict(text="", token_ids=[9], logprobs=[None], finish_reason=None,
                   tokens=tokens(0, 3, 1), prompt_logprobs=SCORED)  # fmt: skip
    first = json.loads(assembler.output_event(0, **kw)[6:])  # type: ignore[index]
    where = first if meta.chat else first["choices"][0]
    assert where["prompt_logprobs"] == SCORES
    second = assembler.output(1, **kw)
    if meta.chat:
        assert second is None  # the answer's went out; this chunk shows nothing else
    else:
        assert second["choices"][0]["prompt_logprobs"] == SCORES
    later = assembler.output(0, **{**kw, "text": "x", "prompt_logprobs": None})
    assert "prompt_logprobs" not in later and "prompt_logprobs" not in later["choices"][0]


def test_whole_answers_carry_prompt_logprobs_per_choice_or_at_the_top() -> None:
    choice = responses.ChoiceResult(index=0, text="x", token_ids=[9], logprobs=None,
                                    finish_reason="stop", prompt_logprobs=SCORES)  # fmt: skip
    usage = responses.total_usage([tokens(0, 3, 1)])
    plain = responses.whole_body(META, choices=[choice], usage=usage, prompt_token_ids=None)
    assert plain["choices"][0]["prompt_logprobs"] == SCORES and "prompt_logprobs" not in plain
    chat = responses.whole_body(CHAT_META, choices=[choice], usage=usage, prompt_token_ids=None)
    assert chat["prompt_logprobs"] == SCORES and "prompt_logprobs" not in chat["choices"][0]


TEXTS = ("hi", "", 'q"uo\\te', "line\nbreak\ttab\x01", "h\u00e9 \u4e16\u754c \U0001f600", "\ud800")


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("ids", [False, True])
def test_a_plain_chunk_s_bytes_are_those_of_its_dict(chat: bool, ids: bool) -> None:
    """The plain chunks formatted from parts (`PlainChunk`) are, byte for byte, `sse_event` of
    the dict `output` makes, whatever the text holds; first chunks and chunks that show
    nothing agree too."""
    meta = responses.ResponseMeta(response_id='id-"\u00e9', created=17, model="m\\odel",
                                  chat=chat, return_token_ids=ids)  # fmt: skip
    formatted, walked = _assembler(meta, include_usage=True), _assembler(meta, include_usage=True)
    assert [sse_event(c) for c in walked.opening()] == list(map(sse_event, formatted.opening()))
    for done, (text, finish) in enumerate(
        [*((t, None) for t in TEXTS), ("end", "stop"), ("", "length")], start=1
    ):
        index = done % 3
        kw: Any = dict(text=text, token_ids=[40 + done, 7], logprobs=[None, None],
                       finish_reason=finish, tokens=tokens(index // 2, 3, done))  # fmt: skip
        chunk = walked.output(index, **kw)
        event = formatted.output_event(index, **kw)
        assert event == (None if chunk is None else sse_event(chunk)), (text, finish)
    assert formatted.closing(None) == walked.closing(None)
    assert [c.plain is not None for c in formatted.choices] == [True, True, True]


def test_a_chunk_with_logprobs_or_usage_is_not_plain() -> None:
    lp = TokenLogprobs(logprob=-1.5, top=((3, -0.25),))
    formatted, walked = _assembler(META, continuous_usage=True), _assembler(META)
    for assembler in (formatted, walked):
        assembler.opening()
    kw: Any = dict(text="a", token_ids=[5], finish_reason=None, tokens=tokens(0, 3, 1))
    for first in range(2):  # the first chunk, then a later one
        event = formatted.output_event(0, logprobs=[None], **kw)
        assert event is not None and b'"usage"' in event
        event = walked.output_event(0, logprobs=[lp], **kw)
        assert event is not None and json.loads(event[6:])["choices"][0]["logprobs"] == {
            "tokens": ["<5>"], "token_logprobs": [-1.5], "top_logprobs": [{"<3>": -0.25,
            "<5>": -1.5}], "text_offset": [3 * first]}  # fmt: skip


# ---- the coordinator's merge ----


def _answer(text: str, usage: tuple[int, int, int], ids: list[int] | None = None) -> dict[str, Any]:
    prompt, completion, cached = usage
    answer: dict[str, Any] = {
        "id": f"cmpl-{text}", "object": "text_completion", "created": 5, "model": "tiny",
        "choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                  "total_tokens": prompt + completion,
                  "prompt_tokens_details": {"cached_tokens": cached}},
    }  # fmt: skip
    if ids is not None:
        answer["prompt_token_ids"] = ids
    return answer


def _two_choices(answer: dict[str, Any], text: str) -> dict[str, Any]:
    """A prompt's answer with n = 2: a second choice after the first."""
    second = {**answer["choices"][0], "index": 1, "text": text}
    return {**answer, "choices": [*answer["choices"], second]}


def test_merge_answers() -> None:
    answers = [_two_choices(_answer("p0", (4, 5, 1), [1]), "p0b"),
               _two_choices(_answer("p1", (6, 6, 0), [2]), "p1b")]  # fmt: skip
    merged = merge_answers(answers, n=2)
    assert merged["id"] == "cmpl-p0" and "prompt_token_ids" not in merged
    assert [(c["index"], c["text"], c["prompt_token_ids"]) for c in merged["choices"]] == [
        (0, "p0", [1]), (1, "p0b", [1]), (2, "p1", [2]), (3, "p1b", [2]),
    ]  # fmt: skip
    assert merged["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 11,
        "total_tokens": 21,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    plain = merge_answers([_answer("p0", (4, 5, 1), None), _answer("p1", (6, 6, 0), None)], n=1)
    assert [c["index"] for c in plain["choices"]] == [0, 1]
    assert all("prompt_token_ids" not in c for c in plain["choices"])


def _sse_chunk(id_: str, text: str, finish: str | None = None, index: int = 0) -> bytes:
    return sse_event(
        {
            "id": id_,
            "object": "text_completion",
            "created": 5,
            "model": "tiny",
            "choices": [{"index": index, "text": text, "finish_reason": finish}],
        }
    )


def test_sse_merger_renumbers_choices_and_sums_usage() -> None:
    ask = ClientAsk.of({"stream": True, "stream_options": {"include_usage": True}}, chat=False)
    merger = ChoiceSseMerger(n=2, ask=ask)
    usage = {"id": "cmpl-B", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
             "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}}  # fmt: skip
    stream_b = _sse_chunk("cmpl-B", "x", index=1) + _sse_chunk("cmpl-B", "y", "length")
    out = merger.item(1, stream_b[:30]) + merger.item(1, stream_b[30:])
    out += merger.item(0, _sse_chunk("cmpl-A", "z", "stop") + sse_event(usage) + SSE_DONE)
    out += merger.item(1, sse_event(usage) + SSE_DONE)
    events = [json.loads(e[6:]) for e in out]
    assert [(e["id"], e["choices"][0]["index"], e["choices"][0]["text"]) for e in events] == [
        ("cmpl-B", 3, "x"), ("cmpl-B", 2, "y"), ("cmpl-B", 0, "z"),
    ]  # fmt: skip
    *usage_chunks, done = merger.closing()
    assert done == SSE_DONE
    [summed] = [json.loads(e[6:]) for e in usage_chunks]
    assert summed["choices"] == [] and summed["usage"]["prompt_tokens"] == 6
    assert summed["usage"]["completion_tokens"] == 4


def test_sse_merger_stops_at_an_error() -> None:
    merger = ChoiceSseMerger(n=2, ask=ClientAsk.of({}, chat=False))
    error = {"error": {"message": "boom", "type": "upstream_error", "code": 502}}
    assert merger.item(0, sse_event(error)) == [sse_event(error)]
    assert merger.stopped and merger.closing() == [SSE_DONE]


# ---- SSE ----


def test_sse_splitter_and_parse() -> None:
    splitter = SseSplitter()
    assert splitter.feed(b'data: {"a"') == []
    assert splitter.feed(b': 1}\n\ndata: [DONE]\n\n: comment\n\nevent: x\ndata: [1]\n\nda') == [
        b'data: {"a": 1}\n\n', b"data: [DONE]\n\n", b": comment\n\n", b"event: x\ndata: [1]\n\n",
    ]  # fmt: skip
    assert splitter.rest() == b"da"
    assert parse_event(b'data: {"a": 1}\n\n') == {"a": 1}
    assert parse_event(b"data: [DONE]\n\n") is DONE
    assert parse_event(b": comment\n\n") is None and parse_event(b"data: {oops\n\n") is None


# ---- Responses ----


def test_responses_input_becomes_chat() -> None:
    req = parse_request(
        {"input": [{"role": "developer", "content": "Be brief."},
                   {"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": "Hi "},
                                {"type": "input_text", "text": "there"}]},
                   {"role": "assistant", "content": [{"type": "output_text", "text": "Yo",
                                                      "annotations": []}]}],
         "instructions": "Answer in French.", "max_output_tokens": 9, "temperature": 0.5,
         "stream": True, "model": "tiny"},
        ResponsesRequest,
    )  # fmt: skip
    assert chat_body(req) == {
        "messages": [{"role": "system", "content": "Answer in French."},
                     {"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hi there"},
                     {"role": "assistant", "content": "Yo"}],
        "model": "tiny", "max_tokens": 9, "temperature": 0.5, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip


def test_responses_errors_name_the_responses_fields() -> None:
    body = {"error": {"message": "max_tokens: too many", "type": "invalid_request_error",
                      "code": 400, "param": "max_tokens"}}  # fmt: skip
    assert responses_rejection(body)["error"] == {
        "message": "max_output_tokens: too many", "type": "invalid_request_error",
        "code": 400, "param": "max_output_tokens",
    }  # fmt: skip


ASKED = ResponsesRequest(input="hi", instructions="x", max_output_tokens=4, metadata={"k": "v"})
HEAD = ResponseHead.of(ASKED, created_at=9, model="tiny")
CHAT_USAGE = {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
              "prompt_tokens_details": {"cached_tokens": 2}}  # fmt: skip
EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)


@pytest.mark.parametrize(("finish", "status"), [("stop", "completed"), ("length", "incomplete")])
def test_a_whole_response_has_openai_s_shape(finish: str, status: str) -> None:
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Bonjour"},
                         "finish_reason": finish}], "usage": CHAT_USAGE}  # fmt: skip
    parsed = Response.model_validate(response_body(HEAD, chat))
    assert parsed.output_text == "Bonjour" and parsed.status == status
    assert parsed.usage is not None
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens) == (7, 4)
    assert parsed.usage.total_tokens == 11 and parsed.usage.input_tokens_details.cached_tokens == 2
    assert parsed.metadata == {"k": "v"} and parsed.max_output_tokens == 4


def test_a_response_stream_has_openai_s_events() -> None:
    stream = ResponsesStream(head=HEAD)
    chunk = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    events = stream.start() + stream.feed(chunk)
    for text in ("Bon", "jour"):
        events += stream.feed({"choices": [{"index": 0, "delta": {"content": text}}]})
    events += stream.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events += stream.feed({"choices": [], "usage": CHAT_USAGE})
    events += stream.finish()
    parsed = [EVENTS.validate_python(e) for e in events]
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert parsed[6].text == "Bonjour"  # type: ignore[union-attr]
    completed = parsed[-1].response  # type: ignore[union-attr]
    assert completed.output_text == "Bonjour" and completed.usage.output_tokens == 4


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": CITY}  # fmt: skip
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip


def test_responses_function_tools_and_items_become_chat_s() -> None:
    """Flat function tools, tool_choice, and an agent's turn (its call, the function's output)
    as chat's tools and messages."""
    asked = ResponsesRequest(
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Oslo"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather",
             "arguments": '{"city": "Bergen"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "sun"}]},
        ],
        tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    )  # fmt: skip
    body = chat_body(asked)
    assert body["tools"] == [{"type": "function", "function": {
        k: WEATHER[k] for k in ("name", "description", "parameters")}}]  # fmt: skip
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False
    user, calls, rain, sun = body["messages"]
    assert user == {"role": "user", "content": "Weather in Oslo?"}
    assert calls["role"] == "assistant" and calls["content"] is None
    assert [c["id"] for c in calls["tool_calls"]] == ["call_1", "call_2"]  # one turn
    assert rain == {"role": "tool", "tool_call_id": "call_1", "content": "rain"}
    assert sun["content"] == "sun"
    parse_request(body, ChatCompletionRequest)  # chat takes it as it is
    for bad in ({"type": "web_search"}, {"type": "function"}):
        with pytest.raises(ApiError, match="tools"):
            chat_body(ResponsesRequest(input="x", tools=[bad]))
    for item in (
        {"type": "item_reference", "id": "x"},
        {"type": "function_call", "call_id": "c", "name": "f"},
    ):
        with pytest.raises(ApiError, match=r"input\[0\]"):
            chat_body(ResponsesRequest(input=[item]))


@pytest.mark.parametrize("text", ["", "Let me look."])
def test_a_response_with_calls_has_function_call_items(text: str) -> None:
    head = ResponseHead.of(ResponsesRequest(input="x", tools=[WEATHER]), created_at=9, model="m")
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text or None,
                         "tool_calls": [CALL]}, "finish_reason": "tool_calls"}],
            "usage": CHAT_USAGE}  # fmt: skip
    parsed = Response.model_validate(response_body(head, chat))
    kinds = [item.type for item in parsed.output]
    assert kinds == (["message", "function_call"] if text else ["function_call"])
    call = parsed.output[-1]
    assert call.type == "function_call" and call.call_id == "call_1"
    assert call.name == "get_weather" and call.arguments == '{"city": "Oslo"}'
    assert parsed.status == "completed" and parsed.tools[0].type == "function"

    stream = ResponsesStream(head=head)
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    events = stream.start() + stream.feed(role)
    if text:
        events += stream.feed({"choices": [{"index": 0, "delta": {"content": text}}]})
    events += stream.feed({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **CALL}]},
                                        "finish_reason": "tool_calls"}]})  # fmt: skip
    events += stream.feed({"choices": [], "usage": CHAT_USAGE}) + stream.finish()
    checked = [EVENTS.validate_python(e) for e in events]
    types = [e.type for e in checked]
    assert types.count("response.output_item.added") == (2 if text else 1)  # no empty message
    assert "response.function_call_arguments.delta" in types
    done = next(e for e in checked if e.type == "response.function_call_arguments.done")
    assert done.arguments == '{"city": "Oslo"}'  # type: ignore[union-attr]
    assert [e.sequence_number for e in checked] == list(range(len(checked)))
    final = checked[-1].response  # type: ignore[union-attr]
    assert [item.type for item in final.output] == kinds


def test_a_reasoning_model_s_thinking_is_a_reasoning_item_first() -> None:
    """chat's `reasoning_content` (docs/API.md, Reasoning) as a `reasoning` item ahead of the
    message, whole and streamed."""
    message = {"role": "assistant", "content": "4", "reasoning_content": "two and two"}
    chat = {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": CHAT_USAGE}  # fmt: skip
    parsed = Response.model_validate(response_body(HEAD, chat))
    thought, answer = parsed.output
    assert answer.type == "message"
    assert thought.type == "reasoning" and thought.content is not None
    assert [c.text for c in thought.content] == ["two and two"] and parsed.output_text == "4"

    stream = ResponsesStream(head=HEAD)
    events = stream.start()
    for delta in ({"role": "assistant", "content": ""}, {"reasoning_content": "two "},
                  {"reasoning_content": "and two"}, {"content": "4"}):  # fmt: skip
        events += stream.feed({"choices": [{"index": 0, "delta": delta}]})
    events += stream.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events += stream.finish()
    checked = [EVENTS.validate_python(e) for e in events]
    types = [e.type for e in checked]
    assert types[2:5] == ["response.output_item.added", "response.reasoning_text.delta",
                          "response.reasoning_text.delta"]  # fmt: skip
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.done")
    done = next(e for e in checked if e.type == "response.reasoning_text.done")
    assert done.text == "two and two"  # type: ignore[union-attr]
    final = checked[-1].response  # type: ignore[union-attr]
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == "4"


def test_a_reasoning_item_sent_back_is_the_thinking_of_the_turn_it_opens() -> None:
    """An agent's loop sends the last answer's items back: its reasoning item and its call
    (or its message) make one assistant turn, thinking and all, as a reasoning model's
    template reads it."""
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "weather, so call"}]}  # fmt: skip
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Oslo"}'}  # fmt: skip
    answer = {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Rain."}]}  # fmt: skip
    opaque = {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "x"}
    asked = ResponsesRequest(
        input=[{"role": "user", "content": "Oslo?"}, thought, call,
               {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
               {**thought, "content": [{"type": "reasoning_text", "text": "say it"}]}, answer,
               opaque, {"role": "user", "content": "Thanks"}],
        tools=[WEATHER],
    )  # fmt: skip
    body = chat_body(asked)
    user, calling, tool, answering, thanks = body["messages"]
    assert (user["role"], tool["role"]) == ("user", "tool")
    assert calling["reasoning_content"] == "weather, so call"
    assert [c["id"] for c in calling["tool_calls"]] == ["call_1"]
    assert answering == {"role": "assistant", "content": "Rain.", "reasoning_content": "say it"}
    assert thanks == {"role": "user", "content": "Thanks"}  # nothing to read: no turn
    parsed = parse_request(body, ChatCompletionRequest)
    assert chat_messages(parsed.messages or [])[3]["reasoning_content"] == "say it"
    with pytest.raises(ApiError, match=r"input\[0\]\.content\[0\]\.text"):
        chat_body(ResponsesRequest(input=[{"type": "reasoning", "content": [{"type": "x"}]}]))


def test_a_failed_response_stream() -> None:
    stream = ResponsesStream(head=HEAD)
    error = {"error": {"message": "boom", "type": "server_error", "code": 500}}
    events = stream.start() + stream.failed(error)
    parsed = [EVENTS.validate_python(e) for e in events]
    assert [e.type for e in parsed][-2:] == ["error", "response.failed"]
