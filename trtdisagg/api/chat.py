"""Chat messages and tools as a chat template sees them (Hugging Face's conventions). Pure.

Workers render these to tokenize a chat request; the coordinator renders the same to know the
prompt's tokens for routing, so both must come from here. A message keeps `tool_calls` (an
assistant's earlier calls, `function.arguments` as the JSON text OpenAI sends) and
`tool_call_id` (a tool result); the template decides how they read. Tools reach the template as
its `tools` variable unless `tool_choice` is `none`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trtdisagg.api.protocol import ChatCompletionRequest, ChatMessage, Tool

Json = dict[str, Any]


def chat_messages(messages: Sequence[ChatMessage]) -> list[Json]:
    rendered: list[Json] = []
    for message in messages:
        item: Json = {"role": message.role, "content": message.text()}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        rendered.append(item)
    return rendered


def _tool(tool: Tool) -> Json:
    function: Json = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    if tool.function.parameters is not None:
        function["parameters"] = tool.function.parameters
    return {"type": tool.type, "function": function}


def chat_tools(req: ChatCompletionRequest) -> list[Json] | None:
    """The template's `tools`: None without tools or with `tool_choice: none`."""
    if not req.tools or req.tool_choice == "none":
        return None
    return [_tool(tool) for tool in req.tools]
