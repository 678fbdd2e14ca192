from __future__ import annotations

import itertools

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtdisagg.errors import CapacityError, InvalidTransition
from trtdisagg.kv.block_pool import BlockPool
from trtdisagg.worker.request import (
    FinishReason,
    Request,
    RequestState,
    RequestType,
    SamplingParams,
)
from trtdisagg.worker.scheduler import Scheduler, StepPlan

T = 4
S = RequestState


def make_scheduler(
    num_blocks: int = 64,
    *,
    max_batch_size: int = 8,
    max_num_tokens: int = 64,
    max_seq_len: int = 1024,
    reuse: bool = True,
    max_logit_rows: int | None = None,
    prefill_chunk_tokens: int | None = None,
) -> Scheduler:
    pool = BlockPool(num_blocks=num_blocks, tokens_per_block=T, enable_block_reuse=reuse)
    return Scheduler(
        pool=pool,
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        max_seq_len=max_seq_len,
        max_logit_rows=max_logit_rows,
        prefill_chunk_tokens=prefill_chunk_tokens,
    )


_ids = itertools.count(1000)


def make_request(
    prompt_len: int = 10,
    max_tokens: int = 4,
    *,
    request_type: RequestType = RequestType.CONTEXT_AND_GENERATION,
    prompt: list[int] | None = None,
    request_id: int | None = None,
) -> Request:
    return Request(
        request_id=next(_ids) if request_id is None else request_id,
        prompt_token_ids=list(prompt) if prompt is not None else list(range(1, prompt_len + 1)),
        sampling=SamplingParams(max_tokens=max_tokens),
        request_type=request_type,
        arrival_time=0.0,
    )


