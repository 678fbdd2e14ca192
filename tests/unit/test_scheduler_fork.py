"""`Scheduler.fork`: a prompt's `n` choices decode from one prefill, sharing its blocks.

The fake model writes every token into its KV slot and samples from what it reads back, after
making the plan's copies, so a fork that wrote into a sibling's block, or a copy made wrong or
forgotten, changes a sampled token or trips the read-back check.
"""

from __future__ import annotations

import itertools

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_scheduler import FakeModel, check_plan, make_request, make_scheduler
from trtdisagg.errors import InvalidTransition
from trtdisagg.kv.block_pool import BlockCopy
from trtdisagg.worker.request import FinishReason, Request, RequestState
from trtdisagg.worker.scheduler import Scheduler, StepPlan

T = 4
_ids = itertools.count(50_000)


@attrs.define(eq=False)
class CopyingModel(FakeModel):
    """The fake model, making each plan's KV copies first (as the runner does)."""

    def forward(self, plan: StepPlan) -> dict[int, int]:
        for copy in plan.copies:
            for slot in range(self.tokens_per_block):
                if (copy.src, slot) in self.kv:
                    self.kv[(copy.dst, slot)] = self.kv[(copy.src, slot)]
        return super().forward(plan)


def forks_of(leader: Request, firsts: list[int]) -> list[Request]:
    return [
        Request(
            request_id=next(_ids),
            prompt_token_ids=list(leader.prompt_token_ids),
            sampling=leader.sampling,
            arrival_time=0.0,
            output_token_ids=[first],
        )
        for first in firsts
    ]


def prefill(
    scheduler: Scheduler, model: FakeModel, leader: Request, firsts: list[int]
) -> list[Request]:
    """Prefill `leader` alone, then fork it: its first token and the forks' are given."""
    scheduler.add(leader)
    while not leader.output_token_ids:
        plan = scheduler.schedule()
        model.forward(plan)
        scheduler.step_done(plan)
        if any(item.samples for item in plan.items):
            leader.output_token_ids.append(firsts[0])
    forks = forks_of(leader, firsts[1:])
    scheduler.fork(leader, forks)
    return [leader, *forks]


def decode(scheduler: Scheduler, model: FakeModel, requests: list[Request]) -> list[StepPlan]:
    plans = []
    while scheduler.has_work():
        plan = scheduler.schedule()
        check_plan(scheduler, plan)
        plans.append(plan)
        sampled = model.forward(plan)
        scheduler.step_done(plan)
        for item in plan.items:
            if item.samples:
                request = item.request
                request.output_token_ids.append(sampled[request.request_id])
                if request.num_output_tokens >= request.sampling.max_tokens:
                    scheduler.finish(request, FinishReason.LENGTH)
        held = [r.block_table for r in requests if r.block_table is not None]
        scheduler.pool.check_invariants(held)
    return plans


def test_forks_share_the_prompt_and_copy_only_its_last_block() -> None:
    scheduler, model = make_scheduler(), CopyingModel(T)
    leader = make_request(prompt_len=10, max_tokens=3)  # blocks: full, full, 2 of 4
    choices = prefill(scheduler, model, leader, [11, 12, 13, 14])
    shared = list(leader.block_table.block_ids)  # type: ignore[union-attr]
    assert all(c.block_table.block_ids == shared for c in choices)  # type: ignore[union-attr]
    assert all(c.state is RequestState.RUNNING and c.num_computed_tokens == 10 for c in choices)
    assert scheduler.pool.statistics().used_blocks == 3

    plan = scheduler.schedule()
    assert [item.request for item in plan.items] == choices
    # Three copies of the shared third block; the last to write keeps it.
    assert [c.src for c in plan.copies] == [shared[2]] * 3
    assert len({c.dst for c in plan.copies}) == 3
    tables = [c.block_table.block_ids for c in choices]  # type: ignore[union-attr]
    assert all(t[:2] == shared[:2] for t in tables)
    assert len({t[2] for t in tables}) == 4
    model.forward(plan)
    scheduler.step_done(plan)


