"""Splitting a client request into ctx and gen legs, and merging their answers. Pure functions.

Bodies stay plain JSON mappings here: the coordinator forwards what the client sent (fields it does
not interpret included) and changes only what the split needs (DESIGN.md §2):

* ctx leg: ``stream: false``, no ``stream_options``, ``disaggregated_params = {request_type:
  context_only, disagg_request_id, transfer_key}`` (the id for logs; the key, 64 random bits per
  attempt, addresses the KV transfer: `ids.new_transfer_key`);
* gen leg: the client's body with ``prompt_token_ids`` from ctx and ``disaggregated_params = {...ctx
  choice's params, request_type: generation_only}``, read as a stream with token ids and usage
  (`gen_stream_request`) whatever the client asked: `ledger.py` rebuilds the client's answer;
* answer: usage is prompt and cached tokens from ctx, completion tokens from gen; the internal
  ``disaggregated_params`` and ``prompt_token_ids`` are removed unless the client asked for them.
"""

from __future__ import annotations

import copy
from typing import Any, Final

import attrs

from trtdisagg.api.codec import SSE_DONE, sse_event
from trtdisagg.errors import TrtDisaggError

Json = dict[str, Any]

CONTEXT_ONLY: Final = "context_only"
GENERATION_ONLY: Final = "generation_only"


@attrs.frozen
class AttemptIds:
    """One attempt's names for its request: the id (logs, ordering, routers' reservations) and
    the transfer key, random, that its KV moves under (and `/disagg/release` names)."""

    request_id: int
    transfer_key: int


class UpstreamProtocolError(TrtDisaggError):
    """A worker answered 2xx with a body the coordinator cannot use (HTTP 502)."""


@attrs.frozen(kw_only=True)
class ClientAsk:
    """What the client asked for that changes how answers are shaped."""

    chat: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    return_perf_metrics: bool
    sent_disaggregated_params: bool
    # the answer has a logprobs entry per token, ctx's first one too (best_of > n ranks its
    # candidates by them)
    logprobs: bool = False
    prompt_logprobs: bool = False  # vLLM's: ctx computes them, and its answer carries them
    include_reasoning: bool = True  # vLLM's: false drops a reasoning model's thinking

    @classmethod
    def of(cls, body: Json, *, chat: bool) -> ClientAsk:
        options = body.get("stream_options") or {}
        logprobs = body.get("logprobs")
        best_of, n = body.get("best_of"), body.get("n")
        ranks = isinstance(best_of, int) and best_of > (n if isinstance(n, int) else 1)
        return cls(
            chat=chat,
            stream=bool(body.get("stream")),
            include_usage=bool(options.get("include_usage")),
            return_token_ids=bool(body.get("return_token_ids")),
            return_perf_metrics=bool(body.get("return_perf_metrics")),
            sent_disaggregated_params=body.get("disaggregated_params") is not None,
            logprobs=(logprobs is True if chat else logprobs not in (None, False)) or ranks,
            prompt_logprobs=body.get("prompt_logprobs") is not None,
            include_reasoning=body.get("include_reasoning") is not False,
        )


def client_disagg_request_id(body: Json) -> int | None:
    """A positive ``disaggregated_params.disagg_request_id`` the client chose, else None."""
    params = body.get("disaggregated_params")
    if not isinstance(params, dict):
        return None
    value = params.get("disagg_request_id")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def ctx_request(body: Json, ids: AttemptIds) -> Json:
    out = copy.copy(body)
    out["stream"] = False
    out.pop("stream_options", None)
    out["disaggregated_params"] = {
        "request_type": CONTEXT_ONLY,
        "disagg_request_id": ids.request_id,
        "transfer_key": ids.transfer_key,
    }
    return out


def local_request(body: Json) -> Json:
    """A plain aggregated request for gen alone (conditional disaggregation)."""
    out = copy.copy(body)
    out.pop("disaggregated_params", None)
    return out


@attrs.frozen(kw_only=True)
class CtxResult:
    """A validated ctx answer."""

    body: Json
    server: str  # the ctx server that answered, and holds the KV until a gen takes it
    finished: bool
    """ctx already finished the request (stop token, max_tokens 1): no gen leg runs."""
    params: Json
    prompt_token_ids: list[int]
    usage: Json | None
    perf_metrics: Json | None


