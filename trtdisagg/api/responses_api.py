"""`POST /v1/responses` (text and function tools), asked as a chat completion. Pure functions.

A Responses request becomes a chat completion body: `instructions` a system message, `input` a
user message (a string) or the listed items (`developer` messages taken as `system`), and
`max_output_tokens` chat's `max_tokens`. Function tools become chat's tools (Responses writes
them flat, `{type, name, parameters}`), a `function_call` item an assistant message's tool call
and a `function_call_output` item a tool message, so that an agent's loop (call, run the
function, send its output back) reads as the chat template expects. A `reasoning` item (a
reasoning model's thinking, sent back) becomes the `reasoning_content` of the assistant turn
it opens. Worker and coordinator serve
that body on their chat path, so the split, the routing and the validation are chat's;
`responses_events` turns the chat answer back into a Response. Fields beyond these are refused
by `responses_fields.RESPONSES`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Final

import attrs

from trtdisagg.api.errors import ApiError, bad_request

ROLES: Final = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS: Final = ("input_text", "output_text", "text")


@attrs.frozen(kw_only=True)
class ResponsesRequest:
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None  # {"format": ...}: chat's response_format, flattened
    include: list[str] | None = None  # only LOGPROBS: the output text's token logprobs
    top_logprobs: int | None = None  # alternatives per token, with LOGPROBS included
    tools: list[dict[str, Any]] | None = None  # function tools, flat
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


LOGPROBS: Final = "message.output_text.logprobs"


def responses_input(
    value: object, json_type: Callable[[object], str]
) -> str | list[dict[str, Any]]:
    """The structure hook of `input`: a string, or an array of objects (checked in `chat_body`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise TypeError(f"element {i}: expected an object, got {json_type(item)}")
        return value
    raise TypeError(f"expected a string or an array of input items, got {json_type(value)}")


def chat_body(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completion body that asks what `req` asks."""
    if req.input is None:
        raise bad_request("input: required field missing", param="input")
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        if not req.input:
            raise bad_request("input: must not be empty", param="input")
        for i, item in enumerate(req.input):
            _add_item(messages, item, i)
    body: dict[str, Any] = {"messages": messages}
    if req.tools:
        body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.model is not None:
        body["model"] = req.model
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # response.completed carries usage
    other = next((item for item in req.include or () if item != LOGPROBS), None)
    if other is not None:
        raise bad_request(f"include: only {LOGPROBS!r} is served, got {other!r}", param="include")
    top = req.top_logprobs
    if top is not None and not 0 <= top <= 20:
        raise bad_request(f"top_logprobs: must be in [0, 20], got {top}", param="top_logprobs")
    if LOGPROBS in (req.include or ()):
        body["logprobs"] = True
        body["top_logprobs"] = top or 0
    response_format = _response_format((req.text or {}).get("format"))
    if response_format is not None:
        body["response_format"] = response_format
    return body


def _response_format(value: object) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (Responses flattens `json_schema`'s fields)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("text.format: expected an object", param="text")
    if value.get("type") != "json_schema":
        return {"type": value.get("type")}
    spec = {k: value[k] for k in ("name", "schema", "strict", "description") if k in value}
    return {"type": "json_schema", "json_schema": spec}


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool (flat) as chat's (`{type, function: {...}}`)."""
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise bad_request(
            f"tools[{i}]: only function tools with a `name` are served, got type "
            f"{tool.get('type')!r}",
            param="tools",
        )
    function = {
        k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None
    }
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # none, auto, required: chat's own
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request(
            "tool_choice: `none`, `auto`, `required` or {type: function, name}",
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], i: int) -> None:
    """One input item as chat messages: a message, a function call (joined to the assistant
    turn before it, as chat carries a turn's calls) or a function's output (a tool message)."""
    where = f"input[{i}]"
    kind = item.get("type", "message")
    if kind == "message":
        message = _message(item, where)
        last = messages[-1] if messages else None
        if message["role"] == "assistant" and last is not None and _thought_alone(last):
            last["content"] = message["content"]  # the answer of the turn that thought first
        else:
            messages.append(message)
        return
    if kind == "reasoning":  # a reasoning model's thinking: the next assistant turn's
        thought = _reasoning_text(item, where)
        if thought:
            messages.append({"role": "assistant", "content": None, "reasoning_content": thought})
        return
    if kind == "function_call":
        call = _fields(item, where, ("call_id", "name", "arguments"))
        function = {"name": call["name"], "arguments": call["arguments"]}
        tool_call = {"id": call["call_id"], "type": "function", "function": function}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(tool_call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
        return
    if kind == "function_call_output":
        call_id = _fields(item, where, ("call_id",))["call_id"]
        output = _text(item.get("output"), f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        return
    raise bad_request(
        f"{where}.type: messages, reasoning, function_call and function_call_output items are "
        f"served, got {kind!r}",
        param="input",
    )


def _thought_alone(message: dict[str, Any]) -> bool:
    """An assistant turn that so far holds only a reasoning item's thinking."""
    return (
        message["role"] == "assistant"
        and "reasoning_content" in message
        and message["content"] is None
        and "tool_calls" not in message
    )


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's thinking: its `reasoning_text` content, else its summary's text (an
    item with neither, such as one carrying only `encrypted_content`, reads as none)."""
    texts: list[str] = []
    for field in ("content", "summary"):
        parts = item.get(field) or []
        if not isinstance(parts, list):
            raise bad_request(f"{where}.{field}: expected an array of text parts", param="input")
        for j, part in enumerate(parts):
            text = part.get("text") if isinstance(part, dict) else None
            if not isinstance(text, str):
                raise bad_request(f"{where}.{field}[{j}].text: a string is required", param="input")
            texts.append(text)
        if texts:
            break
    return "".join(texts)


def _fields(item: dict[str, Any], where: str, names: tuple[str, ...]) -> dict[str, str]:
    missing = next((name for name in names if not isinstance(item.get(name), str)), None)
    if missing is not None:
        raise bad_request(f"{where}.{missing}: a string is required", param="input")
    return {name: item[name] for name in names}


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad_request(
            f"{where}.role: expected one of {sorted(ROLES)}, got {role!r}", param="input"
        )
    return {"role": ROLES[role], "content": _text(item.get("content"), f"{where}.content")}


def _text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: expected a string or an array of text parts", param="input")
    texts: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(text, str):
            raise bad_request(
                f"{where}[{j}]: only text parts ({', '.join(TEXT_PARTS)}) with a string "
                f"`text` are supported, got type {kind!r}",
                param="input",
            )
        texts.append(text)
    return "".join(texts)


RENAMED: Final = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text",
}
"""Chat fields an error may name, as the Responses request called them."""


def responses_error(message: str, param: str | None) -> tuple[str, str | None]:
    """A chat error's message and param in the Responses request's own words."""
    for chat_name, name in RENAMED.items():
        message = message.replace(chat_name, name)
    return message, RENAMED.get(param, param) if param is not None else None


@contextlib.contextmanager
def as_responses_error() -> Iterator[None]:
    """Errors of the chat request that serves a Responses request name the Responses fields."""
    try:
        yield
    except ApiError as exc:
        message, param = responses_error(exc.message, exc.param)
        raise ApiError(exc.status, message, param=param) from None


def responses_rejection(body: dict[str, Any]) -> dict[str, Any]:
    """A worker's 4xx body (OpenAI's error shape) in the Responses request's own words."""
    error = body.get("error")
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return body
    param = error.get("param")
    message, renamed = responses_error(error["message"], param if isinstance(param, str) else None)
    out = {**error, "message": message}
    if renamed is not None:
        out["param"] = renamed
    return {**body, "error": out}
