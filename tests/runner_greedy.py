"""Greedy generation through `ModelRunner.execute`, with hand-made step plans.

No scheduler: every prompt is prefilled in one step, then all sequences decode together, one
token per step, so each step after the first is decode-only (the batched / CUDA-graph path).
Blocks are handed out in a shuffled order so that tables are not contiguous.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from trtdisagg.kv.block_pool import BlockTable
from trtdisagg.worker.request import Request, SamplingParams
from trtdisagg.worker.runner import ModelRunner
from trtdisagg.worker.sampling import SampleSpec
from trtdisagg.worker.scheduler import ScheduledItem, StepPlan


def runner_greedy(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    seed: int = 0,
    stagger: bool = False,
    plans: list[StepPlan] | None = None,
) -> list[list[int]]:
    """Greedy tokens of every prompt, generated as one batch.

    With `stagger`, prompt i joins at step i, so its prefill shares a step with the earlier
    prompts' decodes (decodes first, as the scheduler orders them): mixed steps. Every plan run
    is appended to `plans` when given.
    """
    tpb = runner.tokens_per_block
    needed = [math.ceil((len(p) + max_new_tokens) / tpb) for p in prompts]
    if sum(needed) > runner.cache.num_blocks:
        raise ValueError(f"{sum(needed)} blocks needed, the pool has {runner.cache.num_blocks}")
    order = list(range(runner.cache.num_blocks))
    random.Random(seed).shuffle(order)
    requests: list[Request] = []
    for i, (prompt, count) in enumerate(zip(prompts, needed, strict=True)):
        blocks, order = order[:count], order[count:]
        requests.append(
            Request(
                request_id=i,
                prompt_token_ids=list(prompt),
                sampling=SamplingParams(max_tokens=max_new_tokens, temperature=0.0),
                arrival_time=0.0,
                block_table=BlockTable(block_ids=blocks),
            )
        )
    specs = {r.request_id: SampleSpec(params=r.sampling, generator=None) for r in requests}
    by_id = {r.request_id: r for r in requests}
    steps = max_new_tokens + (len(requests) - 1 if stagger else 0)
    for step in range(steps):
        active = [
            r
            for i, r in enumerate(requests)
            if (not stagger or i <= step) and len(r.output_token_ids) < max_new_tokens
        ]
        active.sort(key=lambda r: r.num_computed_tokens == 0)  # decodes first
        items = tuple(
            ScheduledItem(
                request=r, num_new_tokens=r.num_tokens - r.num_computed_tokens, samples=True
            )
            for r in active
        )
        plan = StepPlan(items=items, num_tokens=sum(i.num_new_tokens for i in items))
        if plans is not None:
            plans.append(plan)
        out = runner.execute(plan, specs)
        assert len(out.sampled) == len(active)
        for sampled in out.sampled:
            request = by_id[sampled.request_id]
            request.num_computed_tokens = request.num_tokens
            request.output_token_ids.append(sampled.token_id)
    return [list(r.output_token_ids) for r in requests]
