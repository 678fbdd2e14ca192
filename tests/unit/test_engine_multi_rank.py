"""Rank 0's step driver of a multi-rank instance, against a stand-in group of two ranks.

The group records what rank 0 broadcasts and answers with the reports the test scripts for rank
1; rank 0's own transceiver is a recorder too. No processes, no collectives: the gating, the
cancels and the ticking policy are what is under test (the real thing: test_hetero_pairings.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from tests.engine_parts import outcome
from trtdisagg.transfer.protocol.sessions import TransferOutcome
from trtdisagg.worker.engine.multi_rank import RANK_POLL_S, MultiRankDriver
from trtdisagg.worker.engine.wakeup import Wakeup
from trtdisagg.worker.rank_group import HEARTBEAT_S
from trtdisagg.worker.rank_plan import RankOutcome, RankReport, Side, StepCommand


@attrs.define
class TwoRanks:
    """Rank 0's view of the group: what it broadcast, and rank 1's next reports."""

    world_size: int = 2
    commands: list[StepCommand] = attrs.Factory(list)
    follower: list[RankReport] = attrs.Factory(list)  # rank 1's reports, one per tick

    def broadcast_command(self, command: StepCommand) -> StepCommand:
        self.commands.append(command)
        return command

    def gather_reports(self, local: RankReport) -> list[RankReport]:
        return [local, self.follower.pop(0) if self.follower else RankReport(rank=1)]


@attrs.define
class RecordingTransceiver:
    calls: list[tuple[Any, ...]] = attrs.Factory(list)
    gen_done: list[TransferOutcome] = attrs.Factory(list)  # rank 0's, at the next tick
    ctx_done: list[TransferOutcome] = attrs.Factory(list)

    def respond_and_send_async(
        self,
        key: int,
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        first: Sequence[int] = (),
    ) -> None:
        self.calls.append(("send", key))

    def abandon_send(self, key: int, reason: str) -> None:
        self.calls.append(("abandon", key))

    def request_and_receive_async(
        self,
        key: int,
        endpoint: str,
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        *,
        ctx_instance: str | None = None,
    ) -> None:
        self.calls.append(("receive", key))

    def check_gen_transfer_status(self) -> list[TransferOutcome]:
        done, self.gen_done = self.gen_done, []
        return done

    def check_context_transfer_status(self) -> list[TransferOutcome]:
        done, self.ctx_done = self.ctx_done, []
        return done

    def cancel_request(self, key: int) -> bool:
        self.calls.append(("cancel", key))
        return True


class NoRunner:
    tokens_per_block = 4

    def kv_ready(self) -> None:
        pass


def make() -> tuple[MultiRankDriver, TwoRanks, RecordingTransceiver, list[Sequence[RankReport]]]:
    group, transceiver = TwoRanks(), RecordingTransceiver()
    seen: list[Sequence[RankReport]] = []
    driver = MultiRankDriver(
        group=group,  # type: ignore[arg-type]
        runner=NoRunner(),  # type: ignore[arg-type]
        wakeup=Wakeup(),
        transceiver=transceiver,
        on_reports=seen.append,
        clock=trio.current_time,
    )
    return driver, group, transceiver, seen


def received(key: int, **fields: Any) -> RankReport:
    return RankReport(
        rank=1, outcomes=(RankOutcome(side=Side.RECEIVE, outcome=outcome(key, **fields)),)
    )


async def test_transfer_work_is_done_here_at_once_and_on_the_others_at_the_next_tick(
    autojump_clock: trio.testing.MockClock,
) -> None:
    driver, group, transceiver, _ = make()
    driver.receive(5, "tcp://ctx:1", [0, 1], 8, None)
    driver.send(6, [2], 4, [33])
    assert transceiver.calls == [("receive", 5), ("send", 6)]
    assert driver.cancel(5) is False  # every rank must settle: the gated outcome says when
    assert not driver.settled(5)
    await driver.idle(has_work=False, in_flight=False)  # work waits for the others: tick now
    (command,) = group.commands
    assert [r.key for r in command.receives] == [5] and command.receives[0].block_ids == (0, 1)
    assert [(s.key, s.first_tokens) for s in command.sends] == [(6, (33,))]
    assert command.cancels == (5,)
    assert not command.has_forward


async def test_a_transfer_is_final_once_every_rank_reported_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    driver, group, transceiver, seen = make()
    transceiver.gen_done.append(outcome(5, num_bytes=100))
    await driver.idle(has_work=False, in_flight=True)
    assert driver.outcomes() == ([], [])  # rank 1 has not said yet
    group.follower.append(received(5, num_bytes=50))
    await driver.idle(has_work=False, in_flight=True)
    (merged,), sends = driver.outcomes()
    assert sends == [] and merged.ok and merged.num_bytes == 150
    assert len(seen) == 2  # every tick's reports reach whoever built the driver


async def test_one_rank_failing_cancels_the_transfer_on_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    driver, group, transceiver, _ = make()
    group.follower.append(received(5, ok=False, error="ctx is gone"))
    await driver.idle(has_work=False, in_flight=True)
    assert transceiver.calls == [("cancel", 5)]  # here now
    await driver.idle(has_work=False, in_flight=True)
    assert group.commands[-1].cancels == (5,)  # the others at the next tick
    transceiver.gen_done.append(outcome(5, ok=False, cancelled=True))
    await driver.idle(has_work=False, in_flight=True)
    (merged,), _ = driver.outcomes()
    assert not merged.ok and merged.error == "ctx is gone"


@pytest.mark.parametrize(
    ("has_work", "in_flight", "interval"),
    [(False, True, RANK_POLL_S), (False, False, HEARTBEAT_S)],
)
async def test_ticks_come_while_transfers_fly_and_as_a_heartbeat(
    autojump_clock: trio.testing.MockClock, has_work: bool, in_flight: bool, interval: float
) -> None:
    driver, group, _, _ = make()
    start = trio.current_time()
    await driver.idle(has_work=has_work, in_flight=in_flight)
    assert len(group.commands) == 1
    assert trio.current_time() - start == pytest.approx(interval)


async def test_no_tick_while_requests_wait_for_blocks_and_nothing_flies(
    autojump_clock: trio.testing.MockClock,
) -> None:
    driver, group, _, _ = make()
    await driver.idle(has_work=True, in_flight=False)
    assert group.commands == []  # it waited, for a wake-up or a short while, and rescheduled
