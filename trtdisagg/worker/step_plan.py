"""What one forward step computes (`StepPlan`), and the plan under construction (pure).

The scheduler builds a plan each step (`scheduler.py`); the runner computes it; every non-empty
plan goes back to the scheduler (`Scheduler.step_done`).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from trtdisagg.kv.block_pool import BlockCopy, BlockPoolStatistics
from trtdisagg.worker.request import Request


@attrs.frozen(kw_only=True, eq=False)
class ScheduledItem:
    """One request's part of a step: ``num_new_tokens`` tokens from ``num_computed_tokens`` on."""

    request: Request
    num_new_tokens: int
    samples: bool  # the chunk reaches the last token, so the step produces a token for it


@attrs.frozen(kw_only=True, eq=False)
class StepPlan:
    """What one forward step computes. Decodes come first, then prefill chunks."""

    items: tuple[ScheduledItem, ...]
    # KV to copy before the forward, in order: forks' shared blocks that items write this step
    # (copy-on-write, `BlockPool.unshare`).
    copies: tuple[BlockCopy, ...] = ()
    preempted: tuple[Request, ...] = ()  # back to WAITING this step; their blocks are gone
    finished: tuple[Request, ...] = ()  # ended by the scheduler this step (LENGTH); answer them
    num_tokens: int

    @property
    def is_empty(self) -> bool:
        """No forward to run (``finished`` may still need answers)."""
        return not self.items


@attrs.frozen(kw_only=True)
class SchedulerStatistics:
    num_waiting: int
    num_running: int
    num_gen_waiting_kv: int
    num_ctx_sending: int
    num_preemptions: int  # since start
    pool: BlockPoolStatistics


@attrs.frozen(kw_only=True)
class StepBudget:
    """Tokens a step may take: `max_num_tokens`; but while requests decode, with
    `prefill_chunk_tokens`, at most that many (the decode rows included) per prompt waiting to be
    admitted, at least one. A prompt then rides on the decode steps in small chunks, which
    lengthen those steps less than one large chunk does, while a queue of prompts raises the
    budget back towards `max_num_tokens` (prefill must keep up with arrivals)."""

    max_num_tokens: int = attrs.field(validator=attrs.validators.gt(0))
    prefill_chunk_tokens: int | None
    max_batch_size: int = attrs.field(validator=attrs.validators.gt(0))

    def __attrs_post_init__(self) -> None:
        chunk = self.prefill_chunk_tokens
        if chunk is not None and chunk <= self.max_batch_size:
            raise ValueError(  # a chunk must fit beside a full batch of decode rows
                f"prefill_chunk_tokens must exceed max_batch_size ({self.max_batch_size}), "
                f"got {chunk}"
            )

    def tokens(self, running: Sequence[Request], *, num_waiting: int) -> int:
        if self.prefill_chunk_tokens is None:
            return self.max_num_tokens
        prefilling = sum(r.is_prefilling for r in running)
        if prefilling == len(running) or not (prefilling or num_waiting):
            return self.max_num_tokens  # nothing decodes, or nothing to prefill
        return min(self.max_num_tokens, self.prefill_chunk_tokens * max(1, num_waiting))


@attrs.define(eq=False, kw_only=True)
class StepBuilder:
    """The plan under construction inside one ``schedule`` call."""

    budget: int  # tokens the step may still take, of max_num_tokens
    # Prompt positions whose logits rows the step may still compute for prompt logprobs (each
    # is a full-vocabulary float32 row): a long prompt that asks for them goes in smaller chunks.
    logit_rows: int
    items: list[ScheduledItem] = attrs.field(factory=list)
    scheduled: set[int] = attrs.field(factory=set)  # request ids
    preempted: list[Request] = attrs.field(factory=list)
    finished: list[Request] = attrs.field(factory=list)
    copies: list[BlockCopy] = attrs.field(factory=list)

    def room(self, request: Request, wanted: int) -> int:
        """How many of `wanted` tokens `request`'s next prefill chunk may take in this step."""
        if request.sampling.prompt_logprobs is None:
            return min(wanted, self.budget)
        return min(wanted, self.budget, self.logit_rows)

    def add(self, request: Request, num_new_tokens: int) -> None:
        samples = request.num_computed_tokens + num_new_tokens == request.num_tokens
        self.items.append(
            ScheduledItem(request=request, num_new_tokens=num_new_tokens, samples=samples)
        )
        self.scheduled.add(request.request_id)
        self.budget -= num_new_tokens
        if request.sampling.prompt_logprobs is not None and request.is_prefilling:
            self.logit_rows -= num_new_tokens

    def plan(self, max_num_tokens: int) -> StepPlan:
        return StepPlan(
            items=tuple(self.items),
            copies=tuple(self.copies),
            preempted=tuple(self.preempted),
            finished=tuple(self.finished),
            num_tokens=max_num_tokens - self.budget,
        )
