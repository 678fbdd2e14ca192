"""Semantic checks of a structured request, each a 400 naming its field (OpenAI's error shape).

`parse_request` is what the routes call: strict structuring (`codec`), the per-field rules
(`fields.check_fields`), then the checks below, which relate fields to each other (`best_of`
against `n`, `echo` with `logprobs`, `stream_options` without `stream`) or bound them (the
sampling controls' ranges, OpenAI's where it has them). Checks that need the model (the context
length, the vocabulary) are the worker's (`WorkerService`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, Final

from trtdisagg.api.chat import TEMPLATE_VARIABLES
from trtdisagg.api.errors import bad_request
from trtdisagg.api.grammars import output_grammar
from trtdisagg.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from trtdisagg.api.tool_calls import HERMES

AnyRequest = CompletionRequest | ChatCompletionRequest
Prompt = str | list[int]

MAX_CHOICES: Final = 128
"""n × prompts per request: each choice decodes as a sequence of its own, so a body of a few
bytes must not queue thousands of them."""
MAX_TOKENS_LIMIT: Final = 2**31
"""max_tokens at or above this is refused outright (no context is that long)."""
INT64: Final = (-(2**63), 2**63)
MAX_PENALTY: Final = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty
MAX_LOGIT_BIAS: Final = 100.0  # OpenAI's bound on a logit_bias value
MAX_STOP_STRINGS: Final = 16
MAX_STOP_STRING_CHARS: Final = 256
"""Bounds on ``stop``: each new piece of a choice's text is matched against every stop string,
holding back the longest start of one (`worker.stopping`), work that grows with their number
times their length, for every choice and token, on the loop that serves every request."""
MAX_CACHE_SALT_CHARS: Final = 1024
# A client's request_id becomes the answer's id, a log field and an SSE frame's text as it is.
_PRINTABLE_ID: Final = re.compile(r"[!-~]{1,128}")
MAX_BAD_WORDS: Final = 128
"""vLLM's bound on ``bad_words``: each is checked against the output before every token."""


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
    # The shape of an output constraint (the model's tool-call format and llguidance's compile
    # are the worker's to check): a malformed one is a 400 before any worker is asked.
    output_grammar(req, HERMES)
    choices = num_prompts(req) * num_candidates(req)
    if choices > MAX_CHOICES:
        field = "best_of" if num_candidates(req) > req.n else "n"
        raise bad_request(
            f"{field}: {field} × prompts must be at most {MAX_CHOICES}, got {choices}", param=field
        )
    kind = params.request_type if params is not None else "context_and_generation"
    if num_prompts(req) > 1 and kind != "context_and_generation":
        raise bad_request(
            f"disaggregated_params.request_type: a {kind} request has one prompt (its n "
            f"choices share its KV), this one has {num_prompts(req)}",
            param="disaggregated_params",
        )


