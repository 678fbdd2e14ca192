"""Semantic checks of a structured request, each a 400 naming its field (OpenAI's error shape).

`parse_request` is what the routes call: strict structuring (`codec`), the per-field rules
(`fields.check_fields`), then the checks below, which relate fields to each other (`best_of`
against `n`, `echo` with `logprobs`, `stream_options` without `stream`) or bound them. Checks that
need the model (the context length, the vocabulary) are the worker's (`WorkerService`).
"""

from __future__ import annotations

from typing import Any, Final

from trtdisagg.api.errors import bad_request
from trtdisagg.api.protocol import ChatCompletionRequest, CompletionRequest

AnyRequest = CompletionRequest | ChatCompletionRequest
Prompt = str | list[int]

MAX_CHOICES: Final = 128
"""n × prompts per request: each choice is a request of its own, so a body of a few bytes must
not queue thousands of them."""
MAX_TOKENS_LIMIT: Final = 2**31
"""max_tokens at or above this is refused outright (no context is that long)."""
INT64: Final = (-(2**63), 2**63)


def validate_request(req: AnyRequest) -> None:
    """Semantic checks after structuring; each failure names its field."""
    _validate_sampling(req)
    params = req.disaggregated_params
    key = params.disagg_request_id if params is not None else None
    if key is not None and not 0 <= key < 2**63:  # (0: mint one)
        raise bad_request(
            f"disaggregated_params.disagg_request_id: must be in [0, 2**63), got {key}",
            param="disaggregated_params",
        )
    transfer_key = params.transfer_key if params is not None else None
    if transfer_key is not None and not 0 < transfer_key < 2**64:  # the wire's keys are uint64
        raise bad_request(
            f"disaggregated_params.transfer_key: must be in (0, 2**64), got {transfer_key}",
            param="disaggregated_params",
        )
    if isinstance(req, CompletionRequest):
        _validate_completion(req)
    else:
        _validate_chat(req)
    choices = num_prompts(req) * req.n
    if choices > MAX_CHOICES:
        raise bad_request(f"n: n × prompts must be at most {MAX_CHOICES}, got {choices}", param="n")
    kind = params.request_type if params is not None else "context_and_generation"
    if choices > 1 and kind != "context_and_generation":
        raise bad_request(
            f"disaggregated_params.request_type: a {kind} request has one choice (one prompt, "
            f"n = 1), this one has {choices}",
            param="disaggregated_params",
        )


def _validate_sampling(req: AnyRequest) -> None:
    if not 1 <= req.n <= MAX_CHOICES:
        raise bad_request(f"n: must be in [1, {MAX_CHOICES}], got {req.n}", param="n")
    limits: list[tuple[str, int | None]] = [("max_tokens", req.max_tokens)]
    if isinstance(req, ChatCompletionRequest):
        limits.append(("max_completion_tokens", req.max_completion_tokens))
    for name, value in limits:
        if value is not None and not 1 <= value < MAX_TOKENS_LIMIT:
            raise bad_request(f"{name}: must be in [1, 2**31), got {value}", param=name)
    if req.temperature is not None and not 0.0 <= req.temperature <= 100.0:
        raise bad_request(
            f"temperature: must be in [0, 100], got {req.temperature}", param="temperature"
        )
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise bad_request(f"top_p: must be in (0, 1], got {req.top_p}", param="top_p")
    if req.top_k is not None and req.top_k < -1:
        raise bad_request(f"top_k: must be -1, 0 or positive, got {req.top_k}", param="top_k")
    if req.min_tokens < 0:
        raise bad_request(
            f"min_tokens: must not be negative, got {req.min_tokens}", param="min_tokens"
        )
    # torch seeds are 64-bit, and every choice's seed is derived within int64 (fanout.py).
    if req.seed is not None and not INT64[0] <= req.seed < INT64[1]:
        raise bad_request(f"seed: must be in [-2**63, 2**63), got {req.seed}", param="seed")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options: only allowed with stream: true", param="stream_options")
    bad_stop = next((t for t in req.stop_token_ids or () if t < 0), None)
    if bad_stop is not None:
        raise bad_request(
            f"stop_token_ids: token ids are non-negative, got {bad_stop}", param="stop_token_ids"
        )


def _validate_completion(req: CompletionRequest) -> None:
    _validate_prompt(req)
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise bad_request(f"logprobs: must be in [0, 20], got {req.logprobs}", param="logprobs")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(
            f"best_of: only best_of equal to n ({req.n}) is supported, got {req.best_of}",
            param="best_of",
        )
    if req.echo and req.logprobs is not None:
        raise bad_request(
            "echo: echo with logprobs needs the prompt's logprobs, which are not supported yet",
            param="echo",
        )


def _validate_chat(req: ChatCompletionRequest) -> None:
    if req.messages is None:
        raise bad_request("messages: required field missing", param="messages")
    if not req.messages:
        raise bad_request("messages: must not be empty", param="messages")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= 20:
            raise bad_request(
                f"top_logprobs: must be in [0, 20], got {req.top_logprobs}", param="top_logprobs"
            )
        if not req.logprobs:
            raise bad_request("top_logprobs: needs logprobs: true", param="top_logprobs")
    for i, tool in enumerate(req.tools or ()):
        if tool.type != "function":
            raise bad_request(
                f"tools[{i}].type: only function tools are supported, got {tool.type!r}",
                param="tools",
            )
    _validate_tool_choice(req.tool_choice)


def _validate_tool_choice(choice: str | dict[str, Any] | None) -> None:
    if choice is None or choice in ("none", "auto"):
        return
    what = f"{choice!r}" if isinstance(choice, str) else "a named function"
    if choice == "required" or isinstance(choice, dict):
        raise bad_request(
            f"tool_choice: {what} needs output constrained by a grammar, which is not "
            "supported yet; use 'auto' or 'none'",
            param="tool_choice",
        )
    raise bad_request(
        f"tool_choice: expected 'none', 'auto', 'required' or a function, got {what}",
        param="tool_choice",
    )


def _validate_prompt(req: CompletionRequest) -> None:
    prompt = req.prompt
    if prompt is None and req.prompt_token_ids is None:
        raise bad_request("prompt: required field missing", param="prompt")
    if prompt is not None and len(prompt) == 0:
        raise bad_request("prompt: must not be empty", param="prompt")
    for i, one in enumerate(prompts_of(req)):
        if len(one) == 0:
            where = f"prompt[{i}]" if is_batched(req) else "prompt"
            raise bad_request(f"{where}: must not be empty", param="prompt")


def is_batched(req: CompletionRequest) -> bool:
    """Whether `prompt` is a list of prompts (strings or token lists), even a list of one."""
    prompt = req.prompt
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)


def prompts_of(req: AnyRequest) -> list[Prompt]:
    """The prompts of a completion request, in order (chat requests have one, unused here)."""
    if not isinstance(req, CompletionRequest):
        return []
    prompt = req.prompt
    if prompt is None:
        return [list(req.prompt_token_ids or [])]
    if is_batched(req):
        batch: list[str] | list[list[int]] = prompt  # type: ignore[assignment]
        return [p if isinstance(p, str) else list(p) for p in batch]
    return [prompt]  # type: ignore[list-item]


def num_prompts(req: AnyRequest) -> int:
    return len(prompts_of(req)) if isinstance(req, CompletionRequest) else 1


def single_prompt(req: CompletionRequest) -> Prompt:
    """The first prompt of a validated completion request (the only one unless batched)."""
    return prompts_of(req)[0]
