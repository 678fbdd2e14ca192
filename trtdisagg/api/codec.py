"""JSON edge of the OpenAI API: strict structuring with field-named errors, and SSE framing.

This is the only place HTTP bodies turn into attrs objects. Types are checked strictly (JSON
`true` is not an integer, `"5"` is not a number) because a lenient cast hides client bugs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any, Final, TypeVar

import attrs
import cattrs

from trtdisagg.api.errors import ApiError, bad_request
from trtdisagg.api.fields import CHAT, COMPLETIONS, check_fields
from trtdisagg.api.fields_base import FieldRule
from trtdisagg.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    prune,
)
from trtdisagg.api.responses_api import (
    ResponsesRequest,
    as_responses_error,
    chat_body,
    responses_input,
)
from trtdisagg.api.responses_fields import RESPONSES
from trtdisagg.api.unknown_fields import UnknownFields
from trtdisagg.api.validation import single_prompt, validate_request

__all__ = [
    "SSE_DONE",
    "parse_json",
    "parse_request",
    "single_prompt",
    "sse_event",
    "structure_body",
    "to_json",
    "validate_request",
]

T = TypeVar("T")


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _strict_int(value: object, _cls: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {_json_type(value)}")
    return value


def _strict_float(value: object, _cls: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {_json_type(value)}")
    return float(value)


def _strict_bool(value: object, _cls: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected a boolean, got {_json_type(value)}")
    return value


def _strict_str(value: object, _cls: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {_json_type(value)}")
    return value


def _int_list(value: object) -> list[int]:
    if not isinstance(value, list):
        raise TypeError(f"expected an array of integers, got {_json_type(value)}")
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise TypeError(f"element {i}: expected an integer, got {_json_type(item)}")
    return value


def _prompt(value: object, _cls: object) -> str | list[int] | list[str] | list[list[int]]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise TypeError(f"expected a string or an array, got {_json_type(value)}")
    if all(isinstance(v, str) for v in value) and value:
        return [str(v) for v in value]
    if all(isinstance(v, list) for v in value) and value:
        return [_int_list(v) for v in value]
    return _int_list(value)


def _stop(value: object, _cls: object) -> str | list[str]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [str(v) for v in value]
    raise TypeError(f"expected a string or an array of strings, got {_json_type(value)}")


def _content(value: object, _cls: object) -> str | list[ContentPart]:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [_converter.structure(part, ContentPart) for part in value]
    raise TypeError(f"expected a string or an array of content parts, got {_json_type(value)}")


def _tool_choice(value: object, _cls: object) -> str | dict[str, Any]:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return value
    raise TypeError(f"expected a string or an object, got {_json_type(value)}")


def _json_object(value: object, _cls: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {_json_type(value)}")
    return value


def _responses_input(value: object, _cls: object) -> str | list[dict[str, Any]]:
    return responses_input(value, _json_type)


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=False)
    converter.register_structure_hook(int, _strict_int)
    converter.register_structure_hook(float, _strict_float)
    converter.register_structure_hook(bool, _strict_bool)
    converter.register_structure_hook(str, _strict_str)
    for cls in (CompletionRequest, ChatCompletionRequest, ChatMessage, ResponsesRequest):
        attrs.resolve_types(cls)
    prompt_type = attrs.fields(CompletionRequest).prompt.type
    stop_type = attrs.fields(CompletionRequest).stop.type
    content_type = attrs.fields(ChatMessage).content.type
    tool_choice_type = attrs.fields(ChatCompletionRequest).tool_choice.type
    input_type = attrs.fields(ResponsesRequest).input.type
    for union, hook in (
        (prompt_type, _prompt),
        (stop_type, _stop),
        (content_type, _content),
        (tool_choice_type, _tool_choice),
        (input_type, _responses_input),
    ):
        converter.register_structure_hook_func(_is_type(union), _optional(hook))
    converter.register_structure_hook_func(_is_type(dict[str, Any]), _json_object)
    converter.register_structure_hook_factory(_is_list_of_attrs, _strict_list_factory(converter))
    return converter


def _is_type(expected: Any) -> Any:
    return lambda t: t == expected


def _optional(hook: Any) -> Any:
    return lambda value, t: None if value is None else hook(value, t)


def _is_list_of_attrs(t: Any) -> bool:
    return getattr(t, "__origin__", None) is list and attrs.has(t.__args__[0])


def _strict_list_factory(converter: cattrs.Converter) -> Any:
    def factory(t: Any) -> Any:
        item = t.__args__[0]

        def hook(value: object, _t: object) -> list[Any]:
            if not isinstance(value, list):
                raise TypeError(f"expected an array, got {_json_type(value)}")
            out = []
            for i, element in enumerate(value):
                try:
                    out.append(converter.structure(element, item))
                except Exception as exc:
                    exc.add_note(cattrs.IterableValidationNote(f"index {i}", i, item))
                    raise cattrs.IterableValidationError("bad element", [exc], t) from None
            return out

        return hook

    return factory


_converter = _make_converter()


def _describe(exc: Exception) -> tuple[str, str | None]:
    """Turn a cattrs error group into 'field: problem' and the field's name."""
    if not isinstance(exc, cattrs.BaseValidationError):
        return str(exc), None
    messages: list[str] = []
    first_param: str | None = None

    def walk(group: BaseException, path: str) -> None:
        nonlocal first_param
        if isinstance(group, BaseExceptionGroup):
            for sub in group.exceptions:
                note = next(
                    (
                        n
                        for n in getattr(sub, "__notes__", [])
                        if hasattr(n, "name") or hasattr(n, "index")
                    ),
                    None,
                )
                name = getattr(note, "name", None)
                index = getattr(note, "index", None)
                sub_path = path
                if name is not None:
                    sub_path = f"{path}.{name}" if path else str(name)
                elif index is not None:
                    sub_path = f"{path}[{index}]"
                walk(sub, sub_path)
            return
        if isinstance(group, KeyError):
            messages.append(f"{path}: required field missing")
        elif isinstance(group, cattrs.ForbiddenExtraKeysError):
            messages.append(f"{path or 'body'}: unknown fields {sorted(group.extra_fields)}")
        elif "NoneType" in str(group) or "not None" in str(group):
            messages.append(f"{path}: must not be null")
        else:
            messages.append(f"{path}: {group}")
        if first_param is None:
            first_param = path.split(".")[0].split("[")[0] or None

    walk(exc, "")
    return "; ".join(messages), first_param