def _validate_sampling(req: AnyRequest) -> None:
    if not 1 <= req.n <= MAX_CHOICES:
        raise bad_request(f"n: must be in [1, {MAX_CHOICES}], got {req.n}", param="n")
    limits: list[tuple[str, int | None]] = [("max_tokens", req.max_tokens)]
    if isinstance(req, ChatCompletionRequest):
        limits.append(("max_completion_tokens", req.max_completion_tokens))
    for name, value in limits:
        if value == 0 and isinstance(req, CompletionRequest) and req.echo:
            continue  # the prompt scored, nothing generated
        if value is not None and not 1 <= value < MAX_TOKENS_LIMIT:
            completion = isinstance(req, CompletionRequest)
            scoring = " (0 only with echo: the prompt scored)" if value == 0 and completion else ""
            raise bad_request(f"{name}: must be in [1, 2**31){scoring}, got {value}", param=name)
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
    _validate_stop(req.stop)
    bad_stop = next((t for t in req.stop_token_ids or () if t < 0), None)
    if bad_stop is not None:
        raise bad_request(
            f"stop_token_ids: token ids are non-negative, got {bad_stop}", param="stop_token_ids"
        )
    _validate_controls(req)
    _validate_bans(req)
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(
            f"cache_salt: 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(req.cache_salt)}",
            param="cache_salt",
        )
    if req.request_id is not None and not _PRINTABLE_ID.fullmatch(req.request_id):
        raise bad_request(
            "request_id: 1 to 128 printable ASCII characters, without spaces",
            param="request_id",
        )
    scores = req.prompt_logprobs
    if scores is not None and not 0 <= scores <= 20:
        raise bad_request(
            f"prompt_logprobs: must be in [0, 20] (-1, the whole vocabulary, is not served), "
            f"got {scores}",
            param="prompt_logprobs",
        )
    _validate_named_logprobs(req)
    if req.truncation_side not in (None, "left", "right"):
        raise bad_request(
            f"truncation_side: left or right, got {req.truncation_side!r}", param="truncation_side"
        )
    if req.stream_interval is not None and req.stream_interval < 1:
        raise bad_request(
            f"stream_interval: at least 1, got {req.stream_interval}", param="stream_interval"
        )
    keep = req.truncate_prompt_tokens
    if keep is not None and keep != -1 and keep < 1:
        raise bad_request(
            f"truncate_prompt_tokens: -1 (the model's context) or at least 1, got {keep}",
            param="truncate_prompt_tokens",
        )
    logit_bias_of(req)


def _validate_stop(stop: str | list[str] | None) -> None:
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(
            f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop"
        )
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise bad_request(
            f"stop: a stop string has at most {MAX_STOP_STRING_CHARS} characters, got one of "
            f"{longest}",
            param="stop",
        )


def _validate_controls(req: AnyRequest) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN too
            raise bad_request(f"{name}: must be in [-2, 2], got {value}", param=name)
    repetition = req.repetition_penalty
    if repetition is not None and not 0.0 < repetition < math.inf:
        raise bad_request(
            f"repetition_penalty: must be above 0 (1: off), got {repetition}",
            param="repetition_penalty",
        )
    if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:
        raise bad_request(f"min_p: must be in [0, 1], got {req.min_p}", param="min_p")


def kept_prompt(
    ids: list[int], keep: int | None, context: int | None, side: str | None = None
) -> list[int]:
    """The prompt tokens the model reads under `truncate_prompt_tokens` `keep` (vLLM's): the
    last `keep`, or with -1 the last `context` (the model's; None: all); the first ones instead
    when `truncation_side` is right."""
    count = context if keep == -1 else keep
    if count is None:
        return ids
    return ids[:count] if side == "right" else ids[-count:]


def _validate_named_logprobs(req: AnyRequest) -> None:
    """vLLM's `logprob_token_ids`: 1 to 20 ids, with logprobs asked for."""
    named = req.logprob_token_ids
    if named is None:
        return
    if not 0 < len(named) <= 20 or min(named) < 0:
        raise bad_request(
            f"logprob_token_ids: 1 to 20 non-negative token ids, got {len(named)} ids",
            param="logprob_token_ids",
        )
    asked = req.logprobs is True if isinstance(req, ChatCompletionRequest) else req.logprobs
    if asked is None or asked is False:
        needs = "logprobs: true" if isinstance(req, ChatCompletionRequest) else "logprobs"
        raise bad_request(f"logprob_token_ids: needs {needs}", param="logprob_token_ids")


def _validate_bans(req: AnyRequest) -> None:
    """vLLM's `allowed_token_ids` and `bad_words`; the vocabulary is the worker's to check."""
    allowed = req.allowed_token_ids
    if allowed is not None and not allowed:
        raise bad_request(
            "allowed_token_ids: must not be empty (leave it out to allow any token)",
            param="allowed_token_ids",
        )
    bad = next((t for t in allowed or () if t < 0), None)
    if bad is not None:
        raise bad_request(
            f"allowed_token_ids: token ids are non-negative, got {bad}", param="allowed_token_ids"
        )
    words = req.bad_words or []
    if len(words) > MAX_BAD_WORDS:
        raise bad_request(
            f"bad_words: at most {MAX_BAD_WORDS} words, got {len(words)}", param="bad_words"
        )
    for i, word in enumerate(words):
        if not word.strip() or len(word) > MAX_STOP_STRING_CHARS:
            raise bad_request(
                f"bad_words[{i}]: a word is 1 to {MAX_STOP_STRING_CHARS} characters, not blank, "
                f"got {word!r}",
                param="bad_words",
            )


