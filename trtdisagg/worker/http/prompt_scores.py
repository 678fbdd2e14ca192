"""vLLM's `prompt_logprobs` answer field: how likely the model found each prompt token. Pure.

One entry per prompt token: null for the first (nothing precedes it), then a map from token id to
``{logprob, rank, decoded_token}``, the prompt token first and the `top` most likely tokens at
that position after it (a token that is both appears once), as vLLM answers. Scoring and
distillation clients read it: they send a text and read the model's view of every token of it.

Where it goes (`responses.py`): a whole completions answer has it in each choice, a chat answer
at its top level; a stream has it in each choice's first chunk with an output (completions) or in
the first such chunk of the answer (chat). vLLM refuses it in a stream; here it streams, as echo's
prompt logprobs do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from trtdisagg.worker.token_logprobs import TokenLogprobs

Json = dict[str, Any]

LOWEST_LOGPROB: Final = -9999.0
"""What a -inf logprob is written as (JSON has no infinity), as vLLM writes it."""


def prompt_scores(
    prompt_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs] | None,
    top: int,
    text_of: Callable[[int], str],
) -> list[Json | None]:
    """The field for a prompt, from the logprobs of its tokens 1, 2, ... (`logprobs`, each with
    at least `top` alternatives); entries without logprobs (none computed) are null."""
    if logprobs is None or len(logprobs) != len(prompt_ids) - 1:
        return [None] * len(prompt_ids)
    out: list[Json | None] = [None]
    for token, lp in zip(prompt_ids[1:], logprobs, strict=True):
        entry = {str(token): _score(lp.logprob, lp.rank, text_of(token))}
        for rank, (alternative, value) in enumerate(lp.top[:top], start=1):
            entry.setdefault(str(alternative), _score(value, rank, text_of(alternative)))
        out.append(entry)
    return out


def with_top(logprobs: Sequence[TokenLogprobs] | None, top: int) -> list[TokenLogprobs] | None:
    """`logprobs` with at most `top` alternatives each: echo's count, when `prompt_logprobs`
    asked for more of the same prompt."""
    if logprobs is None:
        return None
    return [lp if len(lp.top) <= top else _cut(lp, top) for lp in logprobs]


def _cut(lp: TokenLogprobs, top: int) -> TokenLogprobs:
    return TokenLogprobs(logprob=lp.logprob, top=lp.top[:top], rank=lp.rank)


def _score(logprob: float, rank: int | None, text: str) -> Json:
    return {"logprob": max(logprob, LOWEST_LOGPROB), "rank": rank, "decoded_token": text}
