"""One request → its choices: which prompt and which seed each choice gets. Pure functions.

A completion request with P prompts and `n` asks for P × n choices; choice `p × n + i` is the
i-th sample of prompt p (OpenAI's order). A chat request has one prompt. A prompt's `n` choices
share it: the worker prefills it once and forks it `n` ways (`worker/engine/forks.py`), and the
coordinator runs one ctx → gen pair per prompt, its body carrying `n` (`prompt_body`).

`best_of` > `n` (completions): each prompt generates `best_of` candidates, and the `n` with the
highest cumulative logprob (the sum of their tokens' logprobs) are its choices, best first.

Seeds: with a `seed`, choice i of every prompt samples with `choice_seed(seed, i)`. Choice 0 keeps
the seed itself, so `n = 1` answers equal the first choice of `n > 1`; choice i ≥ 1 takes the first
8 bytes of BLAKE2b over ``trtdisagg-choice:{seed}:{i}`` as a big-endian signed int64. A prompt's
choices do not depend on the other prompts of the batch, so a batched request equals its prompts
sent one by one.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import attrs

from trtdisagg.api.protocol import ChatCompletionRequest, CompletionRequest
from trtdisagg.api.validation import Prompt, num_candidates, prompts_of

AnyRequest = CompletionRequest | ChatCompletionRequest


@attrs.frozen(kw_only=True)
class ChoicePlan:
    index: int  # the choice's `index` in the answer
    prompt_index: int
    sample_index: int  # i in [0, n)
    prompt: Prompt | None  # completions: this choice's prompt; chat: None (the messages)
    seed: int | None


def choice_seed(seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a prompt, for a request's `seed` (module docstring)."""
    if sample_index == 0:
        return seed
    digest = hashlib.blake2b(
        f"trtdisagg-choice:{seed}:{sample_index}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "big", signed=True)


def plan_choices(req: AnyRequest) -> list[ChoicePlan]:
    """Every choice generated, in order: with `best_of` > `n`, each prompt's `best_of`
    candidates (index p × best_of + i until the best `n` are picked: `pick_best`)."""
    prompts: list[Prompt | None] = (
        list(prompts_of(req)) if isinstance(req, CompletionRequest) else [None]
    )
    per_prompt = num_candidates(req)
    return [
        ChoicePlan(
            index=p * per_prompt + i,
            prompt_index=p,
            sample_index=i,
            prompt=prompt,
            seed=None if req.seed is None else choice_seed(req.seed, i),
        )
        for p, prompt in enumerate(prompts)
        for i in range(per_prompt)
    ]


def prompt_body(body: dict[str, Any], prompt: Prompt, req: AnyRequest) -> dict[str, Any]:
    """The JSON body of one prompt of a batch as a request of its own (the coordinator's legs):
    that prompt, with the client's `n` and `seed` (choice i's seed is derived from it, on the
    worker, as for a request sent alone). Fields the coordinator does not interpret are kept."""
    out = copy.copy(body)
    if isinstance(req, CompletionRequest) and req.prompt is not None:
        out["prompt"] = prompt
    return out
