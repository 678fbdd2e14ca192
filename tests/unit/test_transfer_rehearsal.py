"""gen's hand-over rehearsal: a twin transfer through the real receiver code, with no effects."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tests.transceivers import rank_info
from trtdisagg.transfer.protocol.wire import RequestData, encode
from trtdisagg.transfer.rehearsal import (
    REHEARSAL_KEY,
    HandoverRehearsal,
    RehearsalEffect,
)
from trtdisagg.transfer.runtime.agents.loopback import LoopbackAgent, LoopbackFabric


def _rehearsal() -> HandoverRehearsal:
    agent = LoopbackAgent("gen-agent", fabric=LoopbackFabric())
    local = rank_info("gen", np.zeros(1 << 16, np.uint8), agent, "tcp://127.0.0.1:1")
    return HandoverRehearsal.of(local, timeout_s=30, clock=lambda: 100.0)


def test_each_run_takes_one_twin_transfer_from_its_notice_to_its_outcome() -> None:
    rehearsal = _rehearsal()
    for run in range(3):
        now = 100.0 + run
        outcome = rehearsal.run(now)
        assert (outcome.key, outcome.ok, outcome.first_tokens) == (REHEARSAL_KEY, True, (0,))
        assert (outcome.num_bytes, outcome.num_descriptors) == (1, 1)
        assert rehearsal.runs == run + 1 and not len(rehearsal.twin.receivers)


def test_runs_keep_nothing_that_grows() -> None:
    """It runs thousands of times a second while gen spins: the twin ends where it started."""
    rehearsal = _rehearsal()
    rehearsal.run(100.0)
    kept = (len(rehearsal.twin._results_due), len(rehearsal.twin._landed))
    for run in range(5000):
        rehearsal.run(100.0 + run * 0.0003)
    assert (len(rehearsal.twin._results_due), len(rehearsal.twin._landed)) == kept == (1, 0)
    assert not len(rehearsal.twin.receivers) and rehearsal.runs == 5001


def test_a_twin_that_leaves_the_hand_over_path_says_so() -> None:
    rehearsal = _rehearsal()
    rehearsal.payload = encode(
        RequestData(
            key=1, instance_name="x", instance_rank=0, block_ids=(), num_tokens=1,
            staging_address=0, staging_bytes=0,
        )
    )  # fmt: skip
    with pytest.raises(RehearsalEffect, match="decoded as RequestData"):
        rehearsal.run(100.0)
    assert rehearsal.runs == 0


def test_the_cold_path_tool_times_each_case_once_per_round() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import cold_path

    times = cold_path.measure(idle_s=0.0005, rounds=3)
    assert sorted(times) == ["cold", "rehearsed", "warm"]
    assert all(len(seconds) == 3 and min(seconds) > 0 for seconds in times.values())
