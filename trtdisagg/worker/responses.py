"""OpenAI response bodies for completions and chat, whole and streamed. Pure functions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from trtdisagg.api.protocol import PerfMetrics, Usage, prune
from trtdisagg.worker.sampling import TokenLogprobs

TokenText = Callable[[int], str]


@attrs.frozen(kw_only=True)
class ResponseMeta:
    response_id: str
    created: int
    model: str
    chat: bool
    return_token_ids: bool


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
    }


def perf_json(perf: PerfMetrics | None) -> dict[str, Any] | None:
    return None if perf is None else prune(attrs.asdict(perf))


def completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None], text_of: TokenText
) -> dict[str, Any] | None:
    if not logprobs or all(lp is None for lp in logprobs):
        return None
    tokens, values, tops, offsets = [], [], [], []
    offset = 0
    for token, lp in zip(token_ids, logprobs, strict=True):
        text = text_of(token)
        tokens.append(text)
        values.append(lp.logprob if lp else None)
        tops.append({text_of(t): v for t, v in lp.top} if lp else None)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None], text_of: TokenText
) -> dict[str, Any] | None:
    if not logprobs or all(lp is None for lp in logprobs):
        return None

    def entry(token: int, value: float) -> dict[str, Any]:
        text = text_of(token)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    content = []
    for token, lp in zip(token_ids, logprobs, strict=True):
        if lp is None:
            continue
        item = entry(token, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in lp.top]
        content.append(item)
    return {"content": content}


def whole_body(
    meta: ResponseMeta,
    *,
    text: str,
    token_ids: Sequence[int],
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    usage: Usage,
    prompt_token_ids: Sequence[int] | None,
    extra_choice: dict[str, Any] | None = None,
    perf: PerfMetrics | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
    if meta.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if meta.return_token_ids:
        choice["token_ids"] = list(token_ids)
    if extra_choice:
        choice.update(extra_choice)
    body: dict[str, Any] = {
        "id": meta.response_id,
        "object": "chat.completion" if meta.chat else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage_json(usage),
    }
    if prompt_token_ids is not None:
        body["prompt_token_ids"] = list(prompt_token_ids)
    if perf is not None:
        body["perf_metrics"] = perf_json(perf)
    return body


def chunk_body(
    meta: ResponseMeta,
    *,
    text: str | None,
    token_ids: Sequence[int],
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    role: bool = False,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
    if meta.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    if meta.return_token_ids:
        choice["token_ids"] = list(token_ids)
    body: dict[str, Any] = {
        "id": meta.response_id,
        "object": "chat.completion.chunk" if meta.chat else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    }
    if extra:
        body.update(extra)
    return body


def usage_chunk(meta: ResponseMeta, usage: Usage, perf: PerfMetrics | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": meta.response_id,
        "object": "chat.completion.chunk" if meta.chat else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage_json(usage),
    }
    if perf is not None:
        body["perf_metrics"] = perf_json(perf)
    return body
