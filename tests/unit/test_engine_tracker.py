"""The transfer tracker: which requests wait on a transfer, and what each outcome does to them.

A real scheduler and block pool; the transfer port is a recorder whose answers the test sets
(`cancel`/`settled`: whether no write can land any more).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from tests.engine_parts import gen_live, make_live, make_scheduler, outcome
from trtdisagg.transfer.protocol.sessions import TransferOutcome
from trtdisagg.worker.engine.ending import Blocks, Ending
from trtdisagg.worker.engine.tracker import (
    EARLY_RELEASE_S,
    MAX_EARLY_RELEASES,
    TransferTracker,
)
from trtdisagg.worker.request import FinishReason, RequestState, RequestType
from trtdisagg.worker.scheduler import Scheduler

VOCAB = 1000


@attrs.define
class RecordingPort:
    """A TransferPort that records every call; `quiet` answers cancel and settled."""

    quiet: bool = True
    calls: list[tuple[Any, ...]] = attrs.Factory(list)

    def receive(
        self, key: int, endpoint: str, block_ids: Sequence[int], num_tokens: int, ctx: str | None
    ) -> None:
        self.calls.append(("receive", key, endpoint, tuple(block_ids), num_tokens))

    def send(
        self, key: int, block_ids: Sequence[int], num_tokens: int, first_tokens: Sequence[int]
    ) -> None:
        self.calls.append(("send", key, tuple(block_ids), num_tokens, tuple(first_tokens)))

    def abandon(self, key: int, reason: str) -> None:
        self.calls.append(("abandon", key, reason))

    def cancel(self, key: int) -> bool:
        self.calls.append(("cancel", key))
        return self.quiet

    def settled(self, key: int) -> bool:
        return self.quiet

    def outcomes(self) -> tuple[list[TransferOutcome], list[TransferOutcome]]:
        return [], []  # (the tests hand the tracker its outcomes themselves)

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [call for call in self.calls if call[0] == name]


def make(num_blocks: int = 16, *, quiet: bool = True) -> tuple[TransferTracker, RecordingPort]:
    port = RecordingPort(quiet=quiet)
    tracker = TransferTracker(scheduler=make_scheduler(num_blocks), port=port, vocab_size=VOCAB)
    return tracker, port


def held(scheduler: Scheduler) -> int:
    stats = scheduler.pool.statistics()
    return stats.total_blocks - stats.free_blocks - stats.reusable_blocks


def test_a_gen_request_asks_for_its_kv_once_it_has_blocks() -> None:
    tracker, port = make()
    live = gen_live(5, prompt_len=10)
    tracker.wait_for_blocks(live)
    assert tracker.key_in_use(5, sending=False) and not tracker.in_flight
    tracker.start_receives()
    table = live.request.block_table
    assert table is not None and live.request.state is RequestState.GEN_WAITING_KV
    assert port.calls == [("receive", 5, "tcp://ctx:1", tuple(table.block_ids), 10)]
    assert tracker.in_flight and tracker.key_in_use(5, sending=False)
    assert not tracker.key_in_use(5, sending=True)


def test_gen_requests_get_blocks_first_come_first_served() -> None:
    tracker, port = make(num_blocks=4)  # 16 tokens
    first, second, small = gen_live(1), gen_live(2), gen_live(3, prompt_len=3)
    for live in (first, second, small):
        tracker.wait_for_blocks(live)
    tracker.start_receives()  # `second` needs 3 blocks of the 1 left: `small` waits behind it
    assert [call[1] for call in port.named("receive")] == [1]
    assert small.request.state is RequestState.WAITING
    tracker.poll([outcome(1, ok=False)], [])  # frees `first`'s blocks
    tracker.start_receives()
    assert [call[1] for call in port.named("receive")] == [1, 2, 3]


def test_landed_kv_runs_the_request_with_ctx_first_token() -> None:
    tracker, _ = make()
    live = gen_live(5, first_token=42)
    tracker.wait_for_blocks(live)
    tracker.start_receives()
    polled = tracker.poll([outcome(5, num_bytes=640, seconds=0.25)], [])
    (arrived,) = polled.arrived
    assert (arrived.live, arrived.token_id) == (live, 42)
    assert live.request.state is RequestState.RUNNING
    assert live.request.output_token_ids == [42]
    assert (live.state.transfer_bytes, live.state.transfer_s) == (640, 0.25)
    assert polled.failed == () and polled.failures == 0 and not tracker.in_flight


def test_generation_first_takes_the_first_token_that_came_with_the_kv() -> None:
    tracker, _ = make()
    live = gen_live(5, first_token=None)
    tracker.wait_for_blocks(live)
    tracker.start_receives()
    (arrived,) = tracker.poll([outcome(5, first_tokens=(9,))], []).arrived
    assert arrived.token_id == 9 and live.request.output_token_ids == [9]


@pytest.mark.parametrize(
    ("first_tokens", "error"),
    [((), "ctx sent no first token"), ((VOCAB,), "is outside the vocabulary (1000)")],
)
def test_a_first_token_gen_cannot_use_fails_the_request(
    first_tokens: tuple[int, ...], error: str
) -> None:
    tracker, _ = make()
    live = gen_live(5, first_token=None)
    tracker.wait_for_blocks(live)
    tracker.start_receives()
    polled = tracker.poll([outcome(5, first_tokens=first_tokens)], [])
    ((failed, ending),) = polled.failed
    assert failed is live and polled.failures == 1
    assert ending.reason is FinishReason.ERROR and not ending.internal
    assert ending.blocks is Blocks.SETTLED and error in (ending.error or "")
    assert live.request.state is RequestState.FINISHED and held(tracker.scheduler) == 0


def test_a_failed_receive_frees_the_blocks_when_no_write_can_land() -> None:
    tracker, _ = make()
    live = gen_live(5)
    tracker.wait_for_blocks(live)
    tracker.start_receives()
    polled = tracker.poll([outcome(5, ok=False, error="ctx refused: busy")], [])
    assert polled.failed == ((live, Ending.transfer_failed("ctx refused: busy")),)
    assert polled.failures == 1 and held(tracker.scheduler) == 0 and not tracker.in_flight


def test_a_failed_receive_a_write_may_still_reach_is_quarantined_until_settled() -> None:
    tracker, port = make(quiet=False)
    live = gen_live(5)
    tracker.wait_for_blocks(live)
    tracker.start_receives()
    polled = tracker.poll([outcome(5, ok=False, blocks_held=True)], [])
    ((_, ending),) = polled.failed
    assert ending.error == "KV transfer failed"  # the request fails now...
    blocks = held(tracker.scheduler)
    assert blocks > 0 and tracker.in_flight and tracker.key_in_use(5, sending=False)
    tracker.poll([], [])
    assert held(tracker.scheduler) == blocks  # ...its blocks wait while a write may land
    port.quiet = True
    tracker.poll([], [])
    assert held(tracker.scheduler) == 0 and not tracker.in_flight


def test_the_quarantine_ends_with_the_transfers_outcome_too() -> None:
    tracker, _ = make(quiet=False)  # multi-rank: only the gated outcome says it is over
    live = gen_live(5)
    tracker.wait_for_blocks(live)
    tracker.start_receives()
    tracker.settle(live, Ending.aborted())
    assert held(tracker.scheduler) > 0 and tracker.in_flight
    polled = tracker.poll([outcome(5, ok=False, cancelled=True)], [])
    assert polled == type(polled)()  # nothing to tell its request: it ended already
    assert held(tracker.scheduler) == 0 and not tracker.in_flight


def test_an_aborted_receive_frees_at_once_when_its_cancel_says_so() -> None:
    tracker, port = make(quiet=True)
    live = gen_live(5)
    tracker.wait_for_blocks(live)
    tracker.start_receives()
    tracker.settle(live, Ending.aborted())
    assert port.named("cancel") == [("cancel", 5)]
    assert live.request.state is RequestState.FINISHED and held(tracker.scheduler) == 0
    assert tracker.poll([outcome(5, ok=False, cancelled=True)], []).failed == ()


def test_an_aborted_request_still_waiting_for_blocks_leaves_no_trace() -> None:
    tracker, port = make(num_blocks=4)
    first, second = gen_live(1), gen_live(2)
    tracker.wait_for_blocks(first)
    tracker.wait_for_blocks(second)
    tracker.start_receives()  # `second` waits for blocks
    tracker.settle(second, Ending.aborted())
    assert not tracker.key_in_use(2, sending=False)
    tracker.poll([outcome(1, ok=False)], [])
    tracker.start_receives()
    assert [call[1] for call in port.named("receive")] == [1]  # never asked for


def test_a_context_only_request_hands_its_kv_over_and_the_send_frees_it() -> None:
    tracker, port = make()
    scheduler = tracker.scheduler
    live, _ = make_live(request_type=RequestType.CONTEXT_ONLY, transfer_key=8)
    request = live.request
    scheduler.add(request)
    plan = scheduler.schedule()
    table = request.block_table
    assert table is not None and port.calls == []
    scheduler.step_done(plan)
    request.output_token_ids.append(33)
    tracker.settle(live, Ending.handed_over())
    assert request.state is RequestState.CTX_SENDING and tracker.holds_send(8)
    assert port.named("send") == [("send", 8, tuple(table.block_ids), 10, (33,))]
    assert port.named("abandon") == [] and tracker.key_in_use(8, sending=True)
    assert held(scheduler) > 0
    tracker.poll([], [outcome(8)])
    assert request.state is RequestState.FINISHED and request.finish_reason is FinishReason.STOP
    assert held(scheduler) == 0 and not tracker.holds_send(8)


def test_a_failed_send_counts_and_frees() -> None:
    tracker, _ = make()
    live, _ = make_live(request_type=RequestType.CONTEXT_ONLY, transfer_key=8)
    tracker.scheduler.add(live.request)
    plan = tracker.scheduler.schedule()
    tracker.scheduler.step_done(plan)
    live.request.output_token_ids.append(33)
    tracker.settle(live, Ending.handed_over())
    assert tracker.poll([], [outcome(8, ok=False, error="gen is gone")]).failures == 1
    assert live.request.finish_reason is FinishReason.ABORT
    assert held(tracker.scheduler) == 0
    # A cancelled send (gen's CANCEL, the coordinator's release) is no failure.
    other, _ = make_live(request_type=RequestType.CONTEXT_ONLY, transfer_key=9)
    tracker.scheduler.add(other.request)
    plan = tracker.scheduler.schedule()
    tracker.scheduler.step_done(plan)
    other.request.output_token_ids.append(33)
    tracker.settle(other, Ending.handed_over())
    assert tracker.release_send(9) and not tracker.release_send(10)
    assert tracker.poll([], [outcome(9, ok=False, cancelled=True)]).failures == 0


def test_a_context_only_request_that_ends_unsent_tells_gen_why() -> None:
    tracker, port = make()
    live, _ = make_live(request_type=RequestType.CONTEXT_ONLY, transfer_key=8)
    tracker.scheduler.add(live.request)
    tracker.settle(live, Ending.aborted())
    assert port.calls == [("abandon", 8, "it was aborted")]
    assert live.request.state is RequestState.FINISHED and held(tracker.scheduler) == 0
    assert not tracker.release_send(8)  # nothing was ever sent under it


def test_a_request_ended_elsewhere_is_left_as_it_is() -> None:
    tracker, port = make()
    live, _ = make_live()
    tracker.scheduler.add(live.request)
    tracker.scheduler.schedule()
    tracker.settle(live, Ending.dropped(FinishReason.LENGTH))  # the scheduler's own doing
    assert port.calls == [] and live.request.state is RequestState.RUNNING


def test_landed_kv_starts_every_choice_from_one_set_of_blocks() -> None:
    tracker, port = make()
    live = gen_live(5, first_token=42, forks=(43, 44))  # n = 3, the prompt's KV received once
    tracker.wait_for_blocks(live)
    tracker.start_receives()
    assert len(port.named("receive")) == 1
    forks = list(live.forks)
    polled = tracker.poll([outcome(5)], [])
    assert [(t.live, t.token_id) for t in polled.arrived] == [
        (live, 42),
        (forks[0], 43),
        (forks[1], 44),
    ]
    choices = [t.live.request for t in polled.arrived]
    assert [r.output_token_ids for r in choices] == [[42], [43], [44]]
    assert all(r.state is RequestState.RUNNING for r in choices)
    tables = [r.block_table.block_ids for r in choices if r.block_table is not None]
    assert tables[0] == tables[1] == tables[2]  # shared until one writes
    assert live.forks == [] and all(t.live.leader is None for t in polled.arrived)
    assert held(tracker.scheduler) == len(tables[0])


def test_first_tokens_for_another_number_of_choices_fail_the_request() -> None:
    tracker, _ = make()
    live = gen_live(5, first_token=None, forks=(0, 0))  # generation_first: they come with the KV
    tracker.wait_for_blocks(live)
    tracker.start_receives()
    polled = tracker.poll([outcome(5, first_tokens=(7, 8))], [])
    ((failed, ending),) = polled.failed
    assert failed is live and "2 first tokens for a request of 3 choices" in (ending.error or "")
    assert held(tracker.scheduler) == 0


def test_ctx_sends_every_choice_s_first_token_with_the_kv() -> None:
    tracker, port = make()
    live, _ = make_live(request_type=RequestType.CONTEXT_ONLY, transfer_key=7)
    rider, _ = make_live(request_type=RequestType.CONTEXT_ONLY)
    rider.leader, rider.choice = live, 1
    live.forks = [rider]
    scheduler = tracker.scheduler
    scheduler.add(live.request)
    plan = scheduler.schedule()
    scheduler.step_done(plan)
    live.request.output_token_ids.append(11)
    rider.request.output_token_ids.append(12)
    tracker.settle(live, Ending.handed_over())
    (send,) = port.named("send")
    assert send[1] == 7 and send[4] == (11, 12)
    assert live.request.state is RequestState.CTX_SENDING


def test_a_release_that_comes_before_its_request_is_remembered_a_while() -> None:
    """The coordinator's release and ctx's request race over two connections: a release that
    finds no request of its key is kept, for EARLY_RELEASE_S, for the request still to come."""
    tracker, _ = make()
    tracker.remember_release(7, now=100.0)
    assert tracker.take_early_release(7, now=100.5)
    assert not tracker.take_early_release(7, now=100.6)  # once
    tracker.remember_release(8, now=100.0)
    assert not tracker.take_early_release(8, now=100.0 + EARLY_RELEASE_S)  # too old: forgotten
    assert not tracker.take_early_release(9, now=100.0)  # never released


def test_released_keys_are_bounded() -> None:
    tracker, _ = make()
    for key in range(MAX_EARLY_RELEASES + 10):
        tracker.remember_release(key, now=1.0)
    assert not tracker.take_early_release(0, now=1.0)  # the oldest made room
    assert tracker.take_early_release(MAX_EARLY_RELEASES + 9, now=1.0)
