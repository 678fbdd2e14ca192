"""A whole (non-streaming) answer assembled from what its ledger relayed, in the shape of a
worker's whole answer. Pure."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from trtdisagg.coordinator.ledger import ChoiceLedger, Ledger

Json = dict[str, Any]

COMPLETION_LOGPROB_LISTS: Final = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def whole_body(ledger: Ledger) -> Json:
    head = dict(ledger.head or {})
    head["object"] = "chat.completion" if ledger.ask.chat else "text_completion"
    body: Json = {
        **head,
        "choices": [_choice(ledger, state) for state in ledger.choices],
        "usage": ledger.usage or ledger.counted_usage(),
    }
    if ledger.ask.return_token_ids and ledger.prompt_token_ids is not None:
        body["prompt_token_ids"] = list(ledger.prompt_token_ids)
    if ledger.prompt_logprobs is not None:
        body["prompt_logprobs"] = ledger.prompt_logprobs
    if ledger.perf is not None:
        body["perf_metrics"] = ledger.perf(ledger.gen_perf)
    return body


def _choice(ledger: Ledger, state: ChoiceLedger) -> Json:
    choice: Json = {
        "index": state.index,
        "logprobs": _merged_logprobs(ledger, state),
        "finish_reason": state.finish_reason,
    }
    text = state.opening_text + state.text
    if ledger.ask.chat:
        message: Json = {"role": "assistant", "content": text}
        if state.tool_calls:
            message["content"] = text or None
            message["tool_calls"] = [
                {k: v for k, v in call.items() if k != "index"} for call in state.tool_calls
            ]
        if state.tells_reasoning:  # a reasoning model's answer: its thinking, apart
            message["reasoning_content"] = state.reasoning or None
        choice["message"] = message
    else:
        choice["text"] = text
        if state.prompt_logprobs is not None:
            choice["prompt_logprobs"] = state.prompt_logprobs
    if ledger.ask.return_token_ids:
        choice["token_ids"] = list(state.token_ids)
    return choice


def _merged_logprobs(ledger: Ledger, state: ChoiceLedger) -> Json | None:
    if not state.logprobs:
        return None
    if ledger.ask.chat:
        return {"content": [e for lp in state.logprobs for e in lp.get("content") or ()]}
    return {
        key: [v for lp in state.logprobs for v in lp.get(key) or ()]
        for key in COMPLETION_LOGPROB_LISTS
    }