@attrs.define(eq=False)
class FakeModel:
    """Writes each computed token into its KV slot and samples from what it reads back.

    A sampled token depends on every token of the sequence as found in the KV cache, so a wrong
    block (reused, evicted or preempted wrongly) changes the outputs or trips the read check.
    """

    tokens_per_block: int
    kv: dict[tuple[int, int], int] = attrs.field(factory=dict)  # (block, offset) -> token

    def forward(self, plan: StepPlan) -> dict[int, int]:
        sampled = {}
        t = self.tokens_per_block
        for item in plan.items:
            request = item.request
            table = request.block_table
            assert table is not None
            assert request.state is S.RUNNING
            start, end = (
                request.num_computed_tokens,
                request.num_computed_tokens + item.num_new_tokens,
            )
            assert end <= request.num_tokens
            assert len(table.block_ids) * t >= end, "blocks do not cover the chunk"
            assert item.samples == (end == request.num_tokens)
            tokens = request.all_token_ids
            for pos in range(start, end):
                self.kv[(table.block_ids[pos // t], pos % t)] = tokens[pos]
            if item.samples:
                seen = [self.kv[(table.block_ids[p // t], p % t)] for p in range(end)]
                assert seen == tokens, f"request {request.request_id} reads wrong KV"
                sampled[request.request_id] = sum((i + 1) * x for i, x in enumerate(seen)) % 97
        return sampled


def run_to_completion(
    scheduler: Scheduler,
    requests: list[Request],
    *,
    max_steps: int = 10_000,
    model: FakeModel | None = None,
    pinned: tuple[Request, ...] = (),
    check: bool = True,
) -> list[StepPlan]:
    """The executor loop: schedule, forward, step_done, append sampled tokens, finish."""
    model = model or FakeModel(scheduler.pool.tokens_per_block)
    for request in requests:
        scheduler.add(request)
    plans = []
    for _ in range(max_steps):
        if not scheduler.has_work():
            break
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
        if check:
            held = [*requests, *pinned]
            scheduler.pool.check_invariants([r.block_table for r in held if r.block_table])
    else:
        raise AssertionError("requests did not finish")
    return plans


def check_plan(scheduler: Scheduler, plan: StepPlan) -> None:
    ids = [item.request.request_id for item in plan.items]
    assert len(ids) == len(set(ids))
    assert plan.num_tokens == sum(item.num_new_tokens for item in plan.items)
    assert plan.num_tokens <= scheduler._budget.max_num_tokens
    assert len(plan.items) <= scheduler._max_batch_size
    assert all(item.num_new_tokens >= 1 for item in plan.items)
    for item in plan.items:
        assert item.request.state is S.RUNNING
        assert item.request.request_type is not RequestType.GENERATION_ONLY or (
            item.request.num_output_tokens >= 1
        )
    # Decodes first, then prefill chunks.
    kinds = [item.num_new_tokens == 1 and item.samples for item in plan.items]
    first_prefill = kinds.index(False) if False in kinds else len(kinds)
    decodes = [i.request for i in plan.items[:first_prefill] if i.request.num_computed_tokens > 0]
    assert len(decodes) <= first_prefill


def outputs(requests: list[Request]) -> dict[int, list[int]]:
    return {r.request_id: list(r.output_token_ids) for r in requests}


# ---- intake ----


def test_add_refuses_what_can_never_fit() -> None:
    scheduler = make_scheduler(num_blocks=4, max_seq_len=100)
    with pytest.raises(CapacityError, match="KV cache holds 16") as info:
        scheduler.add(make_request(prompt_len=16, request_id=5))
    assert info.value.request_id == 5
    with pytest.raises(CapacityError, match="maximum sequence length"):
        make_scheduler(max_seq_len=10).add(make_request(prompt_len=10))
    scheduler.add(make_request(prompt_len=15))
    assert scheduler.statistics().num_waiting == 1


def test_add_rejects_duplicates_and_used_requests() -> None:
    scheduler = make_scheduler()
    request = make_request()
    scheduler.add(request)
    with pytest.raises(ValueError, match="already"):
        scheduler.add(request)
    running = make_request(prompt_len=3)
    running.state = S.RUNNING
    with pytest.raises(ValueError, match="not a new WAITING"):
        scheduler.add(running)


def test_constructor_validates() -> None:
    pool = BlockPool(num_blocks=4, tokens_per_block=T, enable_block_reuse=True)
    with pytest.raises(ValueError, match="max_num_tokens"):
        Scheduler(pool=pool, max_batch_size=1, max_num_tokens=0, max_seq_len=8)
    with pytest.raises(ValueError, match="max_logit_rows"):
        Scheduler(pool=pool, max_batch_size=1, max_num_tokens=8, max_seq_len=8, max_logit_rows=0)


# ---- policy ----


def test_chunked_prefill_splits_a_long_prompt() -> None:
    scheduler = make_scheduler(max_num_tokens=32)
    request = make_request(prompt_len=100, max_tokens=2)
    plans = run_to_completion(scheduler, [request])
    chunks = [(p.items[0].num_new_tokens, p.items[0].samples) for p in plans]
    assert chunks == [(32, False), (32, False), (32, False), (4, True), (1, True)]
    assert request.finish_reason is FinishReason.LENGTH
    assert request.num_output_tokens == 2


def test_prompt_logprobs_prefill_shares_the_logit_rows_budget_and_others_fill_the_step() -> None:
    """Each prompt position of a request with prompt logprobs is a full-vocabulary logits row:
    such requests' chunks share `max_logit_rows` a step, and the rest of the token budget goes
    to requests without them (first come, first served: one waiting behind a request whose
    rows are spent waits too)."""
    scheduler = make_scheduler(max_num_tokens=32, max_logit_rows=10)
    logprobs = SamplingParams(max_tokens=1, prompt_logprobs=0)
    wants = [attrs.evolve(make_request(prompt_len=25), sampling=logprobs) for _ in range(2)]
    plain = make_request(prompt_len=40, max_tokens=1)
    plans = run_to_completion(scheduler, [wants[0], plain, wants[1]])
    assert [(i.request, i.num_new_tokens) for i in plans[0].items] == [(wants[0], 10), (plain, 22)]
    assert max(sum(i.num_new_tokens for i in p.items if i.request in wants) for p in plans) == 10
    assert [r.num_output_tokens for r in (*wants, plain)] == [1, 1, 1]


def test_decodes_are_batched_with_a_prefill_chunk() -> None:
    scheduler = make_scheduler(max_num_tokens=16)
    first = make_request(prompt_len=5, max_tokens=10)
    scheduler.add(first)
    plan = scheduler.schedule()
    scheduler.step_done(plan)
    first.output_token_ids.append(1)
    second = make_request(prompt_len=40)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert [(i.request, i.num_new_tokens, i.samples) for i in plan.items] == [
        (first, 1, True),
        (second, 15, False),
    ]
    assert plan.num_tokens == 16
    scheduler.step_done(plan)
    first.output_token_ids.append(2)
    plan = scheduler.schedule()
    assert [(i.request, i.num_new_tokens) for i in plan.items] == [(first, 1), (second, 15)]


def test_batch_size_limits_sequences_per_step() -> None:
    scheduler = make_scheduler(max_batch_size=2)
    requests = [make_request(prompt_len=3, max_tokens=3) for _ in range(5)]
    plans = run_to_completion(scheduler, requests)
    assert max(len(p.items) for p in plans) == 2
    assert all(r.num_output_tokens == 3 for r in requests)


def test_waiting_head_is_not_jumped() -> None:
    scheduler = make_scheduler(num_blocks=8, max_num_tokens=64)
    holder = make_request(prompt_len=20, max_tokens=50)  # 5 blocks
    scheduler.add(holder)
    scheduler.step_done(scheduler.schedule())
    holder.output_token_ids.append(1)
    big = make_request(prompt=list(range(50, 66)))  # needs 4 blocks; 3 are left
    small = make_request(prompt=[60, 61])
    scheduler.add(big)
    scheduler.add(small)
    plan = scheduler.schedule()
    assert [i.request for i in plan.items] == [holder]
    assert scheduler.statistics().num_waiting == 2


def test_prefix_cache_is_reused_by_later_requests() -> None:
    scheduler = make_scheduler()
    prompt = list(range(1, 15))  # 3 full blocks and 2 tokens
    first = make_request(prompt=prompt, max_tokens=2)
    run_to_completion(scheduler, [first])
    second = make_request(prompt=[*prompt[:13], 99], max_tokens=2)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert second.num_cached_tokens == 3 * T
    assert [(i.request, i.num_new_tokens, i.samples) for i in plan.items] == [(second, 2, True)]
    assert scheduler.pool.statistics().used_blocks == 4


def test_reuse_disabled() -> None:
    scheduler = make_scheduler(reuse=False)
    prompt = list(range(1, 15))
    run_to_completion(scheduler, [make_request(prompt=prompt, max_tokens=2)])
    second = make_request(prompt=prompt)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert second.num_cached_tokens == 0
    assert plan.items[0].num_new_tokens == 14


def test_preemption_under_a_tiny_pool_finishes_everything() -> None:
    requests = [make_request(prompt_len=5 + 3 * i, max_tokens=12) for i in range(8)]
    reference = [make_request(prompt=r.prompt_token_ids, max_tokens=12) for r in requests]
    run_to_completion(make_scheduler(num_blocks=256), reference)

    scheduler = make_scheduler(num_blocks=10, max_num_tokens=16)
    plans = run_to_completion(scheduler, requests)
    assert sum(len(p.preempted) for p in plans) > 0
    assert scheduler.statistics().num_preemptions == sum(r.num_preemptions for r in requests)
    assert all(r.finish_reason is FinishReason.LENGTH for r in requests)
    assert list(outputs(requests).values()) == list(outputs(reference).values())
    stats = scheduler.statistics()
    assert (stats.num_waiting, stats.num_running, stats.pool.used_blocks) == (0, 0, 0)


def test_preempted_request_returns_to_the_head_and_recomputes() -> None:
    scheduler = make_scheduler(num_blocks=4, max_num_tokens=32)
    old = make_request(prompt_len=8, max_tokens=20)
    new = make_request(prompt_len=8, max_tokens=20)
    scheduler.add(old)
    scheduler.add(new)
    later = make_request(prompt_len=2)
    model = FakeModel(T)
    plan = scheduler.schedule()
    assert [i.request for i in plan.items] == [old, new]
    sampled = model.forward(plan)
    scheduler.step_done(plan)
    scheduler.add(later)
    for r in (old, new):
        r.output_token_ids.append(sampled[r.request_id])
    # Both hold 2 blocks (the whole pool) and need a third to compute token 8.
    plan = scheduler.schedule()
    assert [i.request for i in plan.items] == [old]
    assert plan.preempted == (new,)
    assert new.state is S.WAITING
    assert (new.num_computed_tokens, new.block_table, new.num_preemptions) == (0, None, 1)
    assert new.output_token_ids  # kept: it recomputes prompt + outputs
    assert scheduler._waiting[0] is new  # ahead of `later`
    model.forward(plan)
    scheduler.step_done(plan)


def test_a_request_alone_that_cannot_grow_finishes_with_length() -> None:
    scheduler = make_scheduler(num_blocks=4)  # 16 tokens
    request = make_request(prompt_len=10, max_tokens=100)
    plans = run_to_completion(scheduler, [request])
    assert request.finish_reason is FinishReason.LENGTH
    assert request.num_tokens == 17  # KV for 16 tokens, and the 17th sampled from them
    assert plans[-1].finished == (request,)
    assert plans[-1].is_empty
    assert scheduler.pool.statistics().used_blocks == 0


def test_max_seq_len_finishes_with_length() -> None:
    scheduler = make_scheduler(max_seq_len=12)
    request = make_request(prompt_len=10, max_tokens=100)
    plans = run_to_completion(scheduler, [request])
    assert request.num_tokens == 12
    assert request.finish_reason is FinishReason.LENGTH
    assert plans[-1].finished == (request,)


def test_schedule_requires_step_done() -> None:
    scheduler = make_scheduler()
    scheduler.add(make_request())
    scheduler.schedule()
    with pytest.raises(AssertionError, match="step_done"):
        scheduler.schedule()


def test_missing_sampled_token_is_caught() -> None:
    scheduler = make_scheduler()
    scheduler.add(make_request())
    scheduler.step_done(scheduler.schedule())
    with pytest.raises(AssertionError, match="not appended"):
        scheduler.schedule()


def test_step_done_skips_requests_aborted_during_the_step() -> None:
    scheduler = make_scheduler()
    request = make_request()
    scheduler.add(request)
    plan = scheduler.schedule()
    assert scheduler.abort(request.request_id) is request
    scheduler.step_done(plan)
    assert request.num_computed_tokens == 0
    assert scheduler.pool.statistics().used_blocks == 0
    assert not scheduler.has_work()


# ---- disaggregated legs ----


def test_context_only_holds_blocks_until_released() -> None:
    scheduler = make_scheduler()
    request = make_request(prompt_len=9, max_tokens=5, request_type=RequestType.CONTEXT_ONLY)
    scheduler.add(request)
    plan = scheduler.schedule()
    assert plan.items[0].samples
    scheduler.step_done(plan)
    request.output_token_ids.append(42)
    scheduler.hold_for_transfer(request)
    assert request.state is S.CTX_SENDING
    stats = scheduler.statistics()
    assert (stats.num_running, stats.num_ctx_sending, stats.pool.used_blocks) == (0, 1, 3)
    assert not scheduler.has_work()
    assert scheduler.schedule().is_empty
    scheduler.release(request)
    assert request.state is S.FINISHED
    assert request.finish_reason is FinishReason.LENGTH
    assert scheduler.pool.statistics().used_blocks == 0
    scheduler.release(request)  # a no-op once finished


def test_hold_for_transfer_requires_a_finished_prefill() -> None:
    scheduler = make_scheduler(max_num_tokens=4)
    request = make_request(prompt_len=9, request_type=RequestType.CONTEXT_ONLY)
    scheduler.add(request)
    scheduler.step_done(scheduler.schedule())
    with pytest.raises(AssertionError, match="4 of 9 prompt tokens computed"):
        scheduler.hold_for_transfer(request)
    assert request.state is S.RUNNING


def test_generation_only_waits_for_kv_then_decodes() -> None:
    scheduler = make_scheduler()
    request = make_request(prompt_len=9, max_tokens=3, request_type=RequestType.GENERATION_ONLY)
    assert scheduler.add_generation_only(request)
    assert request.state is S.GEN_WAITING_KV
    table = request.block_table
    assert table is not None
    assert table.block_ids == [0, 1, 2]  # consecutive: one transfer descriptor
    assert not scheduler.has_work()
    assert scheduler.schedule().is_empty
    scheduler.kv_received(request, 77)
    assert request.state is S.RUNNING
    assert (request.num_computed_tokens, request.output_token_ids) == (9, [77])
    assert scheduler.pool.drain_events()  # the received prompt blocks joined the prefix cache
    plan = scheduler.schedule()
    assert [(i.request, i.num_new_tokens, i.samples) for i in plan.items] == [(request, 1, True)]


def test_generation_only_without_room_changes_nothing() -> None:
    scheduler = make_scheduler(num_blocks=4, max_batch_size=2)
    first = make_request(prompt_len=12, request_type=RequestType.GENERATION_ONLY)
    second = make_request(prompt_len=8, request_type=RequestType.GENERATION_ONLY)
    assert scheduler.add_generation_only(first)
    assert not scheduler.add_generation_only(second)  # 1 block left, 2 needed
    assert second.state is S.WAITING
    assert scheduler.get(second.request_id) is None
    assert scheduler.pool.statistics().used_blocks == 3
    with pytest.raises(CapacityError):
        scheduler.add_generation_only(
            make_request(prompt_len=16, request_type=RequestType.GENERATION_ONLY)
        )
    with pytest.raises(ValueError, match="not generation_only"):
        scheduler.add_generation_only(make_request())


def test_generation_only_respects_batch_slots_and_waiting_requests() -> None:
    scheduler = make_scheduler(max_batch_size=1)
    gen = make_request(request_type=RequestType.GENERATION_ONLY)
    assert scheduler.add_generation_only(gen)
    # The slot is reserved for gen's decode: nothing else is admitted meanwhile.
    waiting = make_request()
    scheduler.add(waiting)
    assert scheduler.schedule().is_empty
    other = make_request(request_type=RequestType.GENERATION_ONLY)
    assert not scheduler.add_generation_only(other)
    scheduler.abort(gen.request_id)
    # Free slot, but a WAITING request came first.
    assert not scheduler.add_generation_only(other)


def test_pinned_requests_are_never_scheduled_nor_preempted() -> None:
    scheduler = make_scheduler(num_blocks=16, max_num_tokens=16)
    ctx = make_request(prompt_len=9, request_type=RequestType.CONTEXT_ONLY)
    scheduler.add(ctx)
    scheduler.step_done(scheduler.schedule())
    ctx.output_token_ids.append(5)
    scheduler.hold_for_transfer(ctx)
    gen = make_request(prompt_len=12, request_type=RequestType.GENERATION_ONLY)
    assert scheduler.add_generation_only(gen)
    pinned = {id(ctx): list(ctx.block_table.block_ids), id(gen): list(gen.block_table.block_ids)}  # type: ignore[union-attr]
    # Six blocks left for six requests that want to grow: plenty of preemption.
    others = [make_request(prompt_len=3, max_tokens=10) for _ in range(6)]
    plans = run_to_completion(scheduler, others, pinned=(ctx, gen))
    assert sum(len(p.preempted) for p in plans) > 0
    for plan in plans:
        assert all(i.request not in (ctx, gen) for i in plan.items)
        assert ctx not in plan.preempted
        assert gen not in plan.preempted
    assert (ctx.state, gen.state) == (S.CTX_SENDING, S.GEN_WAITING_KV)
    assert ctx.block_table is not None
    assert gen.block_table is not None
    assert {id(ctx): ctx.block_table.block_ids, id(gen): gen.block_table.block_ids} == pinned
    assert scheduler.pool.statistics().used_blocks == 6
    scheduler.release(ctx)
    scheduler.finish(gen, FinishReason.ERROR)
    assert scheduler.pool.statistics().used_blocks == 0


def test_running_request_yields_when_pinned_blocks_fill_the_pool() -> None:
    scheduler = make_scheduler(num_blocks=4)
    gen = make_request(prompt_len=12, request_type=RequestType.GENERATION_ONLY)
    running = make_request(prompt_len=3, max_tokens=10)
    scheduler.add(running)
    scheduler.step_done(scheduler.schedule())
    running.output_token_ids.append(1)
    assert scheduler.add_generation_only(gen)
    running.output_token_ids += [2] * 1  # 5 tokens: the next decode needs a second block
    scheduler.step_done(scheduler.schedule())  # computes token 4, fills the first block
    running.output_token_ids.append(3)
    plan = scheduler.schedule()  # needs a block held by gen, which will give it back
    assert plan.is_empty
    assert plan.preempted == (running,)
    assert not plan.finished
    scheduler.finish(gen, FinishReason.ABORT)
    plan = scheduler.schedule()
    assert [i.request for i in plan.items] == [running]
    # Its full block (3 prompt tokens and an output) was cached, so the recompute reuses it;
    # usage counts only the prompt tokens among them.
    assert (running.num_computed_tokens, running.num_cached_tokens) == (4, 3)


# ---- endings ----


def _in_state(state: S) -> tuple[Scheduler, Request]:
    scheduler = make_scheduler()
    request_type = {
        S.GEN_WAITING_KV: RequestType.GENERATION_ONLY,
        S.CTX_SENDING: RequestType.CONTEXT_ONLY,
    }.get(state, RequestType.CONTEXT_AND_GENERATION)
    request = make_request(prompt_len=30, request_type=request_type)
    if state is S.GEN_WAITING_KV:
        assert scheduler.add_generation_only(request)
        return scheduler, request
    scheduler.add(request)
    if state is S.WAITING:
        return scheduler, request
    plan = scheduler.schedule()
    scheduler.step_done(plan)
    request.output_token_ids.append(3)
    if state is S.CTX_SENDING:
        scheduler.hold_for_transfer(request)
    assert request.state is state
    return scheduler, request


@pytest.mark.parametrize("state", [S.WAITING, S.RUNNING, S.GEN_WAITING_KV])
def test_abort_releases_blocks_in_every_state(state: S) -> None:
    scheduler, request = _in_state(state)
    assert scheduler.abort(request.request_id) is request
    assert request.state is S.FINISHED
    assert request.finish_reason is FinishReason.ABORT
    assert request.block_table is None
    stats = scheduler.statistics()
    assert stats.pool.used_blocks == 0
    assert (stats.num_waiting, stats.num_running, stats.num_gen_waiting_kv) == (0, 0, 0)
    assert scheduler.get(request.request_id) is None
    assert scheduler.abort(request.request_id) is None
    assert scheduler.schedule().is_empty


def test_abort_during_prefill_releases_blocks() -> None:
    scheduler = make_scheduler(max_num_tokens=8)
    request = make_request(prompt_len=30)
    scheduler.add(request)
    scheduler.step_done(scheduler.schedule())
    assert request.state is S.RUNNING
    assert request.is_prefilling
    scheduler.abort(request.request_id)
    assert scheduler.pool.statistics().used_blocks == 0


def test_abort_leaves_ctx_sending_to_the_caller() -> None:
    scheduler, request = _in_state(S.CTX_SENDING)
    used = scheduler.pool.statistics().used_blocks
    assert scheduler.abort(request.request_id) is request
    assert request.state is S.CTX_SENDING
    assert scheduler.pool.statistics().used_blocks == used > 0
    scheduler.release(request, FinishReason.ABORT)
    assert request.finish_reason is FinishReason.ABORT
    assert scheduler.pool.statistics().used_blocks == 0


def test_abort_unknown_is_none() -> None:
    assert make_scheduler().abort(12345) is None


def test_finish_is_a_no_op_when_finished() -> None:
    scheduler, request = _in_state(S.RUNNING)
    scheduler.finish(request, FinishReason.STOP)
    scheduler.finish(request, FinishReason.ERROR)
    assert request.finish_reason is FinishReason.STOP


def test_finish_of_a_foreign_request_is_refused() -> None:
    with pytest.raises(ValueError, match="not in this scheduler"):
        make_scheduler().finish(make_request(), FinishReason.STOP)


@pytest.mark.parametrize(
    ("state", "call"),
    [
        (S.WAITING, "hold_for_transfer"),
        (S.RUNNING, "hold_for_transfer"),  # not context_only
        (S.RUNNING, "release"),
        (S.WAITING, "kv_received"),
        (S.GEN_WAITING_KV, "release"),
    ],
)
def test_invalid_transitions_raise(state: S, call: str) -> None:
    scheduler, request = _in_state(state)
    args = (request, 1) if call == "kv_received" else (request,)
    with pytest.raises(InvalidTransition, match=f"request {request.request_id}"):
        getattr(scheduler, call)(*args)
    assert request.state is state


# ---- properties ----

request_specs = st.lists(
    st.tuples(
        st.integers(1, 30),  # prompt length
        st.integers(1, 12),  # max tokens
        st.integers(0, 2),  # which shared prefix
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=60, deadline=None)
@given(
    specs=request_specs,
    num_blocks=st.integers(9, 24),
    max_num_tokens=st.integers(1, 40),
    max_batch_size=st.integers(1, 6),
    reuse=st.booleans(),
    abort_at=st.lists(st.integers(0, 40), max_size=3),
)
def test_any_workload_finishes_with_reference_outputs(
    specs: list[tuple[int, int, int]],
    num_blocks: int,
    max_num_tokens: int,
    max_batch_size: int,
    reuse: bool,
    abort_at: list[int],
) -> None:
    prefixes = ([7] * 30, list(range(30)), [1, 2] * 15)

    def build() -> list[Request]:
        return [
            make_request(prompt=prefixes[p][:n], max_tokens=m, request_id=i)
            for i, (n, m, p) in enumerate(specs)
        ]

    reference = build()
    run_to_completion(make_scheduler(num_blocks=128, max_num_tokens=64), reference, check=False)

    requests = build()
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        max_num_tokens=max_num_tokens,
        max_batch_size=max_batch_size,
        reuse=reuse,
    )
    aborted = set()
    original_schedule = scheduler.schedule
    steps = itertools.count()

    def schedule_with_aborts() -> StepPlan:
        step = next(steps)
        for k, at in enumerate(abort_at):
            if at == step and k < len(requests) and scheduler.abort(requests[k].request_id):
                aborted.add(k)
        return original_schedule()

    scheduler.schedule = schedule_with_aborts  # type: ignore[method-assign]
    run_to_completion(scheduler, requests)
    for k, (request, expected) in enumerate(zip(requests, reference, strict=True)):
        assert request.state is S.FINISHED
        if k in aborted:
            assert request.finish_reason is FinishReason.ABORT
            assert expected.output_token_ids[: request.num_output_tokens] == (
                request.output_token_ids
            )
        elif request.num_tokens == num_blocks * T + 1 < expected.num_tokens:
            # Longer than the whole pool: cut short, and said so.
            assert request.finish_reason is FinishReason.LENGTH
            assert expected.output_token_ids[: request.num_output_tokens] == (
                request.output_token_ids
            )
        else:
            assert request.output_token_ids == expected.output_token_ids
    stats = scheduler.statistics()
    assert stats.pool.used_blocks == 0
    assert stats.pool.free_blocks + stats.pool.reusable_blocks == num_blocks


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(RequestType), min_size=1, max_size=10),
    prompt_lens=st.lists(st.integers(1, 20), min_size=10, max_size=10),
    delays=st.lists(st.integers(0, 4), min_size=10, max_size=10),
    num_blocks=st.integers(6, 20),
    max_num_tokens=st.integers(1, 24),
    max_batch_size=st.integers(1, 4),
)
def test_mixed_disaggregated_workload_never_deadlocks(
    kinds: list[RequestType],
    prompt_lens: list[int],
    delays: list[int],
    num_blocks: int,
    max_num_tokens: int,
    max_batch_size: int,
) -> None:
    """Aggregated, context_only and generation_only requests on one worker, with slow transfers.

    The executor's side is simulated: generation_only requests wait in a FIFO until the pool
    takes them, their KV "arrives" some steps later (written into their blocks), and context_only
    requests are released some steps after their first token.
    """
    scheduler = make_scheduler(
        num_blocks=num_blocks, max_num_tokens=max_num_tokens, max_batch_size=max_batch_size
    )
    model = FakeModel(T)
    requests = [
        make_request(prompt=list(range(3, 3 + prompt_lens[i])), max_tokens=5, request_type=kind)
        for i, kind in enumerate(kinds)
    ]
    pending_gen = [r for r in requests if r.request_type is RequestType.GENERATION_ONLY]
    for request in requests:
        if request.request_type is not RequestType.GENERATION_ONLY:
            scheduler.add(request)
    due: dict[int, int] = {}  # request id -> step at which its transfer completes
    delay = {r.request_id: delays[i] for i, r in enumerate(requests)}
    for step in range(5_000):
        if all(r.is_finished for r in requests):
            break
        while pending_gen and scheduler.add_generation_only(pending_gen[0]):
            request = pending_gen.pop(0)
            due[request.request_id] = step + delay[request.request_id]
        for request in requests:
            if due.get(request.request_id, step + 1) > step:
                continue
            del due[request.request_id]
            if request.state is S.GEN_WAITING_KV:
                table = request.block_table
                assert table is not None
                for pos, token in enumerate(request.prompt_token_ids):  # the peer's write
                    model.kv[(table.block_ids[pos // T], pos % T)] = token
                scheduler.kv_received(request, 1)
            else:
                assert request.state is S.CTX_SENDING
                scheduler.release(request)
        plan = scheduler.schedule()
        check_plan(scheduler, plan)
        for item in plan.items:
            assert item.request.state is S.RUNNING
        sampled = model.forward(plan)
        scheduler.step_done(plan)
        for item in plan.items:
            if not item.samples:
                continue
            request = item.request
            request.output_token_ids.append(sampled[request.request_id])
            if request.request_type is RequestType.CONTEXT_ONLY:
                scheduler.hold_for_transfer(request)
                due[request.request_id] = step + 1 + delay[request.request_id]
            elif request.num_output_tokens >= request.sampling.max_tokens:
                scheduler.finish(request, FinishReason.STOP)
        held = [r.block_table for r in requests if r.block_table is not None]
        scheduler.pool.check_invariants(held)
    else:
        raise AssertionError(f"deadlock: {scheduler.statistics()}")
    stats = scheduler.statistics()
    assert stats.pool.used_blocks == 0
    for request in requests:
        if request.request_type is RequestType.CONTEXT_ONLY:
            assert request.num_output_tokens == 1
            assert request.finish_reason is FinishReason.LENGTH  # release()'s default
        elif request.finish_reason is FinishReason.LENGTH:  # longer than the whole pool
            assert request.num_tokens == num_blocks * T + 1
        else:
            assert request.finish_reason is FinishReason.STOP
            assert request.num_output_tokens == 5


# ---- prefill chunks beside decodes ----


def _decoding(scheduler: Scheduler, count: int) -> list[Request]:
    """`count` requests past their one-token prompts, each holding its first output."""
    requests = [make_request(prompt_len=1, max_tokens=100) for _ in range(count)]
    for request in requests:
        scheduler.add(request)
    plan = scheduler.schedule()
    scheduler.step_done(plan)
    for request in requests:
        request.output_token_ids.append(7)
    return requests


def test_prefill_chunk_tokens_caps_a_step_per_waiting_prompt_only_while_requests_decode() -> None:
    scheduler = make_scheduler(num_blocks=256, max_num_tokens=64, prefill_chunk_tokens=16)
    alone = make_request(prompt_len=40)
    scheduler.add(alone)
    assert scheduler.schedule().num_tokens == 40  # nothing decodes: the whole budget

    scheduler = make_scheduler(num_blocks=256, max_num_tokens=64, prefill_chunk_tokens=16)
    decoding = _decoding(scheduler, 3)
    first = make_request(prompt_len=40)
    scheduler.add(first)
    plan = scheduler.schedule()  # one prompt waits: 16 tokens in all, 3 of them decode rows
    assert [(i.request, i.num_new_tokens) for i in plan.items] == [
        *((r, 1) for r in decoding),
        (first, 13),
    ]
    scheduler.step_done(plan)
    for request in decoding:
        request.output_token_ids.append(7)
    second, third = make_request(prompt_len=40), make_request(prompt_len=40)
    scheduler.add(second)
    scheduler.add(third)
    plan = scheduler.schedule()  # two prompts wait to be admitted: 32 tokens
    assert plan.num_tokens == 32
    assert [(i.request, i.num_new_tokens) for i in plan.items[3:]] == [(first, 27), (second, 2)]
    scheduler.step_done(plan)
    for request in (*decoding, first):
        request.output_token_ids.append(7)
    plan = scheduler.schedule()  # one waits, one is in prefill: 16 again
    assert [(i.request, i.num_new_tokens) for i in plan.items[4:]] == [(second, 12)]


def test_prefill_chunk_tokens_must_exceed_the_batch() -> None:
    with pytest.raises(ValueError, match="prefill_chunk_tokens must exceed max_batch_size"):
        make_scheduler(max_batch_size=8, prefill_chunk_tokens=8)


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 6)), min_size=1, max_size=8),
    chunk=st.integers(7, 40),
    max_num_tokens=st.integers(1, 40),
)
def test_any_workload_with_prefill_chunks_gives_the_reference_outputs(
    specs: list[tuple[int, int]], chunk: int, max_num_tokens: int
) -> None:
    def build() -> list[Request]:
        return [
            make_request(prompt=list(range(3, 3 + n)), max_tokens=m, request_id=i)
            for i, (n, m) in enumerate(specs)
        ]

    reference = build()
    run_to_completion(make_scheduler(num_blocks=128), reference, check=False)
    requests = build()
    scheduler = make_scheduler(
        num_blocks=128, max_batch_size=6, max_num_tokens=max_num_tokens, prefill_chunk_tokens=chunk
    )
    run_to_completion(scheduler, requests)
    assert outputs(requests) == outputs(reference)
