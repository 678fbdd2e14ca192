"""Tool calls in the chat template's format: the grammar that forces them, and the parser that
finds them in the output (pure).

The format is the one chat templates of the Hermes and Qwen families document, and `tiny`'s too:
each call is `<tool_call>{"name": N, "arguments": A}</tool_call>`, optionally with a newline
inside each tag. A model whose template has no `<tool_call>` has no format this server knows:
forcing a call (`tool_choice: required` or a named function) is then a 400, and `auto` leaves
the output as text.

* `tool_grammar`: the Lark grammar (llguidance's, with `%json` for each tool's parameters) of
  one call of the named function, or of one or more calls of any tool (`required`; exactly one
  with `parallel_tool_calls: false`).
* `ToolCallParser`: text in, as it comes; out, the text outside calls (`content`) and each call
  once its closing tag arrives. A call whose JSON does not parse stays text. What could still
  be the start of a call is held back until it is known.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any, Final

import attrs
import llguidance

from trtdisagg.api.errors import bad_request
from trtdisagg.api.protocol import ChatCompletionRequest, Tool

Json = dict[str, Any]

JSON_OPTIONS: Final[Json] = {"whitespace_flexible": False, "lenient": True}


@attrs.frozen(kw_only=True)
class ToolCallFormat:
    start: str
    end: str


HERMES: Final = ToolCallFormat(start="<tool_call>", end="</tool_call>")


def tool_call_format(chat_template: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template documents, if it is one this server knows."""
    if chat_template is not None and HERMES.start in chat_template:
        return HERMES
    return None


def tools_forced(req: ChatCompletionRequest) -> bool:
    """`tool_choice` asks for a call (`required`, or a named function) and tools are given."""
    choice = req.tool_choice
    return bool(req.tools) and (choice == "required" or isinstance(choice, dict))


def parses_tool_calls(req: ChatCompletionRequest) -> bool:
    """Whether the answer's text is searched for tool calls: tools are given and not `none`."""
    return bool(req.tools) and req.tool_choice != "none"


def tool_grammar(req: ChatCompletionRequest, tool_format: ToolCallFormat | None) -> str:
    """llguidance's grammar forcing `req`'s tool calls (`tools_forced(req)`).

    Raises:
        ApiError: no known tool-call format, or no tool of the name asked (400, `tool_choice`).
    """
    if tool_format is None:
        raise bad_request(
            "tool_choice: this model's chat template has no tool-call format this server "
            f"knows (it writes {HERMES.start}...{HERMES.end}); use 'auto' or 'none'",
            param="tool_choice",
        )
    tools = list(req.tools or ())
    choice = req.tool_choice
    single = choice != "required" or req.parallel_tool_calls is False
    if isinstance(choice, dict):
        name = _named_function(choice)
        tools = [t for t in tools if t.function.name == name]
        if not tools:
            raise bad_request(f"tool_choice: no tool named {name!r} in tools", param="tool_choice")
    calls = "call" if single else 'call ("\\n"? call)*'
    schema = {"anyOf": [_call_schema(tool) for tool in tools], "x-guidance": JSON_OPTIONS}
    lark = (
        f"start: {calls}\n"
        f'call: {json.dumps(tool_format.start)} "\\n"? %json {json.dumps(schema)} "\\n"? '
        f"{json.dumps(tool_format.end)}\n"
    )
    return str(llguidance.LLMatcher.grammar_from_lark(lark))


def _named_function(choice: dict[str, Any]) -> str:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            'tool_choice: expected {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return name


def _call_schema(tool: Tool) -> Json:
    parameters = tool.function.parameters or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


@attrs.frozen(kw_only=True)
class ToolCall:
    """One call, in OpenAI's shape once rendered (`as_json`)."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_json(self) -> Json:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@attrs.frozen(kw_only=True)
class Parsed:
    """What one piece of text gave: text outside calls, and the calls it completed."""

    content: str = ""
    calls: tuple[ToolCall, ...] = ()


@attrs.define(eq=False, kw_only=True)
class ToolCallParser:
    """Finds tool calls in text fed as it comes (module docstring)."""

    format: ToolCallFormat
    _buffer: str = ""
    _in_call: bool = False
    _after_call: bool = False  # whitespace right after a call is no content
    num_calls: int = 0

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                end = self._buffer.find(self.format.end)
                if end < 0:
                    break
                inner = self._buffer[len(self.format.start) : end]
                whole = self._buffer[: end + len(self.format.end)]
                self._buffer = self._buffer[end + len(self.format.end) :]
                self._in_call = False
                call = _call(inner)
                if call is None:
                    content.append(self._text(whole))
                else:
                    calls.append(call)
                    self._after_call = True
                continue
            start = self._buffer.find(self.format.start)
            if start >= 0:
                content.append(self._text(self._buffer[:start]))
                self._buffer = self._buffer[start:]
                self._in_call = True
                continue
            keep = _partial_start(self._buffer, self.format.start)
            content.append(self._text(self._buffer[: len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        self.num_calls += len(calls)
        return Parsed(content="".join(content), calls=tuple(calls))

    def finish(self) -> Parsed:
        """The end of the text: what was held back is text (an unclosed call too)."""
        rest, self._buffer, self._in_call = self._buffer, "", False
        return Parsed(content=self._text(rest))

    def _text(self, piece: str) -> str:
        if self._after_call:
            piece = piece.lstrip()
            self._after_call = not piece
        return piece


def parse_tool_calls(text: str, tool_format: ToolCallFormat) -> Parsed:
    """All of a finished answer's text at once."""
    parser = ToolCallParser(format=tool_format)
    first = parser.feed(text)
    rest = parser.finish()
    return Parsed(content=first.content + rest.content, calls=first.calls)


def _call(inner: str) -> ToolCall | None:
    try:
        data = json.loads(inner.strip())
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"call_{secrets.token_hex(12)}", name=data["name"], arguments=text)


def _partial_start(text: str, start: str) -> int:
    """How many trailing characters of `text` begin `start` (and may turn out to be a call)."""
    for size in range(min(len(text), len(start) - 1), 0, -1):
        if start.startswith(text[-size:]):
            return size
    return 0


def tool_call_deltas(calls: Sequence[ToolCall], first_index: int) -> list[Json]:
    """Streamed `delta.tool_calls` entries: each call whole, numbered on from `first_index`."""
    return [{"index": first_index + i, **call.as_json()} for i, call in enumerate(calls)]
