"""The scheduler under asynchronous steps: step N+1 is scheduled while step N is in flight.

Pure: requests' pending tokens are set as the engine's loop sets them (one per sampling item of
a launched step) and resolved with `Request.sampled`.
"""

from __future__ import annotations

import pytest

from tests.unit.test_scheduler import make_request, make_scheduler
from trtdisagg.worker.request import FinishReason, Request, RequestState, RequestType
from trtdisagg.worker.scheduler import Scheduler, StepPlan

T = 4


def launch(scheduler: Scheduler) -> StepPlan:
    """Schedule and launch a step, counting its sampled tokens as pending (the loop's part)."""
    plan = scheduler.schedule()
    scheduler.step_launched(plan)
    for item in plan.items:
        if item.samples:
            item.request.pending_tokens += 1
    return plan


def ids(plan: StepPlan) -> list[int]:
    return [item.request.request_id for item in plan.items]


def used(scheduler: Scheduler) -> int:
    return scheduler.pool.statistics().used_blocks


def test_blocks_of_a_request_ended_in_flight_wait_for_its_last_step() -> None:
    scheduler = make_scheduler()
    a, b = make_request(10, 8), make_request(6, 8)
    scheduler.add(a)
    scheduler.add(b)
    first = launch(scheduler)  # both prefill
    second = launch(scheduler)  # both decode from their pending first tokens
    assert ids(second) == ids(first) == [a.request_id, b.request_id]
    held = used(scheduler)
    scheduler.step_finished(first)
    a.sampled(7)
    b.sampled(8)
    scheduler.finish(a, FinishReason.STOP)  # its first token was a stop token
    assert a.block_table is None and used(scheduler) == held  # `second` still writes its KV
    third = launch(scheduler)
    assert ids(third) == [b.request_id]
    scheduler.step_finished(second)
    assert used(scheduler) == held - 3  # a's ceil(11 / 4) blocks, once `second` ran
    scheduler.finish(b, FinishReason.ABORT)
    assert used(scheduler) == held - 3  # `third` still computes b
    scheduler.step_finished(third)
    assert used(scheduler) == 0


def test_a_token_known_to_end_its_request_is_not_computed_from() -> None:
    scheduler = make_scheduler()
    last = make_request(5, 2)  # its second token is its last
    ctx = make_request(7, 4, request_type=RequestType.CONTEXT_ONLY)
    going = make_request(9, 4)
    for request in (last, ctx, going):
        scheduler.add(request)
    first = launch(scheduler)
    assert ids(first) == [last.request_id, ctx.request_id, going.request_id]
    # ctx's first token ends its leg (its KV goes to gen untouched by later steps).
    assert ids(launch(scheduler)) == [last.request_id, going.request_id]
    scheduler.step_finished(first)
    for request, token in ((last, 1), (ctx, 2), (going, 3)):
        request.sampled(token)
    scheduler.hold_for_transfer(ctx)
    third = launch(scheduler)
    assert ids(third) == [going.request_id]  # `last` has its max_tokens in flight
    assert last.state is RequestState.RUNNING and last.pending_tokens == 1


def test_a_decode_computes_from_its_pending_token() -> None:
    scheduler = make_scheduler()
    request = make_request(6, 8)
    scheduler.add(request)
    launch(scheduler)
    plan = launch(scheduler)
    (item,) = plan.items
    # The pending token sits at position 6, past the known tokens: the step's input for it comes
    # from the device.
    assert request.num_known_tokens == 6 and request.num_tokens == 8
    assert request.num_computed_tokens == 7 and item.num_new_tokens == 1 and item.samples


def test_full_blocks_are_cached_once_their_tokens_are_known() -> None:
    scheduler = make_scheduler()
    request = make_request(7, 8)
    scheduler.add(request)
    first = launch(scheduler)  # positions 0..6; token 7 pending
    table = request.block_table
    assert table is not None and table.num_committed_blocks == 1
    second = launch(scheduler)  # computes position 7 from the pending token: block 1 is full
    assert table.num_committed_blocks == 1  # but token 7 is not known yet
    scheduler.step_finished(first)
    request.sampled(11)
    launch(scheduler)
    assert table.num_committed_blocks == 2
    scheduler.step_finished(second)


def test_a_preempted_request_is_admitted_again_once_its_token_is_known() -> None:
    scheduler = make_scheduler(num_blocks=4, max_batch_size=4)
    old, new = make_request(7, 20), make_request(7, 20)
    scheduler.add(old)
    scheduler.add(new)
    first = launch(scheduler)  # 2 blocks each: the pool is full
    second = launch(scheduler)  # position 7 fits; both decode from pending tokens
    assert ids(second) == [old.request_id, new.request_id]
    scheduler.step_finished(first)
    old.sampled(1)
    new.sampled(2)
    third = launch(scheduler)  # position 8 needs a third block each: `new` is preempted
    assert third.preempted == (new,) and new.state is RequestState.WAITING
    assert new.pending_tokens == 1  # `second` samples its token; it cannot recompute before
    scheduler.step_finished(second)
    old.sampled(3)
    fourth = launch(scheduler)
    assert ids(fourth) == [old.request_id]  # `new` waits for its token
    new.sampled(4)
    assert new.pending_tokens == 0 and new.num_tokens == 9
    scheduler.step_finished(third)
    old.sampled(5)
    scheduler.finish(old, FinishReason.ABORT)
    assert scheduler.schedule().items == ()  # old's blocks wait for `fourth`
    scheduler.step_finished(fourth)
    fifth = scheduler.schedule()
    assert ids(fifth) == [new.request_id]  # back, recomputing prompt and outputs
    (item,) = fifth.items
    assert item.request.num_computed_tokens + item.num_new_tokens == 9 and item.samples


@pytest.mark.parametrize("state", [RequestState.WAITING, RequestState.RUNNING])
def test_sampled_resolves_one_pending_token(state: RequestState) -> None:
    request: Request = make_request(3, 4)
    request.state = state
    request.pending_tokens = 1
    request.sampled(9)
    assert request.output_token_ids == [9] and request.pending_tokens == 0
    request.sampled(10)  # a synchronous caller's token: nothing was pending
    assert request.output_token_ids == [9, 10] and request.pending_tokens == 0
