"""A chat completion's answer as a Responses API answer: the whole `Response`, or its events.

Pure: `response_body` turns a whole chat answer into a `Response` object; `ResponsesStream` turns
chat chunks (one choice, the usage chunk last) into the events of a Response stream, each with
its `sequence_number`: `response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, one `response.output_text.delta` per text chunk, then
`response.output_text.done`, `response.content_part.done`, `response.output_item.done` and
`response.completed` (`response.incomplete` when `max_output_tokens` ended the text, as
OpenAI does). Shapes follow the `openai` package's `openai.types.responses` models.

A chat tool call becomes a `function_call` output item (its `call_id` the chat call's id),
streamed as `response.output_item.added`, `response.function_call_arguments.delta`, then at the
end `response.function_call_arguments.done` and `response.output_item.done`. A reasoning
model's thinking (chat's `reasoning_content`) becomes a `reasoning` item, streamed as
`response.output_item.added`, `response.reasoning_text.delta`, then `response.reasoning_text.done`
and `response.output_item.done`. The message item opens at the first text, so an answer that
only calls has no empty message and one that thinks first has its thinking first; output
indices follow the order items open in (items are in the items module).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import attrs

from trtdisagg.api.responses_api import ResponsesRequest
from trtdisagg.api.responses_items import (
    chat_logprobs,
    function_call_item,
    message_item,
    reasoning_item,
    response_usage,
    status_of,
    text_part,
)

Json = dict[str, Any]


@attrs.frozen(kw_only=True)
class ResponseHead:
    """What every Response of one request repeats."""

    response_id: str
    message_id: str
    reasoning_id: str
    created_at: int
    model: str
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    metadata: dict[str, Any] | None
    tools: list[Json] = attrs.Factory(list)  # as asked (flat function tools)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True

    @classmethod
    def of(cls, asked: ResponsesRequest, *, created_at: int, model: str) -> ResponseHead:
        return cls(
            response_id="resp_" + secrets.token_hex(12),
            message_id="msg_" + secrets.token_hex(12),
            reasoning_id="rs_" + secrets.token_hex(12),
            created_at=created_at,
            model=model,
            instructions=asked.instructions,
            max_output_tokens=asked.max_output_tokens,
            temperature=asked.temperature,
            top_p=asked.top_p,
            metadata=asked.metadata,
            tools=list(asked.tools or ()),
            tool_choice=asked.tool_choice if asked.tool_choice is not None else "auto",
            parallel_tool_calls=asked.parallel_tool_calls is not False,
        )


def _response(head: ResponseHead, *, status: str, output: list[Json], usage: Json | None) -> Json:
    return {
        "id": head.response_id,
        "object": "response",
        "created_at": head.created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": head.instructions,
        "max_output_tokens": head.max_output_tokens,
        "model": head.model,
        "output": output,
        "parallel_tool_calls": head.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": head.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": head.tool_choice,
        "tools": head.tools,
        "top_p": head.top_p,
        "truncation": "disabled",
        "usage": usage,
        "metadata": head.metadata or {},
    }


def response_body(head: ResponseHead, chat: Json) -> Json:
    """The Response for a whole (non-streaming) chat answer of one choice."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    text = message.get("content") or ""
    status = status_of(choice.get("finish_reason"))
    calls = [function_call_item(c, "completed") for c in message.get("tool_calls") or ()]
    thought = message.get("reasoning_content")
    output = (
        [reasoning_item(head.reasoning_id, status="completed", text=thought)] if thought else []
    )
    if text or not calls:
        part = text_part(text, chat_logprobs(choice))
        output.append(message_item(head.message_id, status=status, parts=[part]))
    return _response(
        head, status=status, output=output + calls, usage=response_usage(chat.get("usage"))
    )