def structure_body(data: object, cls: type[T]) -> T:
    """Structure a decoded JSON body, raising a 400 ApiError that names the bad field."""
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {_json_type(data)}")
    try:
        return _converter.structure(data, cls)
    except (cattrs.BaseValidationError, TypeError, ValueError) as exc:
        message, param = _describe(exc)
        raise bad_request(message, param=param) from None


R = TypeVar("R", bound=CompletionRequest | ChatCompletionRequest | ResponsesRequest)

_RULES: Final[dict[type, dict[str, FieldRule]]] = {
    CompletionRequest: COMPLETIONS,
    ChatCompletionRequest: CHAT,
    ResponsesRequest: RESPONSES,
}
_ROUTES: Final[dict[type, str]] = {
    CompletionRequest: "/v1/completions",
    ChatCompletionRequest: "/v1/chat/completions",
    ResponsesRequest: "/v1/responses",
}
_KNOWN: Final[dict[type, frozenset[str]]] = {
    cls: frozenset(rules) | {field.name for field in attrs.fields(cls)}
    for cls, rules in _RULES.items()
}
_unknown = UnknownFields()


def parse_request(body: object, cls: type[R]) -> R:
    """A decoded JSON body as a request of `cls`, checked: types (`structure_body`), each
    OpenAI field's rule (`fields.check_fields`), then the relations between fields
    (`validation.validate_request`). Every failure is a 400 naming the field."""
    req = structure_body(body, cls)
    assert isinstance(body, dict)  # structure_body refuses anything else
    check_fields(body, _RULES[cls])
    _unknown.note(body, _KNOWN[cls], _ROUTES[cls])
    if isinstance(req, CompletionRequest | ChatCompletionRequest):
        validate_request(req)
    else:  # a Responses request is served as the chat request it becomes: check that one
        with as_responses_error():
            validate_request(structure_body(chat_body(req), ChatCompletionRequest))
    return req


MAX_JSON_DEPTH: Final = 32
"""OpenAI bodies nest a few levels (messages → content → parts). Deeper ones are refused at the
edge: Python's json recursion limit would otherwise surface later, on re-encoding for a worker."""


def parse_json(raw: bytes | str) -> object:
    too_deep = f"request body nests deeper than {MAX_JSON_DEPTH} levels"
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request(too_deep) from None
    if _json_depth(value) > MAX_JSON_DEPTH:
        raise bad_request(too_deep)
    escape = _SURROGATE_ESCAPE if isinstance(raw, str) else _SURROGATE_ESCAPE_BYTES
    if escape.search(raw):  # type: ignore[arg-type]  # str pattern for str, bytes for bytes
        _refuse_unencodable(value)
    return value


# A lone surrogate can only reach a decoded body through a `\uD800`-style escape (raw UTF-8
# cannot encode one, and Python's decoder refuses it), so bodies without such an escape skip
# the walk. Paired escapes (an emoji) decode to one valid character and pass the walk.
_SURROGATE_ESCAPE: Final = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_BYTES: Final = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def _refuse_unencodable(value: object) -> None:
    """400 naming where text holds a lone surrogate: it cannot be encoded as UTF-8, so the
    tokenizer (or the JSON sent to a worker) would fail on it deep inside the request."""
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            found = _SURROGATE.search(node)
            if found:
                code = f"U+{ord(found.group()):04X}"
                param = path.split(".")[0].split("[")[0] or None
                raise bad_request(
                    f"{path or 'body'}: text holds a lone surrogate ({code}), which is not "
                    "valid Unicode",
                    param=param,
                )
        elif isinstance(node, dict):
            for key, child in node.items():
                stack.append((key, path))  # a key is reported as where its object is
                stack.append((child, f"{path}.{key}" if path else str(key)))
        elif isinstance(node, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(node))


def _json_depth(value: object) -> int:
    """Nesting depth of decoded JSON (a scalar is 0, `[]` is 1), without recursion."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while stack and deepest <= MAX_JSON_DEPTH:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node
        assert isinstance(children, Iterable)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def to_json(value: object) -> Any:
    """attrs value → JSON-ready data, with None-valued keys dropped."""
    if attrs.has(type(value)):
        return prune(_converter.unstructure(value))
    return prune(value)


def unstructure(value: object) -> Any:
    return _converter.unstructure(value)


def sse_event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def error_status(exc: ApiError) -> int:
    return exc.status
