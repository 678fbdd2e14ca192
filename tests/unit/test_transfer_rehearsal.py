"""gen's hand-over rehearsal: a twin transfer through the real receiver code, with no effects."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import numpy as np
import pytest

from tests.transceivers import rank_info
from trtdisagg.transfer.agents.loopback import LoopbackAgent, LoopbackFabric
from trtdisagg.transfer.rehearsal import (
    REHEARSAL_KEY,
    HandoverRehearsal,
    RehearsalEffect,
)
from trtdisagg.transfer.sessions import TransferOutcome
from trtdisagg.transfer.wire import RequestData, encode


@attrs.define
class _Shell:
    """What the transceiver lends the twin: its clock, stamps and outcomes, recorded."""

    now: float = 100.0
    stamps: list[tuple[int, str]] = attrs.Factory(list)
    outcomes: list[TransferOutcome] = attrs.Factory(list)

    def clock(self) -> float:
        return self.now

    def stamp(self, key: int, stage: str) -> None:
        self.stamps.append((key, stage))

    def outcome(self, key: int, *, ok: bool, **fields: object) -> TransferOutcome:
        made = TransferOutcome(key=key, ok=ok, **fields)  # type: ignore[arg-type]
        self.outcomes.append(made)
        return made


def _rehearsal(shell: _Shell) -> HandoverRehearsal:
    agent = LoopbackAgent("gen-agent", fabric=LoopbackFabric())
    local = rank_info("gen", np.zeros(1 << 16, np.uint8), agent, "tcp://127.0.0.1:1")
    return HandoverRehearsal.of(
        local, timeout_s=30, clock=shell.clock, stamp=shell.stamp, outcome=shell.outcome
    )


def test_each_run_takes_one_twin_transfer_from_its_notice_to_its_outcome() -> None:
    shell = _Shell()
    rehearsal = _rehearsal(shell)
    for run in range(3):
        rehearsal.run(shell.now)
        assert rehearsal.runs == run + 1
        assert [o.key for o in shell.outcomes] == [REHEARSAL_KEY] * (run + 1)
        assert shell.outcomes[-1].ok and shell.outcomes[-1].first_tokens == (0,)
        assert (REHEARSAL_KEY, "notice") in shell.stamps
        assert not len(rehearsal.twin.receivers)
        assert rehearsal.next_at > shell.now
        shell.now += 1.0


def test_runs_keep_nothing_that_grows() -> None:
    """It runs thousands of times a second while gen spins: the twin ends where it started."""
    shell = _Shell()
    rehearsal = _rehearsal(shell)
    rehearsal.run(shell.now)
    kept = (len(rehearsal.twin._results_due), len(rehearsal.twin._landed))
    for _ in range(5000):
        shell.now += 0.0003
        rehearsal.run(shell.now)
    assert (len(rehearsal.twin._results_due), len(rehearsal.twin._landed)) == kept == (1, 0)
    assert not len(rehearsal.twin.receivers) and rehearsal.runs == 5001


def test_a_twin_that_leaves_the_hand_over_path_says_so() -> None:
    shell = _Shell()
    rehearsal = _rehearsal(shell)
    rehearsal.payload = encode(
        RequestData(
            key=1, instance_name="x", instance_rank=0, block_ids=(), num_tokens=1,
            staging_address=0, staging_bytes=0,
        )
    )  # fmt: skip
    with pytest.raises(RehearsalEffect, match="decoded as RequestData"):
        rehearsal.run(shell.now)
    assert rehearsal.runs == 0


def test_the_cold_path_tool_times_each_case_once_per_round() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import cold_path

    times = cold_path.measure(idle_s=0.0005, rounds=3)
    assert sorted(times) == ["cold", "rehearsed", "warm"]
    assert all(len(seconds) == 3 and min(seconds) > 0 for seconds in times.values())