@attrs.define(eq=False, kw_only=True)
class ResponsesStream:
    """Chat chunks in, Response events out (module docstring)."""

    head: ResponseHead
    _sequence: int = 0
    _texts: list[str] = attrs.Factory(list)
    _logprobs: list[Json] = attrs.Factory(list)
    _finish_reason: str | None = None
    _usage: Json | None = None
    _items: int = 0  # output items opened
    _message_index: int | None = None  # the message's output index, once open
    _reasoning_index: int | None = None  # the thinking's output index, once open
    _thoughts: list[str] = attrs.Factory(list)
    _calls: dict[int, tuple[int, Json]] = attrs.Factory(dict)  # chat index -> (output index, item)

    def _event(self, kind: str, **fields: Any) -> Json:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self) -> list[Json]:
        created = _response(self.head, status="in_progress", output=[], usage=None)
        return [
            self._event("response.created", response=created),
            self._event("response.in_progress", response=created),
        ]

    def _open_message(self) -> list[Json]:
        index = self._message_index = self._items
        self._items += 1
        ids = {"item_id": self.head.message_id, "output_index": index, "content_index": 0}
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=message_item(self.head.message_id, status="in_progress", parts=[]),
            ),
            self._event("response.content_part.added", **ids, part=text_part("")),
        ]

    def feed(self, chunk: Json) -> list[Json]:
        """One chat chunk; a chunk carrying `error` is the caller's (see `failed`)."""
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        events: list[Json] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            thought = delta.get("reasoning_content")
            if thought:
                events += self._thinking(str(thought))
            text = delta.get("content")
            logprobs = chat_logprobs(choice)
            self._logprobs += logprobs
            if text or logprobs:  # a token may add logprobs before its text shows
                if self._message_index is None:
                    events += self._open_message()
                self._texts.append(text or "")
                events.append(
                    self._event(
                        "response.output_text.delta",
                        item_id=self.head.message_id,
                        output_index=self._message_index,
                        content_index=0,
                        delta=text or "",
                        logprobs=logprobs,
                    )
                )
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    events += self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
        return events

    def _thinking(self, thought: str) -> list[Json]:
        events: list[Json] = []
        if self._reasoning_index is None:
            self._reasoning_index = self._items
            self._items += 1
            item = reasoning_item(self.head.reasoning_id, status="in_progress", text=None)
            events.append(self._event(
                "response.output_item.added", output_index=self._reasoning_index, item=item
            ))  # fmt: skip
        self._thoughts.append(thought)
        events.append(self._event(
            "response.reasoning_text.delta", item_id=self.head.reasoning_id,
            output_index=self._reasoning_index, content_index=0, delta=thought,
        ))  # fmt: skip
        return events

    def _call_delta(self, call: Json) -> list[Json]:
        """A streamed chat tool call (whole, or a piece of its arguments after its first)."""
        events: list[Json] = []
        index = call.get("index")
        if not isinstance(index, int):
            index = len(self._calls)
        if index not in self._calls:
            item = function_call_item(call, "in_progress")
            pieces, item["arguments"] = item["arguments"], ""
            self._calls[index] = (self._items, item)
            self._items += 1
            events.append(self._event(
                "response.output_item.added", output_index=self._items - 1, item=dict(item)
            ))  # fmt: skip
        else:
            pieces = str((call.get("function") or {}).get("arguments") or "")
        output_index, item = self._calls[index]
        if pieces:
            item["arguments"] += pieces
            events.append(self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"], output_index=output_index, delta=pieces,
            ))  # fmt: skip
        return events

    def finish(self) -> list[Json]:
        text = "".join(self._texts)
        status = status_of(self._finish_reason)
        events: list[Json] = []
        if self._message_index is None and not self._calls:  # an empty answer: its message
            events += self._open_message()
        output: list[tuple[int, Json]] = []
        if self._reasoning_index is not None:
            thought = "".join(self._thoughts)
            ids = {"item_id": self.head.reasoning_id, "output_index": self._reasoning_index}
            item = reasoning_item(self.head.reasoning_id, status="completed", text=thought)
            events += [
                self._event("response.reasoning_text.done", **ids, content_index=0, text=thought),
                self._event(
                    "response.output_item.done", output_index=ids["output_index"], item=item
                ),
            ]
            output.append((self._reasoning_index, item))
        if self._message_index is not None:
            ids = {"item_id": self.head.message_id, "output_index": self._message_index,
                   "content_index": 0}  # fmt: skip
            part = text_part(text, self._logprobs)
            item = message_item(self.head.message_id, status=status, parts=[part])
            events += [
                self._event("response.output_text.done", **ids, text=text, logprobs=self._logprobs),
                self._event("response.content_part.done", **ids, part=part),
                self._event(
                    "response.output_item.done", output_index=ids["output_index"], item=item
                ),
            ]
            output.append((self._message_index, item))
        for output_index, call in self._calls.values():
            call["status"] = "completed"
            events += [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=call["id"], output_index=output_index, arguments=call["arguments"],
                ),
                self._event("response.output_item.done", output_index=output_index, item=call),
            ]  # fmt: skip
            output.append((output_index, call))
        items = [item for _, item in sorted(output, key=lambda pair: pair[0])]
        done = _response(self.head, status=status, output=items, usage=response_usage(self._usage))
        return [*events, self._event(f"response.{status}", response=done)]

    def failed(self, error: Json) -> list[Json]:
        """The chat stream ended with an OpenAI error body: an `error` event, then
        `response.failed`."""
        inner = error.get("error")
        body: Json = inner if isinstance(inner, dict) else {}
        message = str(body.get("message") or "generation failed")
        code = str(body.get("code") or "server_error")
        failed = _response(self.head, status="failed", output=[], usage=None)
        failed["error"] = {"code": "server_error", "message": message}
        return [
            self._event("error", code=code, message=message, param=body.get("param")),
            self._event("response.failed", response=failed),
        ]


def sse(event: Json) -> bytes:
    """A Responses stream event framed as OpenAI frames them (`event:` then `data:`)."""
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