def test_a_fork_at_a_block_boundary_copies_nothing() -> None:
    scheduler, model = make_scheduler(), CopyingModel(T)
    choices = prefill(scheduler, model, make_request(prompt_len=8, max_tokens=3), [5, 6, 7])
    plan = scheduler.schedule()
    assert plan.copies == ()
    assert len({c.block_table.block_ids[2] for c in choices}) == 3  # type: ignore[union-attr]


def test_forks_decode_what_a_longer_prompt_would() -> None:
    """Fork i, with first token f_i, decodes as a request whose prompt ends with f_i."""
    scheduler, model = make_scheduler(), CopyingModel(T)
    leader = make_request(prompt_len=10, max_tokens=6)
    firsts = [20, 21, 22]
    choices = prefill(scheduler, model, leader, firsts)
    decode(scheduler, model, choices)
    for choice, first in zip(choices, firsts, strict=True):
        alone_scheduler, alone_model = make_scheduler(), CopyingModel(T)
        alone = make_request(prompt=[*leader.prompt_token_ids, first], max_tokens=5)
        alone_scheduler.add(alone)
        decode(alone_scheduler, alone_model, [alone])
        assert choice.output_token_ids == [first, *alone.output_token_ids]
    assert scheduler.pool.statistics().used_blocks == 0


@settings(max_examples=60, deadline=None)
@given(
    prompt_len=st.integers(1, 13),
    num_forks=st.integers(1, 4),
    num_blocks=st.integers(6, 14),
    max_tokens=st.integers(2, 9),
    reuse=st.booleans(),
)
def test_forks_under_preemption_read_their_own_kv(
    prompt_len: int, num_forks: int, num_blocks: int, max_tokens: int, reuse: bool
) -> None:
    """A pool too small for every choice at once: forks are preempted, recompute and resume;
    every sampled token still reads back its own sequence, and the blocks all come back."""
    scheduler = make_scheduler(num_blocks, max_num_tokens=8, reuse=reuse)
    model = CopyingModel(T)
    leader = make_request(prompt_len=prompt_len, max_tokens=max_tokens)
    choices = prefill(scheduler, model, leader, [30 + i for i in range(num_forks + 1)])
    decode(scheduler, model, choices)
    assert all(len(c.output_token_ids) == max_tokens or c.finish_reason for c in choices)
    stats = scheduler.pool.statistics()
    assert stats.used_blocks == 0
    assert stats.free_blocks + stats.reusable_blocks == num_blocks


def test_fork_checks_its_requests() -> None:
    scheduler, model = make_scheduler(), CopyingModel(T)
    leader = make_request(prompt_len=6)
    waiting = make_request(prompt_len=6)
    scheduler.add(waiting)
    with pytest.raises(InvalidTransition):
        scheduler.fork(waiting, [])
    prefill(scheduler, model, leader, [1])
    used = scheduler.pool.statistics().used_blocks
    other_prompt = forks_of(make_request(prompt_len=5), [2])
    with pytest.raises(ValueError):
        scheduler.fork(leader, other_prompt)
    no_first = forks_of(leader, [3])
    no_first[0].output_token_ids.clear()
    with pytest.raises(ValueError):
        scheduler.fork(leader, no_first)
    assert scheduler.pool.statistics().used_blocks == used  # nothing changed
    assert no_first[0].state is RequestState.WAITING and no_first[0].block_table is None


def test_copies_are_listed_only_for_scheduled_requests() -> None:
    """A fork preempted while it waits for a block never has a copy in the plan: its new block
    may be handed to another request in the same step."""
    scheduler, model = make_scheduler(4, max_num_tokens=8), CopyingModel(T)
    leader = make_request(prompt_len=10, max_tokens=4)  # 3 blocks of the 4
    choices = prefill(scheduler, model, leader, [1, 2, 3])
    plan = scheduler.schedule()
    scheduled = {item.request.request_id for item in plan.items}
    dsts = {copy.dst for copy in plan.copies}
    for request in choices:
        table = request.block_table
        if request.request_id not in scheduled:
            assert table is None or not dsts & set(table.block_ids)
    assert all(isinstance(copy, BlockCopy) for copy in plan.copies)
    model.forward(plan)
    scheduler.step_done(plan)
