"""Every request field of `/v1/responses` (the `openai` package's request type): how it acts
here, or its 400, in the rules of `fields.py`. Served as the chat request it becomes
(`responses_api.py`), so sampling fields and function tools act as in chat; the rest of the
Responses API (stored responses, hosted tools, background runs) is refused by name.
"""

from __future__ import annotations

from typing import Final

from trtdisagg.api.fields import hint_rules
from trtdisagg.api.fields_base import IGNORED, NEUTRAL, PARTIAL, REFUSED, SUPPORTED, rule

RESPONSES: Final = {
    rule.name: rule
    for rule in [
        rule("model", SUPPORTED, "the served model's name (else 404), or absent"),
        rule(
            "input",
            SUPPORTED,
            "a string, or a list of items: messages (`role` user, assistant, system or "
            "developer; `content` a string or `input_text`/`output_text` parts), "
            "`function_call` (an assistant's call) and `function_call_output` (its result); "
            "other items are a 400",
        ),
        rule("instructions", SUPPORTED, "a system message before the input"),
        rule(
            "max_output_tokens",
            SUPPORTED,
            "as chat's `max_tokens`; the response is `incomplete` when it is reached",
            bad=2**31,
        ),
        rule("temperature", SUPPORTED, "as in chat"),
        rule("top_p", SUPPORTED, "as in chat"),
        rule(
            "stream",
            SUPPORTED,
            "`response.created`, `response.in_progress`, `response.output_item.added`, "
            "`response.content_part.added`, `response.output_text.delta`…, "
            "`response.output_text.done`, `response.content_part.done`, "
            "`response.output_item.done`, `response.completed`",
        ),
        rule("stream_options", IGNORED, "no obfuscation padding is added to deltas"),
        rule("access_programs", REFUSED, "not supported", bad={"cyber": "standard"}),
        rule("background", NEUTRAL, "false only", neutral=(False,), bad=True),
        rule("background_options", REFUSED, "background responses are not supported", bad={}),
        rule("context_management", REFUSED, "not supported", bad=[]),
        rule("conversation", REFUSED, "responses are not stored", bad="conv_1"),
        rule("image", REFUSED, "not supported", bad={}),
        rule(
            "include",
            PARTIAL,
            "`message.output_text.logprobs` only: each output token's logprob, and "
            "`top_logprobs` alternatives, in the text part and its stream's deltas",
            bad=["reasoning.encrypted_content"],
        ),
        rule("max_tool_calls", REFUSED, "a cap on tool calls is not served", bad=1),
        rule("metadata", IGNORED, "echoed in the response"),
        rule("moderation", REFUSED, "moderation is not supported", bad={"model": "m"}),
        rule("parallel_tool_calls", SUPPORTED, "as chat's"),
        rule("previous_response_id", REFUSED, "responses are not stored", bad="resp_1"),
        rule("prompt", REFUSED, "prompt templates are not supported", bad={"id": "p"}),
        *hint_rules(),
        rule("reasoning", REFUSED, "not a reasoning model", bad={"effort": "low"}),
        rule(
            "store",
            NEUTRAL,
            "false only: responses are not stored (OpenAI's default, true, is a 400)",
            neutral=(False,),
            bad=True,
        ),
        rule(
            "text",
            SUPPORTED,
            "`format`: `text`, `json_object` or `json_schema` (`name`, `schema`, `strict`), "
            "enforced as chat's `response_format` (see Structured output)",
            refusal={"input": "x", "text": {"format": {"type": "yaml"}}},
        ),
        rule(
            "tool_choice",
            SUPPORTED,
            "`none`, `auto`, `required` or `{type: function, name}`, as chat's",
            refusal={"input": "x", "tool_choice": {"type": "file_search"}},
        ),
        rule(
            "tools",
            SUPPORTED,
            "function tools (`{type: function, name, description, parameters}`), as chat's: "
            "the answer's calls are `function_call` output items (streamed as "
            "`response.function_call_arguments.delta` and `.done`); other tool types are a 400",
            refusal={"input": "x", "tools": [{"type": "web_search"}]},
        ),
        rule(
            "top_logprobs",
            SUPPORTED,
            "0 to 20 alternatives per token, with `message.output_text.logprobs` included",
            refusal={"input": "x", "top_logprobs": 21},
        ),
        rule("truncation", NEUTRAL, "`disabled` only", neutral=("disabled",), bad="auto"),
        rule("user", IGNORED, "an end-user identifier; nothing here uses it"),
    ]
}
