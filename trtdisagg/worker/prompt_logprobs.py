"""Prompt logprobs (completions' `echo` with `logprobs`): each prompt token's logprob given the
tokens before it, computed by the prefill that runs anyway.

Only a request that asks gets them, so no other request pays for full-vocabulary logits of its
prompt positions: its prefill chunks name the prompt token each position predicts
(`with_prompt_targets`), the runner asks the model for the logits of those positions too (rows
after every sequence's last position: `ItemInputs.num_extra_rows`), and `prompt_logprobs_of`
reads them. Such a request takes nothing from the prefix cache (`Scheduler`): a cached block's
positions are never computed. On a disaggregated request, ctx computes them and gen emits them
(`disaggregated_params.prompt_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from trtdisagg.worker.rank_plan import ItemInputs
from trtdisagg.worker.request import Request
from trtdisagg.worker.sampling import prompt_token_logprobs
from trtdisagg.worker.token_logprobs import TokenLogprobs


@attrs.frozen(kw_only=True)
class PromptLogprobs:
    """The logprobs of prompt tokens `start`, `start + 1`, ... of a request (position 0 has
    none: nothing precedes it), from one prefill chunk."""

    request_id: int
    start: int
    logprobs: tuple[TokenLogprobs, ...]


def wants_prompt_logprobs(request: Request) -> bool:
    """Whether a step of this request computes prompt logprobs: it asks for them and has no
    output yet (a preempted request recomputing its prompt has them already)."""
    return request.sampling.prompt_logprobs is not None and not request.output_token_ids


def with_prompt_targets(inputs: ItemInputs, request: Request) -> ItemInputs:
    """`inputs` with the prompt tokens its positions predict: position q precedes q + 1."""
    prompt = request.prompt_token_ids
    last = min(inputs.end, len(prompt) - 1)  # the last prompt token a position predicts
    return attrs.evolve(
        inputs,
        prompt_logprobs=request.sampling.prompt_logprobs,
        prompt_targets=tuple(prompt[inputs.start + 1 : last + 1]),
    )


def prompt_logprobs_of(
    logits: torch.Tensor, items: Sequence[ItemInputs]
) -> tuple[PromptLogprobs, ...]:
    """Each prompt-logprobs item's logprobs, from its extra rows (after every item's last
    position) then its last position's row when that predicts a prompt token too."""
    out: list[PromptLogprobs] = []
    extra = len(items)
    for i, item in enumerate(items):
        num_extra = item.num_extra_rows
        if item.prompt_logprobs is not None and item.prompt_targets:
            index = list(range(extra, extra + num_extra)) + ([] if item.samples else [i])
            rows = logits[torch.tensor(index, device=logits.device)]
            values = prompt_token_logprobs(rows, item.prompt_targets, item.prompt_logprobs)
            out.append(
                PromptLogprobs(
                    request_id=item.request_id, start=item.start + 1, logprobs=tuple(values)
                )
            )
        extra += num_extra
    return tuple(out)
