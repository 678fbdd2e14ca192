"""Every OpenAI request field of the three generation routes: how it acts here, or its 400.

One rule per field of `/v1/completions` and `/v1/chat/completions` here (vLLM's extensions beyond
sampling in `vllm_fields.py`), of `/v1/responses` in `responses_fields.py`: every field of the
`openai` package's request types, plus this server's and other servers' extensions.
`check_fields` enforces the rules that depend on one field alone: a `neutral` field is accepted
only at the value that changes nothing (a penalty of 0), a `refused` one only when absent or
null, each otherwise a 400 naming it. `partial` fields, whose limits depend on other fields
(`best_of` against `n`), are checked in `validation.py`. docs/API.md's tables are
`render_table()`'s output, and a test holds them equal, so the document cannot drift from the
code.

Every field of the request types acts today; a new field the engine implements becomes
`supported` here once it acts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from trtdisagg.api.errors import bad_request
from trtdisagg.api.fields_base import (
    IGNORED,
    NEUTRAL,
    REFUSED,
    SUPPORTED,
    FieldRule,
    Support,
    rule,
)
from trtdisagg.api.vllm_fields import vllm_rules

TOOL: Final = {"type": "function", "function": {"name": "get_weather"}}


def hint_rules() -> list[FieldRule]:
    """Fields chat and Responses share that hint at caching, identify the end user, or ask
    for a service tier."""
    return [
        rule(
            "prompt_cache_key", IGNORED, "a cache hint: prefixes are found by the KV-aware router"
        ),
        rule("prompt_cache_options", IGNORED, "a cache hint: the prefix cache keeps what fits"),
        rule("prompt_cache_retention", IGNORED, "a cache hint: the prefix cache keeps what fits"),
        rule("safety_identifier", IGNORED, "an end-user identifier; nothing here uses it"),
        rule(
            "service_tier",
            NEUTRAL,
            "`auto` or `default` only",
            neutral=("auto", "default"),
            bad="priority",
        ),
    ]


def _sampling_rules() -> list[FieldRule]:
    """Fields both completions and chat share (OpenAI's and this server's extensions)."""
    return [
        rule(
            "frequency_penalty",
            SUPPORTED,
            "-2 to 2: each output token's logit loses this × its count in the output so far "
            "(see Sampling controls)",
            bad=2.5,
        ),
        rule(
            "logit_bias",
            SUPPORTED,
            "token id (a decimal string, in the vocabulary) → bias in [-100, 100], added to "
            "that token's logit",
            bad={"5": 101},
        ),
        rule(
            "n",
            SUPPORTED,
            "1 to 128 choices per prompt (n × prompts ≤ 128); a prompt is prefilled once (and, "
            "through the coordinator, sent from ctx to gen once) and forked n ways (see Choices)",
        ),
        rule(
            "presence_penalty",
            SUPPORTED,
            "-2 to 2: a token already in the output loses this from its logit",
            bad=-2.5,
        ),
        rule(
            "seed",
            SUPPORTED,
            "an int64; choice i of a prompt samples with `choice_seed(seed, i)` (see Seeds)",
        ),
        rule(
            "stop",
            SUPPORTED,
            "a string or a list of up to 16 strings, each up to 256 characters; the text ends "
            "before the stop string",
        ),
        rule(
            "stream", SUPPORTED, "SSE chunks, choices interleaved as they produce tokens; `[DONE]`"
        ),
        rule(
            "stream_options",
            SUPPORTED,
            "`include_usage` (one usage chunk at the end), `continuous_usage_stats` (usage so "
            "far in every chunk); only with `stream: true`",
            refusal={"stream_options": {"include_usage": True}},
        ),
        rule("temperature", SUPPORTED, "0 to 100; below 1e-5 samples greedily"),
        rule("top_p", SUPPORTED, "in (0, 1]"),
        rule("user", IGNORED, "an end-user identifier; nothing here uses it"),
        # ---- extensions (vLLM's and TensorRT-LLM's names) ----
        rule("top_k", SUPPORTED, "extension: -1 or 0 off, else the k most likely tokens"),
        rule(
            "min_p",
            SUPPORTED,
            "extension: 0 to 1; drops tokens less likely than min_p × the most likely one",
            bad=1.5,
        ),
        rule(
            "repetition_penalty",
            SUPPORTED,
            "extension: above 0 (1: off); a token of the prompt or output has a positive logit "
            "divided by it, a negative one multiplied",
            bad=0,
        ),
        rule("min_tokens", SUPPORTED, "extension: end-of-sequence is suppressed before this many"),
        rule("ignore_eos", SUPPORTED, "extension: generate past end-of-sequence"),
        rule(
            "include_stop_str_in_output",
            SUPPORTED,
            "extension (vLLM's): the text ends with the stop string that ended it, not before it",
        ),
        rule(
            "skip_special_tokens",
            SUPPORTED,
            "extension (vLLM's): false keeps special tokens' text (`<|eot_id|>`, ...) in the "
            "output; the token that ends the choice adds none",
        ),
        rule(
            "spaces_between_special_tokens",
            IGNORED,
            "extension (vLLM's): for slow (Python) tokenizers only; the fast tokenizers read "
            "here decode special tokens without it, as vLLM's fast path does",
        ),
        rule(
            "stop_token_ids",
            SUPPORTED,
            "extension: token ids that end the choice; each must be in the vocabulary",
        ),
        rule(
            "return_tokens_as_token_ids",
            SUPPORTED,
            "extension (vLLM's): each token of the logprobs is `token_id:N`, exact where a "
            "token's text is not (a piece of a character)",
        ),
        rule(
            "request_id",
            SUPPORTED,
            "extension (vLLM's): 1 to 128 printable ASCII characters; the answer's `id` is "
            "`cmpl-` or `chatcmpl-` and it, split or not",
            bad="a b",
        ),
        rule(
            "priority",
            NEUTRAL,
            "extension (vLLM's): 0 only; requests are scheduled first come, first served",
            neutral=(0,),
            bad=1,
        ),
        rule(
            "cache_salt",
            SUPPORTED,
            "extension (vLLM's): 1 to 1024 characters; the request shares cached prompt KV only "
            "with requests of the same salt (unsalted ones with each other), so that a tenant "
            "cannot learn another's prompts from cache-hit timings; the KV-aware router too",
            bad="",
        ),
        rule(
            "truncate_prompt_tokens",
            SUPPORTED,
            "extension (vLLM's): the model reads only the prompt's last k tokens (-1: the "
            "model's context); more than the context is a 400; `echo` gives what it read",
            bad=0,
        ),
        rule(
            "prompt_logprobs",
            SUPPORTED,
            "extension (vLLM's): 0 to 20; `prompt_logprobs` in the answer (each choice's, or "
            "chat's at the top): null for the first prompt token, then a map from token id to "
            "`{logprob, rank, decoded_token}` for the prompt token and the n most likely at its "
            "place; streamed too, in the first chunk with an output (vLLM refuses a stream)",
            bad=-1,
        ),
        rule(
            "allowed_token_ids",
            SUPPORTED,
            "extension (vLLM's): a non-empty list of token ids in the vocabulary; every other "
            "token is masked before sampling (and before logprobs, as a grammar's mask is)",
            bad=[],
        ),
        rule(
            "bad_words",
            SUPPORTED,
            "extension (vLLM's): up to 128 words kept out of the output as the tokenizer "
            "spells them, at the text's start and after a space: where the output ends with "
            "all but a spelling's last token, that token is masked (other spellings get "
            "through, as in vLLM)",
            bad=[" "],
        ),
        rule(
            "response_format",
            SUPPORTED,
            "`text`, `json_object` (any JSON object) or `json_schema` (`{name, schema, "
            "strict}`), enforced token by token (see Structured output); a schema llguidance "
            "cannot compile is a 400 naming it",
            refusal={"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
        ),
        rule(
            "structured_outputs",
            SUPPORTED,
            "extension (vLLM's): one of `json` (a schema), `regex`, `choice` (strings), "
            "`grammar` (Lark or GBNF)",
            refusal={"structured_outputs": {"regex": "a", "choice": ["b"]}},
        ),
        rule("guided_json", SUPPORTED, "extension (vLLM's): as `structured_outputs.json`"),
        rule("guided_regex", SUPPORTED, "extension (vLLM's): as `structured_outputs.regex`"),
        rule("guided_choice", SUPPORTED, "extension (vLLM's): as `structured_outputs.choice`"),
        rule("guided_grammar", SUPPORTED, "extension (vLLM's): as `structured_outputs.grammar`"),
        rule(
            "return_token_ids",
            SUPPORTED,
            "extension: `prompt_token_ids` and each choice's `token_ids` in the answer",
        ),
        rule("return_perf_metrics", SUPPORTED, "extension: per-phase timings in `perf_metrics`"),
        rule(
            "disaggregated_params",
            SUPPORTED,
            "extension: the ctx ↔ gen hand-over (DESIGN.md §2; see Disaggregated parameters); "
            "a context_only or generation_only request has one prompt (its n choices share it)",
        ),
        rule("conversation_id", SUPPORTED, "extension: routing affinity (`conversation` router)"),
        rule(
            "prompt_token_ids",
            SUPPORTED,
            "extension: the prompt already tokenized (the coordinator sets it for gen)",
        ),
    ]


COMPLETIONS: Final = {
    rule.name: rule
    for rule in [
        rule("model", SUPPORTED, "the served model's name (else 404), or absent"),
        rule(
            "prompt",
            SUPPORTED,
            "a string, a token list, a list of strings or a list of token lists; prompt p's "
            "choice i has index p × n + i",
        ),
        rule(
            "best_of",
            SUPPORTED,
            "`n` to 128 (best_of × prompts ≤ 128): each prompt generates best_of candidates "
            "(one prefill, forked) and answers the `n` of highest cumulative logprob, best first; "
            "a stream sends them at the end, each whole in one chunk",
            refusal={"best_of": 129},
        ),
        rule(
            "echo",
            SUPPORTED,
            "each choice's text starts with its prompt (streamed first); with `logprobs`, the "
            "prompt's tokens lead `logprobs` (the first with a null logprob), computed by the "
            "prefill that runs anyway (see Echo)",
        ),
        rule(
            "logprobs",
            SUPPORTED,
            "0 to 20: each token's logprob; `top_logprobs` has that many most likely tokens "
            "plus the sampled one (0: the sampled one alone)",
        ),
        rule(
            "max_tokens",
            SUPPORTED,
            "default 16; below 2**31, and prompt + max_tokens within the model's context "
            "(else a 400 naming it); 0 with `echo` scores the prompt: its text and (with "
            "`logprobs`) its logprobs, nothing generated",
            bad=2**31,
        ),
        rule("suffix", NEUTRAL, "empty only: insertion is not supported", neutral=("",), bad="end"),
        *_sampling_rules(),
        *vllm_rules(chat=False),
    ]
}

CHAT: Final = {
    rule.name: rule
    for rule in [
        rule("model", SUPPORTED, "the served model's name (else 404), or absent"),
        rule(
            "messages",
            SUPPORTED,
            "rendered by the model's chat template: `content` as a string or text parts "
            "(other parts, such as images, are a 400), an assistant's `tool_calls` and "
            "`reasoning_content`, a tool message's `tool_call_id`; `developer` is read as "
            "`system` by a template that does not name it",
        ),
        rule("audio", REFUSED, "audio output is not supported", bad={"voice": "alloy"}),
        rule("function_call", REFUSED, "deprecated by OpenAI: use `tool_choice`", bad="auto"),
        rule("functions", REFUSED, "deprecated by OpenAI: use `tools`", bad=[{"name": "f"}]),
        rule("logprobs", SUPPORTED, "with `top_logprobs`: one `logprobs.content` entry per token"),
        rule("max_completion_tokens", SUPPORTED, "as `max_tokens`, which it overrides", bad=2**31),
        rule(
            "max_tokens",
            SUPPORTED,
            "default: the room left in the context; below 2**31, and prompt + max_tokens "
            "within the model's context (else a 400 naming it)",
            bad=2**31,
        ),
        rule("metadata", IGNORED, "kept only with `store`, which is off"),
        rule("modalities", NEUTRAL, '`["text"]` only', neutral=(["text"],), bad=["text", "audio"]),
        rule("moderation", REFUSED, "moderation is not supported", bad={"model": "m"}),
        rule(
            "parallel_tool_calls",
            SUPPORTED,
            "with `tool_choice: required`, false forces exactly one call (true: one or more)",
        ),
        rule("prediction", REFUSED, "predicted outputs are not supported", bad={"type": "content"}),
        *hint_rules(),
        rule("reasoning_effort", REFUSED, "not a reasoning model", bad="low"),
        rule(
            "store", NEUTRAL, "false only: completions are not stored", neutral=(False,), bad=True
        ),
        rule(
            "tool_choice",
            SUPPORTED,
            "`none` (the template gets no tools), `auto` (calls the output makes are parsed), "
            "`required` or a named function (calls forced by a grammar); see Tools",
            refusal={
                "tools": [TOOL],
                "tool_choice": {"type": "function", "function": {"name": "other"}},
            },
        ),
        rule(
            "tools",
            SUPPORTED,
            "function tools reach the chat template as `tools`; calls in the answer are "
            "`tool_calls` (`finish_reason: tool_calls`); another tool type is a 400",
            refusal={"tools": [{"type": "custom", "function": {"name": "x"}}]},
        ),
        rule(
            "top_logprobs",
            SUPPORTED,
            "0 to 20 most likely tokens per entry; needs `logprobs: true`",
            refusal={"top_logprobs": 2},
        ),
        rule("verbosity", REFUSED, "not supported", bad="low"),
        rule("web_search_options", REFUSED, "web search is not supported", bad={}),
        rule(
            "add_generation_prompt",
            SUPPORTED,
            "extension: the template's assistant header (default true)",
        ),
        rule(
            "continue_final_message",
            SUPPORTED,
            "extension (vLLM's): the prompt ends inside the last message, the assistant's, and "
            "the reply goes on with it; needs `add_generation_prompt: false`",
            refusal={"continue_final_message": True},
        ),
        rule(
            "echo",
            SUPPORTED,
            "extension (vLLM's): when the last message is the assistant's, the answer's content "
            "starts with it (with `continue_final_message`: the whole reply); else no change",
        ),
        rule(
            "chat_template_kwargs",
            SUPPORTED,
            "extension (vLLM's): more variables for the chat template (`enable_thinking`, ...); "
            "not one the request sets itself (`messages`, `tools`, `add_generation_prompt`, "
            "`bos_token`, `eos_token`)",
            bad={"messages": []},
        ),
        rule(
            "add_special_tokens",
            SUPPORTED,
            "extension (vLLM's): the tokenizer's own special tokens (a BOS) added to the "
            "rendered prompt; default false, as the template writes them",
        ),
        rule(
            "chat_template",
            REFUSED,
            "a request's own template is not taken: the model's renders every chat (vLLM "
            "also refuses it unless started to trust them)",
            bad="{{ messages }}",
        ),
        *_sampling_rules(),
        *vllm_rules(chat=True),
    ]
}


def check_fields(raw: Mapping[str, Any], rules: Mapping[str, FieldRule]) -> None:
    """400 naming the first field whose value its rule does not accept by itself."""
    for name, value in raw.items():
        rule = rules.get(name)
        if rule is None or value is None:
            continue
        if rule.support is Support.REFUSED:
            raise bad_request(f"{name}: not supported: {rule.how}", param=name)
        if rule.support is Support.NEUTRAL and not any(json_equal(value, n) for n in rule.neutral):
            raise bad_request(f"{name}: {_show(value)} is not supported: {rule.how}", param=name)


def json_equal(a: Any, b: Any) -> bool:
    """Equality of decoded JSON values, where `true` is not `1` and `0` equals `0.0`."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def render_table(rules: Mapping[str, FieldRule]) -> str:
    """The Markdown table docs/API.md holds for one route (fields in alphabetical order)."""
    lines = ["| Field | Support | How, or the error |", "|---|---|---|"]
    for name in sorted(rules):
        rule = rules[name]
        how = rule.how.replace("|", "\\|")
        lines.append(f"| `{name}` | {rule.support.value} | {how} |")
    return "\n".join(lines)
