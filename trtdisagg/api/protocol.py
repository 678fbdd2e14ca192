"""OpenAI request and response bodies, shared by the coordinator and the workers.

Requests are structured from JSON through one strict converter: a wrong type is a 400 that names
the field (`max_tokens: expected an integer, got str`). Keys that are not OpenAI fields are ignored
(clients send extensions of other servers); every OpenAI field is listed in `api/fields.py`, which
says whether it acts, is accepted only at its neutral value, or is refused with a 400 naming it.
Every field typed here acts (`api/fields.py` says how).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

RequestTypeName = Literal["context_and_generation", "context_only", "generation_only"]
ScheduleStyleName = Literal["context_first", "generation_first"]


@attrs.frozen(kw_only=True)
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage (so far) in every chunk


@attrs.frozen(kw_only=True)
class TopLogprob:
    token_id: int
    logprob: float


@attrs.frozen(kw_only=True)
class FirstTokenLogprobs:
    """The logprob and top-k of one token ctx sampled, carried to gen in `first_gen_logprobs`
    (by token id: token strings do not map back to ids)."""

    token_id: int
    logprob: float
    top_logprobs: list[TopLogprob] = attrs.Factory(list)
    rank: int | None = None  # a prompt token's (`prompt_logprobs`)


@attrs.frozen(kw_only=True)
class DisaggregatedParams:
    """What crosses between the legs of a disaggregated request (DESIGN.md §2)."""

    request_type: RequestTypeName = "context_and_generation"
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    disagg_request_id: int | None = None
    # The key the KV transfer goes under, a capability: random 64 bits (the coordinator mints one
    # per attempt; ctx mints one for a client that gives neither this nor disagg_request_id,
    # which is otherwise taken as the key). ctx's answer carries it to gen.
    transfer_key: int | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None
    opaque_state: str | None = None
    draft_tokens: list[int] | None = None
    # generation_first: this generation_only request was posted before ctx answered, so it has
    # no first_gen_tokens; they come with the KV (the transfer result).
    schedule_style: ScheduleStyleName | None = None
    # A request with n > 1 choices: ctx's first token of each, in choice order (one prefill
    # and one KV transfer serve them all); `first_gen_tokens` then holds choice 0's.
    first_gen_tokens_by_choice: list[int] | None = None
    # One entry per choice's first token when the request asks for logprobs: gen emits them
    # with ctx's tokens, so the answer has one logprobs entry per token.
    first_gen_logprobs: list[FirstTokenLogprobs] | None = None
    # Completions' echo with logprobs, or `prompt_logprobs`: ctx's logprobs of prompt tokens 1,
    # 2, ... (token 0 has none), computed by its prefill; gen answers with them.
    prompt_logprobs: list[FirstTokenLogprobs] | None = None


@attrs.frozen(kw_only=True)
class KvRelease:
    """`POST /disagg/release` to a ctx worker: the coordinator gave up on this request's gen
    leg before any gen took its KV, so ctx stops holding it. Names the transfer by its key
    (`disagg_request_id` alone: a key a client chose, as `DisaggregatedParams` takes it)."""

    transfer_key: int | None = None
    disagg_request_id: int | None = None

    @property
    def key(self) -> int | None:
        return self.transfer_key if self.transfer_key is not None else self.disagg_request_id


@attrs.frozen(kw_only=True)
class KvEventsRead:
    """`POST /kv_cache_events` with a body: the events after id `after` (-1: every event the
    worker keeps). A reader with a cursor of its own, such as each front end of a fleet, reads
    every event; a body-less POST drains them instead."""

    after: int


@attrs.frozen(kw_only=True)
class ContentPart:
    type: str
    text: str | None = None


@attrs.frozen(kw_only=True)
class FunctionCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@attrs.frozen(kw_only=True)
class ToolCall:
    id: str
    function: FunctionCall
    type: str = "function"


@attrs.frozen(kw_only=True)
class FunctionDefinition:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


@attrs.frozen(kw_only=True)
class Tool:
    type: str
    function: FunctionDefinition


@attrs.frozen(kw_only=True)
class ChatMessage:
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # an assistant's earlier thinking (a reasoning model's answer gave it apart); its chat
    # template decides whether it reads it (Qwen3's keeps it for the current tool-calling turn)
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")


@attrs.frozen(kw_only=True)
class _SamplingFields:
    """Fields common to both routes (attrs inheritance keeps one definition)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    logprob_token_ids: list[int] | None = None  # vLLM's: the logprobs' alternatives
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None  # vLLM's: left (keeps the end) or right
    stream_interval: int | None = None  # vLLM's: tokens a stream's chunk carries at least
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and top n
    cache_salt: str | None = None
    bad_words: list[str] | None = None
    n: int = 1
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's structured outputs (api/grammars.py): one of json, regex, choice, grammar
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    request_id: str | None = None
    return_perf_metrics: bool = False
    disaggregated_params: DisaggregatedParams | None = None
    conversation_id: str | None = None
    session_id: str | None = None  # vLLM's name for the same affinity
    # Coordinator-internal: the prompt already tokenised by ctx, so gen need not re-tokenise.
    prompt_token_ids: list[int] | None = None


@attrs.frozen(kw_only=True)
class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None


@attrs.frozen(kw_only=True)
class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: the answer starts with a last assistant message
    documents: list[dict[str, Any]] | None = None  # vLLM's: the template's `documents`
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True  # vLLM's: false drops a reasoning model's thinking


AnyRequest = CompletionRequest | ChatCompletionRequest


@attrs.frozen(kw_only=True)
class PromptTokensDetails:
    cached_tokens: int = 0


@attrs.frozen(kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = attrs.Factory(PromptTokensDetails)
    # A reasoning model's thinking among the completion tokens (`completion_tokens_details`);
    # None for a model that does not think.
    reasoning_tokens: int | None = None

    @classmethod
    def of(
        cls, prompt: int, completion: int, cached: int = 0, *, reasoning: int | None = None
    ) -> Usage:
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            reasoning_tokens=reasoning,
        )


@attrs.frozen(kw_only=True)
class PerfMetrics:
    """Per-request phase breakdown, seconds unless named otherwise."""

    queue_s: float | None = None
    prefill_s: float | None = None
    first_token_s: float | None = None
    decode_s: float | None = None
    kv_transfer_bytes: int | None = None
    kv_transfer_s: float | None = None
    ctx_s: float | None = None
    coordinator_queue_s: float | None = None
    gen_first_token_s: float | None = None


def prune(value: Any) -> Any:
    """Drop None-valued keys recursively: OpenAI bodies omit what they do not carry."""
    if isinstance(value, dict):
        return {k: prune(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [prune(v) for v in value]
    return value
