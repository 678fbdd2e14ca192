"""Rank 0's bookkeeping of a multi-rank instance (worker/rank_plan.py): pure."""

from __future__ import annotations

import pytest

from trtdisagg.kv.block_pool import BlockCopy
from trtdisagg.transfer.protocol.sessions import TransferOutcome
from trtdisagg.worker.rank_group import decode_command, decode_report, encode_command, encode_report
from trtdisagg.worker.rank_plan import (
    HeadDigest,
    ItemInputs,
    OutcomeGate,
    RankDigest,
    RankOutcome,
    RankReport,
    ReceiveCommand,
    SendCommand,
    Side,
    StepCommand,
    compose_digest,
    step_items,
)


def _report(key: int, *, ok: bool = True, cancelled: bool = False, nbytes: int = 10) -> RankOutcome:
    error = None if ok else "boom"
    outcome = TransferOutcome(key=key, ok=ok, cancelled=cancelled, error=error, num_bytes=nbytes)
    return RankOutcome(side=Side.RECEIVE, outcome=outcome)


def test_a_transfer_is_final_only_when_every_rank_reported() -> None:
    gate = OutcomeGate(world_size=3)
    assert gate.add(0, _report(7)) is None
    assert gate.add(2, _report(7, nbytes=5)) is None
    merged = gate.add(1, _report(7))
    assert merged is not None and merged.outcome.ok and merged.outcome.num_bytes == 25
    assert len(gate) == 0


def test_failure_and_cancellation_are_the_union() -> None:
    gate = OutcomeGate(world_size=2)
    assert gate.add(1, _report(3, ok=False)) is None
    assert gate.newly_failed(Side.RECEIVE, 3)  # tell the other ranks once ...
    assert not gate.newly_failed(Side.RECEIVE, 3)  # ... not every tick
    merged = gate.add(0, _report(3))
    assert merged is not None and not merged.outcome.ok and merged.outcome.error == "boom"
    gate.add(0, _report(4, ok=False, cancelled=True))
    cancelled = gate.add(1, _report(4))
    assert cancelled is not None and cancelled.outcome.cancelled and not cancelled.outcome.ok


def test_a_rank_reporting_twice_is_a_bug() -> None:
    gate = OutcomeGate(world_size=2)
    gate.add(0, _report(1))
    with pytest.raises(ValueError, match="rank 0 reported receive 1 twice"):
        gate.add(0, _report(1))
    with pytest.raises(ValueError, match="rank 5 outside an instance of 2 ranks"):
        gate.add(5, _report(2))


def test_step_items_carry_only_the_blocks_the_step_touches() -> None:
    (item,) = step_items([(9, (5, 6, 7), 6, (10, 11, 12, 13), True)], 4)
    assert item == ItemInputs(
        request_id=9, token_ids=(5, 6, 7), start=6, block_ids=(10, 11, 12), samples=True
    )
    with pytest.raises(ValueError, match="request 9: 2 blocks cannot hold 9 tokens"):
        step_items([(9, (5, 6, 7), 6, (10, 11), True)], 4)


def test_digest_is_independent_of_the_cut_and_catches_disagreeing_copies() -> None:
    parts = [
        HeadDigest(layer=layer, head=h, digest=f"{layer}{h}") for layer in (0, 1) for h in (0, 1)
    ]
    assert compose_digest(parts) == compose_digest(reversed(parts))
    assert compose_digest([*parts, parts[0]]) == compose_digest(parts)  # a duplicated head
    clash = HeadDigest(layer=0, head=0, digest="other")
    assert compose_digest([*parts, clash]).startswith("mismatch")


def test_commands_and_reports_round_trip_the_wire() -> None:
    command = StepCommand(
        items=(ItemInputs(request_id=1, token_ids=(3,), start=4, block_ids=(2,), samples=True),),
        copies=(BlockCopy(src=1, dst=2),),
        receives=(
            ReceiveCommand(key=5, endpoint="tcp://127.0.0.1:9", block_ids=(1, 2), num_tokens=7),
        ),
        sends=(SendCommand(key=6, block_ids=(3, 4), num_tokens=9, first_tokens=(5,)),),
        cancels=(8,),
    )
    assert decode_command(encode_command(command)) == command
    report = RankReport(
        rank=1,
        outcomes=(_report(5, ok=False),),
        digests=(RankDigest(key=5, parts=(HeadDigest(layer=0, head=1, digest="ab"),)),),
    )
    assert decode_report(encode_report(report)) == report
