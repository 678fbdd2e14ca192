"""Which grammar a request's output must follow, as llguidance grammar text (pure).

At most one of these constrains a request; each is a 400 naming its field when it is malformed
(and, once the worker compiles it, when llguidance refuses it: `worker/grammar.py`):

* `response_format`: `{"type": "json_object"}` (any JSON object), `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}` (a schema; with `strict`, a keyword llguidance
  does not implement is a 400, without it the keyword is ignored); `text` constrains nothing;
* vLLM's structured outputs: `structured_outputs: {"json" | "regex" | "choice" | "grammar": ...}`
  and the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (Lark, or GBNF);
* chat's `tool_choice: "required"` or a named function, with `tools`: tool calls in the chat
  template's format (`tool_calls.tool_grammar`).

JSON is written compactly (no whitespace between tokens): a model the grammar leaves free to add
whitespace may add it forever.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import attrs
import llguidance

from trtdisagg.api.errors import bad_request
from trtdisagg.api.protocol import ChatCompletionRequest, CompletionRequest
from trtdisagg.api.tool_calls import ToolCallFormat, tool_grammar, tools_forced

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of its stub only

AnyRequest = CompletionRequest | ChatCompletionRequest
Json = dict[str, Any]

STRUCTURED_KINDS: Final = ("json", "regex", "choice", "grammar")


@attrs.frozen(kw_only=True)
class OutputGrammar:
    """A request's output grammar."""

    field: str  # the request field it comes from: a grammar llguidance refuses is a 400 naming it
    grammar: str  # llguidance's grammar (`LLMatcher.grammar_from_*`)
    tool_calls: bool = False  # the output is forced tool calls (parsed into `tool_calls`)


def output_grammar(req: AnyRequest, tool_format: ToolCallFormat | None) -> OutputGrammar | None:
    """The one grammar `req` asks for, or None.

    Raises:
        ApiError: a malformed constraint (400 naming its field), or two of them.
    """
    asked: list[OutputGrammar] = []
    response_format = _response_format(req.response_format)
    if response_format is not None:
        asked.append(response_format)
    asked += _structured_outputs(req)
    if isinstance(req, ChatCompletionRequest) and tools_forced(req):
        grammar = tool_grammar(req, tool_format)
        asked.append(OutputGrammar(field="tool_choice", grammar=grammar, tool_calls=True))
    if len(asked) > 1:
        raise bad_request(
            f"{asked[1].field}: only one output constraint per request, {asked[0].field} is one",
            param=asked[1].field,
        )
    return asked[0] if asked else None


def _response_format(value: Mapping[str, Any] | None) -> OutputGrammar | None:
    field = "response_format"
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputGrammar(field=field, grammar=json_grammar({"type": "object"}, field=field))
    if kind != "json_schema":
        raise bad_request(
            f"{field}.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}",
            param=field,
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(f"{field}.json_schema: required, an object", param=field)
    schema = spec.get("schema")
    strict = spec.get("strict")
    if not isinstance(schema, dict):
        raise bad_request(f"{field}.json_schema.schema: required, a JSON schema", param=field)
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{field}.json_schema.strict: expected a boolean", param=field)
    return OutputGrammar(
        field=field, grammar=json_grammar(schema, field=field, strict=bool(strict))
    )


def _structured_outputs(req: AnyRequest) -> list[OutputGrammar]:
    asked: list[OutputGrammar] = []
    for kind in STRUCTURED_KINDS:
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            asked.append(_structured(kind, value, f"guided_{kind}"))
    outputs = req.structured_outputs
    if outputs is not None:
        kinds = [k for k in STRUCTURED_KINDS if outputs.get(k) is not None]
        unknown = sorted(set(outputs) - set(STRUCTURED_KINDS))
        if unknown or len(kinds) != 1:
            raise bad_request(
                f"structured_outputs: expected exactly one of {', '.join(STRUCTURED_KINDS)}"
                + (f"; not supported: {', '.join(unknown)}" if unknown else ""),
                param="structured_outputs",
            )
        asked.append(_structured(kinds[0], outputs[kinds[0]], "structured_outputs"))
    return asked


def _structured(kind: str, value: Any, field: str) -> OutputGrammar:
    if kind == "json":
        schema = _json_value(value, field)
        return OutputGrammar(field=field, grammar=json_grammar(schema, field=field))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request(f"{field}: choice must be a non-empty list of strings", param=field)
        alternatives = "|".join(_regex_literal(choice) for choice in value)
        return OutputGrammar(
            field=field, grammar=llguidance.LLMatcher.grammar_from_regex(f"({alternatives})")
        )
    if not isinstance(value, str) or not value:
        raise bad_request(f"{field}: {kind} must be a non-empty string", param=field)
    if kind == "regex":
        return OutputGrammar(field=field, grammar=llguidance.LLMatcher.grammar_from_regex(value))
    try:  # a Lark grammar, or a GBNF one (llguidance converts it)
        grammar = llguidance.grammar_from("grammar", value)
    except ValueError as exc:
        raise bad_request(f"{field}: {exc}", param=field) from None
    return OutputGrammar(field=field, grammar=grammar)


def json_grammar(schema: Json, *, field: str, strict: bool = False) -> str:
    """llguidance's grammar of JSON text valid against `schema`, written compactly."""
    options: JsonCompileOptions = {"whitespace_flexible": False, "lenient": not strict}
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options))
    except ValueError as exc:
        raise bad_request(f"{field}: {exc}", param=field) from None


def _json_value(value: Any, field: str) -> Json:
    """A schema given as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request(f"{field}: not a JSON schema (invalid JSON)", param=field) from None
    if not isinstance(value, dict):
        raise bad_request(f"{field}: expected a JSON schema object", param=field)
    return value


def _regex_literal(text: str) -> str:
    """`text` matched literally by llguidance's (Rust) regex syntax: every character that is
    not a letter or a digit as a hex escape."""
    return "".join(c if c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text)
