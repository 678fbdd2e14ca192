"""A request inside a worker, and the state machine it moves through.

Lifecycle (``RequestState``), by request type:

1. WAITING: queued in the scheduler; holds no blocks. A new request starts here, and a preempted
   one comes back here (its blocks are gone, so it will recompute prompt and outputs from scratch;
   its output tokens are kept, so what it produces does not change).
2. RUNNING: holds a block table; the scheduler gives it a prefill chunk per step while
   ``num_computed_tokens < num_tokens - 1``, then one decode token per step.
3. GEN_WAITING_KV (generation_only): blocks are allocated for the whole prompt and the KV cache
   transfer from the ctx instance is in flight. Not schedulable, not preemptable: a peer is
   writing into those blocks. When the KV has arrived, it becomes RUNNING with the whole prompt
   computed and ctx's first token as its first output.
4. CTX_SENDING (context_only): prefill is done and the first token sampled; the blocks are pinned
   until the transfer to the gen instance is final. Not schedulable, not preemptable: a peer is
   reading those blocks.
5. FINISHED: holds no blocks; ``finish_reason`` says why.

Transitions::

    WAITING ──> RUNNING ──> FINISHED                  context_and_generation
       ^           │
       └─preempt───┘
    WAITING ──> RUNNING ──> CTX_SENDING ──> FINISHED  context_only
    WAITING ──> GEN_WAITING_KV ──> RUNNING ──> FINISHED   generation_only (preempt as above)
    any state but FINISHED ──> FINISHED               (abort, error, length)

Pure: no I/O. The scheduler moves requests; the executor reads them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from typing import Final

import attrs

from trtdisagg.errors import CapacityError, InvalidTransition
from trtdisagg.kv.block_pool import BlockTable


class RequestType(enum.Enum):
    CONTEXT_AND_GENERATION = "context_and_generation"
    CONTEXT_ONLY = "context_only"
    GENERATION_ONLY = "generation_only"


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    GEN_WAITING_KV = "gen_waiting_kv"
    CTX_SENDING = "ctx_sending"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_S = RequestState
_ALLOWED: Final[dict[RequestState, frozenset[RequestState]]] = {
    _S.WAITING: frozenset({_S.RUNNING, _S.GEN_WAITING_KV, _S.FINISHED}),
    _S.RUNNING: frozenset({_S.WAITING, _S.CTX_SENDING, _S.FINISHED}),
    _S.GEN_WAITING_KV: frozenset({_S.RUNNING, _S.FINISHED}),
    _S.CTX_SENDING: frozenset({_S.FINISHED}),
    _S.FINISHED: frozenset(),
}
# Transitions that only one request type may take: the disaggregated legs.
_ONLY_FOR: Final[dict[tuple[RequestState, RequestState], RequestType]] = {
    (_S.WAITING, _S.GEN_WAITING_KV): RequestType.GENERATION_ONLY,
    (_S.RUNNING, _S.CTX_SENDING): RequestType.CONTEXT_ONLY,
}


def _str_tuple(values: Iterable[str]) -> tuple[str, ...]:
    # A lone string is an iterable of characters, never a list of stop strings.
    return (values,) if isinstance(values, str) else tuple(values)


def _int_frozenset(values: Iterable[int]) -> frozenset[int]:
    return frozenset(values)


def _optional_int_frozenset(values: Iterable[int] | None) -> frozenset[int] | None:
    return None if values is None else frozenset(values)


def _optional_int_tuple(values: Iterable[int] | None) -> tuple[int, ...] | None:
    return None if values is None else tuple(int(v) for v in values)


def _id_sequences(values: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(token) for token in ids) for ids in values)


def _bias_pairs(
    values: Mapping[int, float] | Iterable[tuple[int, float]],
) -> tuple[tuple[int, float], ...]:
    """A token → bias mapping (or its pairs) as pairs sorted by token: hashable, one order."""
    pairs = values.items() if isinstance(values, Mapping) else values
    return tuple(sorted((int(token), float(bias)) for token, bias in pairs))


MIN_TEMPERATURE: Final = 1e-5
"""Below this a temperature samples greedily: logits / temperature overflows float32 and the
softmax turns to NaN (greedy is the limit as the temperature goes to 0)."""
MAX_PENALTY: Final = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty
MAX_LOGIT_BIAS: Final = 100.0  # OpenAI's bound on a logit_bias value


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_int_frozenset)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per output token; None: none
    # vLLM's: with `logprobs`, these tokens' logprobs are each token's alternatives instead of
    # the N most likely
    logprob_token_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=_optional_int_tuple
    )
    min_tokens: int = 0
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one; 0: off
    presence_penalty: float = 0.0  # minus this from a logit whose token is in the output
    frequency_penalty: float = 0.0  # minus this × the token's count in the output
    repetition_penalty: float = 1.0  # on tokens of prompt or output: divide > 0, multiply < 0
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_bias_pairs)
    # top-N logprobs of each prompt token (given the tokens before it), computed by prefill;
    # None: none (completions' `echo` with `logprobs`)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False  # the text ends with the stop string it met
    skip_special_tokens: bool = True  # False: special tokens' text stays in the output
    # vLLM's: only these tokens may be sampled; None: any token
    allowed_token_ids: frozenset[int] | None = attrs.field(
        default=None, converter=_optional_int_frozenset
    )
    # vLLM's: words kept out of the output as the tokenizer spells them. The engine reads
    # `bad_word_ids`, their token sequences, which whoever holds the tokenizer fills in
    # (`token_bans.bad_word_ids`).
    bad_words: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    bad_word_ids: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_id_sequences)
    # vLLM's: the model reads the prompt's last k tokens (-1: its context). The HTTP front and
    # `LLM` cut the prompt; the engine gets the cut prompt.
    truncate_prompt_tokens: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        named = self.logprob_token_ids
        if named is not None and (self.logprobs is None or not named or min(named) < 0):
            raise ValueError(
                f"logprob_token_ids must be non-negative token ids, with logprobs, got {named}"
            )
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop must not contain an empty string")
        if any(t < 0 for t in self.stop_token_ids):
            bad = sorted(t for t in self.stop_token_ids if t < 0)
            raise ValueError(f"stop_token_ids must be non-negative, got {bad}")
        self._check_controls()

    def _check_controls(self) -> None:
        if not 0.0 <= self.min_p <= 1.0:  # also rejects NaN
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        tokens = [token for token, _ in self.logit_bias]
        if len(set(tokens)) != len(tokens):
            raise ValueError("logit_bias names a token twice")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias: token {token} with bias {bias}: tokens are non-negative, "
                    "biases in [-100, 100]"
                )
        self._check_bans()

    def _check_bans(self) -> None:
        keep = self.truncate_prompt_tokens
        if keep is not None and keep != -1 and keep < 1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}")
        allowed = self.allowed_token_ids
        if allowed is not None and not allowed:
            raise ValueError("allowed_token_ids must not be empty (leave it out to allow any)")
        if allowed is not None and min(allowed) < 0:
            raise ValueError(f"allowed_token_ids must be non-negative, got {min(allowed)}")
        if any(not word.strip() for word in self.bad_words):
            raise ValueError("bad_words must not contain an empty or blank string")
        for ids in self.bad_word_ids:
            if not ids or min(ids) < 0:
                raise ValueError(f"bad_word_ids: each must be non-empty token ids, got {ids}")

    @property
    def penalized(self) -> bool:
        """Whether a penalty acts, so sampling needs the request's tokens so far."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def bans_after_tokens(self) -> bool:
        """Whether a bad word of several tokens bans its last one after the others, so sampling
        needs the request's output so far."""
        return any(len(ids) > 1 for ids in self.bad_word_ids)