def logit_bias_of(req: AnyRequest) -> dict[int, float]:
    """`logit_bias` by token id. Keys are token ids written in decimal without sign or leading
    zeros (so that no two keys name one token); values in [-100, 100]. The vocabulary is the
    worker's to check."""
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdecimal() and str(int(key)) == key):
            raise bad_request(
                f"logit_bias: keys are token ids in decimal, got {key!r}", param="logit_bias"
            )
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NaN too
            raise bad_request(
                f"logit_bias: the bias of token {key} must be in [-100, 100], got {value}",
                param="logit_bias",
            )
        bias[int(key)] = value
    return bias


def _validate_completion(req: CompletionRequest) -> None:
    _validate_prompt(req)
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise bad_request(f"logprobs: must be in [0, 20], got {req.logprobs}", param="logprobs")
    if req.best_of is not None and not req.n <= req.best_of <= MAX_CHOICES:
        raise bad_request(
            f"best_of: must be in [n = {req.n}, {MAX_CHOICES}], got {req.best_of}",
            param="best_of",
        )


def _validate_chat(req: ChatCompletionRequest) -> None:
    if req.messages is None:
        raise bad_request("messages: required field missing", param="messages")
    if not req.messages:
        raise bad_request("messages: must not be empty", param="messages")
    _validate_content_parts(req.messages)
    _validate_rendering(req)
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
    _validate_tool_choice(req.tool_choice, bool(req.tools))


def _validate_rendering(req: ChatCompletionRequest) -> None:
    """vLLM's chat rendering controls (`api/chat.py`)."""
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise bad_request(
                "continue_final_message: needs add_generation_prompt: false (an assistant turn "
                "cannot both start and go on)",
                param="continue_final_message",
            )
        last = req.messages[-1] if req.messages else None
        if last is None or last.role != "assistant":
            raise bad_request(
                "continue_final_message: the last message must be the assistant's, got "
                f"{last.role if last else None!r}",
                param="continue_final_message",
            )
    clash = sorted(TEMPLATE_VARIABLES & set(req.chat_template_kwargs or {}))
    if clash:
        raise bad_request(
            f"chat_template_kwargs: {clash[0]!r} is set by the request itself",
            param="chat_template_kwargs",
        )


def _validate_content_parts(messages: Sequence[ChatMessage]) -> None:
    """Text parts only: the models served read text, and an image or audio part left out of
    the prompt would get an answer to a question the client did not ask."""
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if part.type != "text":
                raise bad_request(
                    f"{where}.type: this model reads text only: expected 'text', got {part.type!r}",
                    param="messages",
                )
            if part.text is None:
                raise bad_request(f"{where}.text: required field missing", param="messages")


def _validate_tool_choice(choice: str | dict[str, Any] | None, has_tools: bool) -> None:
    if choice is None or choice in ("none", "auto"):
        return
    if choice != "required" and not isinstance(choice, dict):
        raise bad_request(
            f"tool_choice: expected 'none', 'auto', 'required' or a function, got {choice!r}",
            param="tool_choice",
        )
    if not has_tools:
        raise bad_request(
            "tool_choice: a call is asked for, but no tools are given", param="tool_choice"
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


def num_candidates(req: AnyRequest) -> int:
    """Choices generated per prompt: `best_of` of them (completions), of which `n` are returned,
    else `n`."""
    if isinstance(req, CompletionRequest) and req.best_of is not None:
        return max(req.best_of, req.n)
    return req.n
