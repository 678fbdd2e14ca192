"""Chat messages and tools as a chat template sees them (Hugging Face's conventions). Pure.

Workers render these to tokenize a chat request; the coordinator renders the same to know the
prompt's tokens for routing, so both must come from here. A message keeps `tool_calls` (an
assistant's earlier calls, `function.arguments` as the JSON text OpenAI sends) and
`tool_call_id` (a tool result) and `reasoning_content` (an assistant's earlier thinking); the
template decides how they read. Tools reach the template as
its `tools` variable unless `tool_choice` is `none`.

vLLM's rendering controls travel with them (`ChatRender`): `chat_template_kwargs` (more template
variables, such as `enable_thinking`), `continue_final_message` (the prompt ends inside the last
message, an assistant reply the model goes on with; `continued`) and `add_special_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import attrs

from trtdisagg.api.protocol import ChatCompletionRequest, ChatMessage, Tool

Json = dict[str, Any]

TEMPLATE_VARIABLES: Final = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
)
"""The variables a worker gives a chat template; `chat_template_kwargs` may not name them."""


@attrs.frozen(kw_only=True)
class ChatRender:
    """How a chat request's messages become its prompt: the template's variables, then what is
    done to its text (`continue_final_message`) and how the text is encoded."""

    messages: list[Json]
    tools: list[Json] | None
    add_generation_prompt: bool = True
    template_kwargs: Json = attrs.Factory(dict)
    continue_final_message: bool = False
    add_special_tokens: bool = False

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> ChatRender:
        return cls(
            messages=chat_messages(req.messages or []),
            tools=chat_tools(req),
            add_generation_prompt=req.add_generation_prompt,
            template_kwargs={
                **(req.chat_template_kwargs or {}),
                **({"documents": req.documents} if req.documents is not None else {}),
            },
            continue_final_message=req.continue_final_message,
            add_special_tokens=req.add_special_tokens,
        )


def continued(text: str, final: str) -> str:
    """`text`, a rendered conversation, cut right after its last message `final`, so that the
    model continues that message rather than starting a turn (Hugging Face's rule: the last
    place the message's stripped text occurs; its trailing spaces are kept only if the template
    kept them).

    Raises:
        ValueError: the template's text does not contain the message.
    """
    core = final.strip()
    at = text.rfind(core)
    if not core or at < 0:
        raise ValueError(
            "continue_final_message: the last message's text is not in the rendered prompt "
            "(an empty message, or a template that rewrites it)"
        )
    kept = final.lstrip()
    end = at + len(kept) if text[at : at + len(kept)] == kept else at + len(core)
    return text[:end]


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
        if message.reasoning_content is not None:
            item["reasoning_content"] = message.reasoning_content
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