@attrs.define(eq=False, kw_only=True)
class Request:
    """One request's tokens, progress and blocks. Changed only by the scheduler and executor."""

    request_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    request_type: RequestType = RequestType.CONTEXT_AND_GENERATION
    arrival_time: float
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = attrs.field(factory=list)
    # Tokens whose KV is in the cache. Before a step, a RUNNING request has
    # num_computed_tokens <= num_tokens - 1: the last token is always still to compute.
    num_computed_tokens: int = 0
    # Prompt tokens reused from the prefix cache at the last admission (usage.cached_tokens).
    num_cached_tokens: int = 0
    block_table: BlockTable | None = None
    # Where its blocks' hash chain starts (`kv.hashing.salt_root` of its `cache_salt`): it
    # shares cached prefixes only with requests of the same root.
    root: int | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Tokens that a step in flight samples, not known on the host yet (asynchronous steps): the
    # next step already computes from them (its input comes from the device), so they count in
    # `num_tokens`, not in `output_token_ids`. The engine's loop sets and resolves them.
    pending_tokens: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: prompt_token_ids must not be empty")

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens known on the host (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, those still pending included (what the steps compute)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens known on the host."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def sampled(self, token_id: int) -> None:
        """A token of a step arrived: it becomes the next output (and stops being pending)."""
        self.output_token_ids.append(token_id)
        if self.pending_tokens > 0:
            self.pending_tokens -= 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """More than the last token is still to compute: the next step is a prefill chunk."""
        return self.num_computed_tokens < self.num_tokens - 1

    def to(self, state: RequestState) -> None:
        """Move to ``state``.

        Raises:
            InvalidTransition: the lifecycle has no such edge, or not for this request type.
        """
        self.check_transition(state)
        self.state = state

    def check_transition(self, state: RequestState) -> None:
        """Raise what ``to(state)`` would raise, without moving.

        Raises:
            InvalidTransition: the lifecycle has no such edge, or not for this request type.
        """
        if state not in _ALLOWED[self.state]:
            raise InvalidTransition(self.request_id, self.state, state)
        only_for = _ONLY_FOR.get((self.state, state))
        if only_for is not None and self.request_type is not only_for:
            raise InvalidTransition(
                self.request_id,
                self.state,
                state,
                f"only {only_for.value} requests, this is {self.request_type.value}",
            )


def check_fits(num_prompt_tokens: int, *, max_seq_len: int, capacity: int) -> None:
    """Raise CapacityError when a prompt of `num_prompt_tokens` could never be served by an
    engine of this context length and KV capacity (tokens)."""
    if num_prompt_tokens >= max_seq_len:
        raise CapacityError(
            f"prompt has {num_prompt_tokens} tokens; this model's context is {max_seq_len} tokens"
        )
    if num_prompt_tokens + 1 > capacity:
        raise CapacityError(f"prompt has {num_prompt_tokens} tokens; the KV cache holds {capacity}")
