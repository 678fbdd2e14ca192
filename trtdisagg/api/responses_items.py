"""The items of a Responses API answer, from a chat answer's parts. Pure.

Shapes follow the `openai` package's `openai.types.responses` models: a `message` item holding
one `output_text` part, a `function_call` item per chat tool call, and a `reasoning` item (its
`content` one `reasoning_text`) for a reasoning model's thinking (docs/API.md, Reasoning).
"""

from __future__ import annotations

import secrets
from typing import Any

Json = dict[str, Any]


def text_part(text: str, logprobs: list[Json] | None = None) -> Json:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def chat_logprobs(choice: Json) -> list[Json]:
    """A chat choice's (or chunk's) token logprobs, in the shape Responses gives them: chat's
    `logprobs.content` entries are already `{token, logprob, bytes, top_logprobs}`."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    return [entry for entry in content or [] if isinstance(entry, dict)]


def message_item(message_id: str, *, status: str, parts: list[Json]) -> Json:
    return {
        "type": "message",
        "id": message_id,
        "status": status,
        "role": "assistant",
        "content": parts,
    }


def response_usage(chat_usage: Json | None) -> Json | None:
    if not isinstance(chat_usage, dict):
        return None
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    details = chat_usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": int(details.get("cached_tokens") or 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": _reasoning_tokens(chat_usage)},
        "total_tokens": prompt + completion,
    }


def status_of(finish_reason: object) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def function_call_item(call: Json, status: str) -> Json:
    """A chat tool call (`{id, type, function: {name, arguments}}`) as an output item."""
    function = call.get("function") or {}
    return {
        "type": "function_call",
        "id": "fc_" + secrets.token_hex(12),
        "call_id": str(call.get("id") or ""),
        "name": str(function.get("name") or ""),
        "arguments": str(function.get("arguments") or ""),
        "status": status,
    }


def reasoning_item(item_id: str, *, status: str, text: str | None) -> Json:
    """A reasoning model's thinking; `text` None while it streams (its content comes at the
    end, as OpenAI's `output_item.added` carries none)."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": status}  # fmt: skip


def _reasoning_tokens(chat_usage: Json) -> int:
    details = chat_usage.get("completion_tokens_details")
    count = details.get("reasoning_tokens") if isinstance(details, dict) else None
    return count if isinstance(count, int) else 0