def parse_ctx_response(data: object, *, server: str) -> CtxResult:
    """Check a ctx answer has what the gen leg needs.

    One prompt's answer: one choice per `n`, choice 0 carrying the params (one prefill and one
    KV transfer serve every choice); finished when every choice is.

    Raises:
        UpstreamProtocolError: no choices, or (for an unfinished request) no
            ``disaggregated_params`` with ``ctx_request_id``/``transfer_key`` on choice 0, or
            no ``prompt_token_ids``.
    """
    if not isinstance(data, dict):
        raise UpstreamProtocolError(f"ctx server {server}: answer is not a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise UpstreamProtocolError(f"ctx server {server}: expected one choice per n")
    if not all(isinstance(choice, dict) for choice in choices):
        raise UpstreamProtocolError(f"ctx server {server}: a choice is not a JSON object")
    choice = choices[0]
    finished = all(c.get("finish_reason") is not None for c in choices)
    params = choice.get("disaggregated_params")
    prompt_ids = data.get("prompt_token_ids")
    if not finished:
        if not isinstance(params, dict):
            raise UpstreamProtocolError(f"ctx server {server}: choice has no disaggregated_params")
        for key in ("ctx_request_id", "transfer_key"):
            if params.get(key) is None:
                raise UpstreamProtocolError(
                    f"ctx server {server}: disaggregated_params.{key} is missing"
                )
        if not isinstance(prompt_ids, list):
            raise UpstreamProtocolError(f"ctx server {server}: answer has no prompt_token_ids")
    usage = data.get("usage")
    perf = data.get("perf_metrics")
    return CtxResult(
        body=data,
        server=server,
        finished=finished,
        params=params if isinstance(params, dict) else {},
        prompt_token_ids=list(prompt_ids) if isinstance(prompt_ids, list) else [],
        usage=usage if isinstance(usage, dict) else None,
        perf_metrics=perf if isinstance(perf, dict) else None,
    )


def ahead_tokens(body: Json, ask: ClientAsk, ctx: CtxResult) -> list[int] | None:
    """ctx's first tokens, one per choice, when the client's stream may start with them before
    gen sends anything (`Ledger.lead_with`), else None.

    The client then has its first token when ctx answers, not after gen admitted the request
    and received the KV. Only for a streamed answer whose first chunks are those tokens alone:
    no echo, no prompt logprobs, no per-chunk usage, no tool-call parsing, no ``best_of``
    candidates, and not a client that drives the split itself.
    """
    if not ask.stream or ask.sent_disaggregated_params:
        return None
    if body.get("echo") or body.get("prompt_logprobs") is not None:
        return None
    n, best_of = body.get("n") or 1, body.get("best_of")
    if isinstance(best_of, int) and best_of > n:  # candidates ranked, sent whole at the end
        return None
    if (body.get("stream_options") or {}).get("continuous_usage_stats"):
        return None
    if body.get("tools") and body.get("tool_choice") != "none":
        return None
    choices = ctx.body.get("choices")
    if not isinstance(choices, list) or len(choices) != n:
        return None
    key = "first_gen_tokens_by_choice" if len(choices) > 1 else "first_gen_tokens"
    firsts = ctx.params.get(key)
    if not isinstance(firsts, list) or len(firsts) != len(choices):
        return None
    for whole, token in zip(choices, firsts, strict=True):
        if ask.chat:
            message = whole.get("message")
            text = message.get("content") if isinstance(message, dict) else None
        else:
            text = whole.get("text")
        if not isinstance(text, str) or not isinstance(token, int):
            return None
    return firsts


def gen_request(body: Json, ctx: CtxResult) -> Json:
    out = copy.copy(body)
    out["prompt_token_ids"] = ctx.prompt_token_ids
    out["disaggregated_params"] = {**ctx.params, "request_type": GENERATION_ONLY}
    return out


def gen_stream_request(body: Json) -> Json:
    """A gen leg's body as the coordinator sends it: always a stream, with token ids and a usage
    chunk, so that it knows what it relayed (`ledger.py`); the client's answer, streamed or
    whole, is rebuilt from it without them unless it asked."""
    out = copy.copy(body)
    options = dict(out.get("stream_options") or {}) if out.get("stream") else {}
    options["include_usage"] = True
    out["stream"] = True
    out["stream_options"] = options
    out["return_token_ids"] = True
    return out


def gen_first_request(
    body: Json,
    ids: AttemptIds,
    *,
    ctx_info_endpoint: str | None,
    prompt_token_ids: list[int] | None,
) -> Json:
    """The gen leg of ``schedule_style: generation_first``, posted before ctx answers: gen only
    knows where the KV will come from (ctx's info endpoint) and the key it will come under."""
    out = copy.copy(body)
    if prompt_token_ids is not None:
        out["prompt_token_ids"] = prompt_token_ids
    out["disaggregated_params"] = {
        "request_type": GENERATION_ONLY,
        "ctx_request_id": ids.request_id,
        "disagg_request_id": ids.request_id,
        "transfer_key": ids.transfer_key,
        "ctx_info_endpoint": ctx_info_endpoint,
        "schedule_style": "generation_first",
    }
    return out


# ---- merging answers ----


def merge_usage(ctx_usage: Json | None, gen_usage: Json | None) -> Json | None:
    """Prompt and cached tokens from ctx, completion tokens (and their details: a reasoning
    model's `reasoning_tokens`) from gen."""
    if gen_usage is None:
        return ctx_usage
    if ctx_usage is None:
        return gen_usage
    prompt = int(ctx_usage.get("prompt_tokens") or gen_usage.get("prompt_tokens") or 0)
    completion = int(gen_usage.get("completion_tokens", 0))
    details = ctx_usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens", 0) or 0)
    merged: Json = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if isinstance(gen_usage.get("completion_tokens_details"), dict):
        merged["completion_tokens_details"] = gen_usage["completion_tokens_details"]
    return merged


def _strip(body: Json, ask: ClientAsk) -> bool:
    """Remove what the client did not ask for; True when something was removed."""
    removed: list[object] = []
    if not ask.sent_disaggregated_params:
        removed.append(body.pop("disaggregated_params", None))
        for choice in body.get("choices") or []:
            if isinstance(choice, dict):
                removed.append(choice.pop("disaggregated_params", None))
    if not ask.return_token_ids:
        removed.append(body.pop("prompt_token_ids", None))
    if not ask.return_perf_metrics:
        removed.append(body.pop("perf_metrics", None))
    return any(r is not None for r in removed)


def _copy_for_strip(answer: Json) -> Json:
    """A copy of `answer` that `_strip` and the usage merge may change without touching the
    original: the top level and each choice are copied, the rest is shared. (A deep copy of a
    whole answer, prompt token ids included, cost ~0.1 ms per request.)"""
    out = dict(answer)
    choices = out.get("choices")
    if isinstance(choices, list):
        out["choices"] = [dict(c) if isinstance(c, dict) else c for c in choices]
    return out


def final_answer(
    gen: Json, *, ctx_usage: Json | None, ask: ClientAsk, perf_metrics: Json | None
) -> Json:
    """The client's non-streaming answer from gen's (or gen-alone's) whole answer."""
    out = _copy_for_strip(gen)
    if ctx_usage is not None:
        out["usage"] = merge_usage(ctx_usage, out.get("usage"))
    _strip(out, ask)
    if ask.return_perf_metrics and perf_metrics is not None:
        out["perf_metrics"] = perf_metrics
    return out


def ctx_answer(ctx: CtxResult, *, ask: ClientAsk, perf_metrics: Json | None) -> Json:
    """The client's answer when ctx already finished the request."""
    return final_answer(ctx.body, ctx_usage=None, ask=ask, perf_metrics=perf_metrics)


def answer_as_sse(answer: Json, ask: ClientAsk) -> list[bytes]:
    """A whole answer re-framed as SSE events, one per choice, for a streaming client whose
    request ctx finished."""
    head: Json = {k: answer[k] for k in ("id", "created", "model") if k in answer}
    head["object"] = "chat.completion.chunk" if ask.chat else "text_completion"
    events: list[bytes] = []
    for whole in answer["choices"]:
        choice = dict(whole)
        if ask.chat:
            message = choice.pop("message", {}) or {}
            delta = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                delta["tool_calls"] = [
                    {"index": i, **call} for i, call in enumerate(message["tool_calls"])
                ]
            choice["delta"] = delta
        event: Json = {**head, "choices": [choice]}
        if not events and "prompt_logprobs" in answer:  # chat's, the answer's
            event["prompt_logprobs"] = answer["prompt_logprobs"]
        events.append(sse_event(event))
    extra: Json = {k: answer[k] for k in ("perf_metrics",) if k in answer}
    if ask.include_usage and "usage" in answer:
        events.append(sse_event({**head, "choices": [], "usage": answer["usage"], **extra}))
    elif extra:
        events.append(sse_event({**head, "choices": [], **extra}))
    events.append(SSE_DONE)
    return events
