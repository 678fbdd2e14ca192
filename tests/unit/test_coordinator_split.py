"""The request split and the answer merge, as pure functions."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trtdisagg.coordinator.perf import PhaseClock
from trtdisagg.coordinator.split import (
    AttemptIds,
    ClientAsk,
    UpstreamProtocolError,
    ahead_tokens,
    answer_as_sse,
    client_disagg_request_id,
    ctx_answer,
    ctx_request,
    final_answer,
    gen_first_request,
    gen_request,
    local_request,
    merge_usage,
    parse_ctx_response,
)

CLIENT = {
    "model": "tiny", "prompt": "hi", "max_tokens": 8, "stream": True,
    "stream_options": {"include_usage": True}, "temperature": 0, "logit_bias": {"1": 2},
}  # fmt: skip
PARAMS = {
    "request_type": "context_only", "first_gen_tokens": [42], "ctx_request_id": 7,
    "disagg_request_id": 1 << 41, "transfer_key": 2**64 - 3, "ctx_dp_rank": 0,
    "ctx_info_endpoint": "tcp://x:1",
}  # fmt: skip


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached},
    }  # fmt: skip


def ctx_body(finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny",
        "choices": [{"index": 0, "text": " the", "finish_reason": finish,
                     "disaggregated_params": dict(PARAMS)}],
        "usage": usage(10, 1, cached=4), "prompt_token_ids": list(range(10)),
    }  # fmt: skip


def ask(**kw: Any) -> ClientAsk:
    base = dict(chat=False, stream=False, include_usage=False, return_token_ids=False,
                return_perf_metrics=False, sent_disaggregated_params=False)  # fmt: skip
    return ClientAsk(**{**base, **kw})


def test_ctx_request_is_non_streaming_context_only() -> None:
    body = ctx_request(CLIENT, AttemptIds(123, 2**63 + 5))
    assert body["stream"] is False and "stream_options" not in body
    assert body["disaggregated_params"] == {
        "request_type": "context_only",
        "disagg_request_id": 123,
        "transfer_key": 2**63 + 5,
    }
    assert body["logit_bias"] == {"1": 2}  # fields the coordinator does not know are forwarded
    assert CLIENT["stream"] is True  # the client's body is not modified


def test_gen_request_carries_ctx_params_and_prompt_ids() -> None:
    ctx = parse_ctx_response(ctx_body(), server="c")
    body = gen_request(CLIENT, ctx)
    assert body["prompt_token_ids"] == list(range(10))
    assert body["disaggregated_params"] == {**PARAMS, "request_type": "generation_only"}
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_gen_first_request_and_local_request() -> None:
    ids = AttemptIds(99, 12345)
    body = gen_first_request(CLIENT, ids, ctx_info_endpoint="tcp://e", prompt_token_ids=[1, 2])
    params = body["disaggregated_params"]
    assert params["request_type"] == "generation_only"
    assert params["ctx_request_id"] == params["disagg_request_id"] == 99
    assert params["transfer_key"] == 12345
    assert body["prompt_token_ids"] == [1, 2]
    local = local_request({**CLIENT, "disaggregated_params": {"disagg_request_id": 5}})
    assert "disaggregated_params" not in local


def test_client_disagg_request_id() -> None:
    assert client_disagg_request_id({"disaggregated_params": {"disagg_request_id": 77}}) == 77
    assert client_disagg_request_id({"disaggregated_params": {"disagg_request_id": 0}}) is None
    assert client_disagg_request_id({"disaggregated_params": {"disagg_request_id": True}}) is None
    assert client_disagg_request_id({}) is None


def test_parse_ctx_response_checks() -> None:
    assert parse_ctx_response(ctx_body("stop"), server="c").finished
    bad = ctx_body()
    del bad["choices"][0]["disaggregated_params"]
    with pytest.raises(UpstreamProtocolError, match="no disaggregated_params"):
        parse_ctx_response(bad, server="c")
    bad = ctx_body()
    bad["choices"][0]["disaggregated_params"]["ctx_request_id"] = None
    with pytest.raises(UpstreamProtocolError, match="ctx_request_id is missing"):
        parse_ctx_response(bad, server="c")
    bad = ctx_body()
    del bad["prompt_token_ids"]
    with pytest.raises(UpstreamProtocolError, match="no prompt_token_ids"):
        parse_ctx_response(bad, server="c")
    with pytest.raises(UpstreamProtocolError, match="one choice per n"):
        parse_ctx_response({**ctx_body(), "choices": []}, server="c")
    with pytest.raises(UpstreamProtocolError, match="not a JSON object"):
        parse_ctx_response({**ctx_body(), "choices": [ctx_body()["choices"][0], 3]}, server="c")
    # n choices: finished only when every choice is; the params come from choice 0.
    two = ctx_body("stop")
    two["choices"].append({**two["choices"][0], "index": 1, "finish_reason": None})
    assert not parse_ctx_response(two, server="c").finished
    two["choices"][1]["finish_reason"] = "length"
    assert parse_ctx_response(two, server="c").finished
    # A finished ctx answer needs neither params nor prompt ids.
    done = ctx_body("length")
    del done["prompt_token_ids"]
    assert parse_ctx_response(done, server="c").finished


def test_merge_usage_prompt_and_cached_from_ctx_completion_from_gen() -> None:
    merged = merge_usage(usage(10, 1, cached=4), usage(10, 8, cached=0))
    assert merged == usage(10, 8, cached=4)
    assert merge_usage(None, usage(3, 2)) == usage(3, 2)


def gen_answer() -> dict[str, Any]:
    return {
        "id": "cmpl-2", "object": "text_completion", "created": 2, "model": "tiny",
        "choices": [{"index": 0, "text": " the end", "finish_reason": "length",
                     "disaggregated_params": {"request_type": "generation_only"}}],
        "usage": usage(10, 8), "prompt_token_ids": list(range(10)), "perf_metrics": {"decode_s": 1},
    }  # fmt: skip


def test_final_answer_strips_internal_fields() -> None:
    gen = gen_answer()
    out = final_answer(gen, ctx_usage=usage(10, 1, 4), ask=ask(), perf_metrics=None)
    assert "disaggregated_params" not in out["choices"][0]
    assert "prompt_token_ids" not in out and "perf_metrics" not in out
    assert out["usage"] == usage(10, 8, cached=4)
    assert gen == gen_answer()  # gen's answer itself is untouched (retries may reuse it)


def test_final_answer_keeps_what_the_client_asked_for() -> None:
    out = final_answer(
        gen_answer(),
        ctx_usage=usage(10, 1),
        ask=ask(return_token_ids=True, sent_disaggregated_params=True, return_perf_metrics=True),
        perf_metrics={"e2e_s": 1.0},
    )
    assert out["choices"][0]["disaggregated_params"] == {"request_type": "generation_only"}
    assert out["prompt_token_ids"] == list(range(10))
    assert out["perf_metrics"] == {"e2e_s": 1.0}


def test_ctx_answer_when_ctx_finished() -> None:
    out = ctx_answer(parse_ctx_response(ctx_body("stop"), server="c"), ask=ask(), perf_metrics=None)
    assert out["choices"][0]["text"] == " the"
    assert "disaggregated_params" not in out["choices"][0] and "prompt_token_ids" not in out
    assert out["usage"] == usage(10, 1, cached=4)


def events(raw: bytes) -> list[Any]:
    out = []
    for block in raw.split(b"\n\n"):
        if block:
            assert block.startswith(b"data: ")
            payload = block[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def test_answer_as_sse_for_chat() -> None:
    answer = {"id": "c", "created": 1, "model": "tiny", "object": "chat.completion",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "hey"},
                           "finish_reason": "stop"}], "usage": usage(3, 1)}  # fmt: skip
    out = events(b"".join(answer_as_sse(answer, ask(chat=True, stream=True, include_usage=True))))
    assert out[0]["object"] == "chat.completion.chunk"
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": "hey"}
    assert out[1]["usage"] == usage(3, 1) and out[1]["choices"] == []
    assert out[2] == "[DONE]"


def test_phase_clock() -> None:
    clock = PhaseClock(arrival=0.0, ctx_start=0.1, ctx_end=0.3, gen_start=0.31,
                       gen_first_token=0.5, gen_end=1.0)  # fmt: skip
    merged = clock.merged(ctx={"prefill_s": 0.1}, gen={"kv_transfer_s": 0.05}, now=1.1)
    assert merged["coordinator_queue_s"] == pytest.approx(0.1)
    assert merged["ctx_s"] == pytest.approx(0.2)
    assert merged["gen_first_token_s"] == pytest.approx(0.19)
    assert merged["decode_s"] == pytest.approx(0.5)
    assert merged["e2e_s"] == pytest.approx(1.1)
    assert merged["kv_transfer_s"] == 0.05 and merged["ctx"] == {"prefill_s": 0.1}
    # Non-streaming: gen's own first-token and decode times stand in.
    clock = PhaseClock(arrival=0.0, gen_start=0.0)
    merged = clock.merged(ctx=None, gen={"first_token_s": 0.2, "decode_s": 0.4}, now=1.0)
    assert merged["gen_first_token_s"] == 0.2 and merged["decode_s"] == 0.4
    assert "ctx_s" not in merged


def test_a_stream_of_one_choice_leads_with_ctx_s_first_token() -> None:
    ctx = parse_ctx_response(ctx_body(), server="http://ctx")
    assert ahead_tokens(CLIENT, ClientAsk.of(CLIENT, chat=False), ctx) == [42]
    chat_client = {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "tools": [{"type": "function"}], "tool_choice": "none",
    }  # fmt: skip
    chat_ctx = ctx_body()
    chat_ctx["choices"][0]["message"] = {"role": "assistant", "content": " the"}
    del chat_ctx["choices"][0]["text"]
    chat = parse_ctx_response(chat_ctx, server="http://ctx")
    assert ahead_tokens(chat_client, ClientAsk.of(chat_client, chat=True), chat) == [42]


@pytest.mark.parametrize(
    "change",
    [
        {"stream": False},  # a whole answer: nothing to stream early
        {"echo": True},  # the echo goes first
        {"prompt_logprobs": 1},
        {"n": 2},  # ctx answered one choice
        {"best_of": 3},  # candidates ranked at the end
        {"stream_options": {"continuous_usage_stats": True}},
        {"tools": [{"type": "function"}]},  # tool-call parsing may hold the text
        {"disaggregated_params": {"request_type": "context_only"}},
    ],
)
def test_what_keeps_the_first_token_for_gen_s_leg(change: dict[str, Any]) -> None:
    body = {**CLIENT, **change}
    ctx = parse_ctx_response(ctx_body(), server="http://ctx")
    assert ahead_tokens(body, ClientAsk.of(body, chat=False), ctx) is None


def test_no_lead_from_a_ctx_answer_without_one_token_and_its_text() -> None:
    client_ask = ClientAsk.of(CLIENT, chat=False)
    two = ctx_body()
    two["choices"][0]["disaggregated_params"]["first_gen_tokens"] = [42, 43]
    no_text = ctx_body()
    del no_text["choices"][0]["text"]
    for answer in (two, no_text):
        assert ahead_tokens(CLIENT, client_ask, parse_ctx_response(answer, server="x")) is None
    chat_ask = ClientAsk.of({**CLIENT, "messages": []}, chat=True)  # a text, not a message
    assert ahead_tokens(CLIENT, chat_ask, parse_ctx_response(ctx_body(), server="x")) is None


def test_each_of_n_choices_leads_with_its_first_token() -> None:
    body = {**CLIENT, "n": 2}
    answer = ctx_body()
    answer["choices"].append({"index": 1, "text": " a", "finish_reason": None})
    answer["choices"][0]["disaggregated_params"]["first_gen_tokens_by_choice"] = [42, 7]
    ctx = parse_ctx_response(answer, server="http://ctx")
    assert ahead_tokens(body, ClientAsk.of(body, chat=False), ctx) == [42, 7]
    assert ahead_tokens({**body, "best_of": 2}, ClientAsk.of(body, chat=False), ctx) == [42, 7]
