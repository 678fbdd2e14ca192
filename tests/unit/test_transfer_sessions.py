"""Session state machines: transitions, no-op late/duplicate events, cancellation vs quiescence."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtdisagg.transfer.protocol.sessions import (
    EarlyMessages,
    ReceiverSession,
    SenderSession,
    Sessions,
    SourceBlocks,
    Status,
)
from trtdisagg.transfer.protocol.wire import (
    RequestData,
    ResultStatus,
    TransferResult,
    WriteNotice,
    pack_block_ids,
)

OK, ERROR = ResultStatus.OK, ResultStatus.ERROR


def _request(rank: int, key: int = 1) -> RequestData:
    return RequestData(
        key=key,
        instance_name="gen",
        instance_rank=rank,
        block_ids=(pack_block_ids([rank]),),
        num_tokens=4,
    )


def _result(rank: int, status: ResultStatus = OK, **fields: Any) -> TransferResult:
    return TransferResult(key=1, instance_name="ctx", instance_rank=rank, status=status, **fields)


def _notice(rank: int, **fields: Any) -> WriteNotice:
    return WriteNotice(key=1, instance_name="ctx", instance_rank=rank, **fields)


def _sender(expected: tuple[int, ...] = (0, 1)) -> SenderSession:
    session = SenderSession(key=1, deadline=10.0)
    session.bind("gen", frozenset(expected))
    return session


def _src(block_ids: list[list[int]], num_tokens: int) -> SourceBlocks:
    return SourceBlocks(block_ids=tuple(map(tuple, block_ids)), num_tokens=num_tokens)


def _receiver(expected: tuple[int, ...] = (0, 1)) -> ReceiverSession:
    return ReceiverSession(key=1, peer_instance="ctx", expected=frozenset(expected), deadline=10.0)


def test_sender_happy_path() -> None:
    s = _sender()
    assert s.status is Status.INIT
    s.add_request(_request(0))
    assert s.status is Status.INIT
    assert s.take_writes() == []
    s.set_source(_src([[3, 4]], 5))
    assert [r.instance_rank for r in s.take_writes()] == [0]
    assert s.status is Status.TRANSFERRING
    assert not s.is_quiescent
    assert s.take_writes() == []  # in flight: never handed out twice
    s.write_finished(0, OK)
    assert s.status is Status.INIT  # waiting for gen rank 1
    s.add_request(_request(1))
    (request,) = s.take_writes()
    s.write_finished(request.instance_rank, OK)
    assert s.status is Status.TRANSFERRED
    assert s.is_terminal
    assert s.is_quiescent


def test_sender_ignores_duplicates_unexpected_and_late() -> None:
    s = _sender(expected=(0,))
    s.set_source(_src([[1]], 1))
    first = _request(0)
    s.add_request(first)
    s.add_request(_request(0))  # duplicate
    s.add_request(_request(5))  # not an overlapping gen rank
    assert s.requests == {0: first} and s.requests[0] is first
    s.write_finished(0, OK)  # never in flight
    assert s.status is Status.INIT
    assert s.take_writes() == [first]
    s.write_finished(0, OK)
    s.write_finished(0, ERROR, "late")  # late duplicate
    s.add_request(_request(0))  # after TRANSFERRED
    assert s.requests[0] is first
    assert s.status is Status.TRANSFERRED


def test_sender_failed_write_is_error() -> None:
    s = _sender(expected=(0,))
    s.set_source(_src([[1]], 1))
    s.add_request(_request(0))
    s.take_writes()
    s.write_finished(0, ERROR, "nixl said no")
    assert s.status is Status.ERROR
    assert s.error == "nixl said no"


def test_sender_cancelled_write_cancels_the_session() -> None:
    s = _sender(expected=(0,))
    s.set_source(_src([[1]], 1))
    s.add_request(_request(0))
    s.take_writes()
    s.write_finished(0, ResultStatus.CANCELLED)
    assert s.status is Status.CANCELLED


def test_sender_cancel_is_not_quiescence() -> None:
    s = _sender()
    s.set_source(_src([[1]], 1))
    s.add_request(_request(0))
    s.add_request(_request(1))
    s.take_writes()
    assert s.cancel() is False  # writes in flight: blocks must stay pinned
    assert s.status is Status.CANCELLED
    assert s.take_writes() == []
    s.write_finished(0, OK)
    s.write_finished(1, OK)
    assert s.status is Status.CANCELLED
    assert s.is_quiescent
    assert s.cancel() is True


def test_sender_terminal_states_are_sticky() -> None:
    s = _sender(expected=(0,))
    s.set_source(_src([[1]], 1))
    s.add_request(_request(0))
    s.take_writes()
    s.write_finished(0, OK)
    s.cancel()
    s.fail("late failure")
    assert s.status is Status.TRANSFERRED
    with pytest.raises(ValueError, match="source set twice"):
        s.set_source(_src([[1]], 1))


def test_sender_deadline() -> None:
    s = _sender()
    assert not s.expire(9.9, 10.0)
    assert s.expire(10.0, 10.0)
    assert s.status is Status.ERROR and s.error == "KV transfer 1 timed out after 10s"
    assert not s.expire(11.0, 10.0)


def test_receiver_happy_path_needs_results_and_notices() -> None:
    r = _receiver()
    assert r.status is Status.TRANSFERRING
    assert r.status is Status.TRANSFERRING
    r.on_result(_result(0))  # non-elected duplicate
    r.on_result(_result(1, num_bytes=100, num_descriptors=2))
    assert r.status is Status.TRANSFERRING  # rank 1's bytes not confirmed landed
    r.on_notice(_notice(1))
    assert r.status is Status.TRANSFERRED
    assert r.moved()[:2] == (100, 2)


def test_receiver_notice_may_come_first() -> None:
    r = _receiver(expected=(3,))
    r.on_notice(_notice(3))
    r.on_notice(_notice(3, num_bytes=8, num_descriptors=1))  # duplicate: ignored
    assert r.status is Status.TRANSFERRING and r.moved()[:2] == (0, 0)
    r.on_result(_result(3, num_bytes=8, num_descriptors=1))
    assert r.status is Status.TRANSFERRED


def test_receiver_ignores_unexpected_duplicate_and_late() -> None:
    r = _receiver(expected=(0,))
    r.on_result(_result(9, ERROR, error="stray"))
    r.on_notice(_notice(9))
    assert r.status is Status.TRANSFERRING and 9 not in r._noticed
    r.on_result(_result(0))
    r.on_result(_result(0, ERROR, error="dup"))
    assert r.status is Status.TRANSFERRED


def test_receiver_error_result_and_quiescence() -> None:
    r = _receiver()
    r.on_result(_result(0, ERROR, error="boom"))
    assert r.status is Status.ERROR
    assert r.error == "ctx rank 0: error: boom"
    assert not r.is_quiescent  # rank 1 may still be writing into our blocks
    r.on_result(_result(1, num_bytes=4, num_descriptors=1))
    assert r.status is Status.ERROR
    assert r.is_quiescent


def test_receiver_cancel() -> None:
    r = _receiver()
    r.cancel()
    assert r.status is Status.CANCELLED
    r.on_result(_result(0, ERROR, error="cancelled"))
    assert r.status is Status.CANCELLED  # an error never overrides CANCELLED
    assert not r.expire(100.0, 10.0)


def test_a_receiver_whose_ctx_died_fails_and_is_quiescent_at_once() -> None:
    r = _receiver()
    assert not r.is_quiescent
    r.peer_died("peer instance ctx-a is gone: its connection dropped")
    assert r.status is Status.ERROR and r.is_quiescent
    assert r.error == "peer instance ctx-a is gone: its connection dropped"
    cancelled = _receiver()
    cancelled.cancel()  # quarantined: a write may still land, until the ctx instance ended
    cancelled.peer_died("gone")
    assert cancelled.status is Status.CANCELLED and cancelled.is_quiescent


def test_registry_routes_only_to_the_owning_peer() -> None:
    senders: Sessions[SenderSession] = Sessions()
    unbound = senders[1] = SenderSession(key=1, deadline=5.0)
    assert senders.lookup("gen-a", 1) is unbound  # not bound yet: the first requester binds it
    unbound.bind("gen-a", frozenset({0}))
    assert senders.lookup("gen-a", 1) is unbound
    assert senders.lookup("gen-b", 1) is None
    with pytest.raises(ValueError, match="already bound to gen-a"):
        unbound.bind("gen-b", frozenset({0}))
    assert senders.lookup("gen-a", 2) is None

    receivers: Sessions[ReceiverSession] = Sessions()
    receivers[1] = _receiver()
    assert receivers.lookup("ctx", 1) is not None
    assert receivers.lookup("evil", 1) is None


def test_early_messages() -> None:
    early = EarlyMessages(ttl=5.0)
    early.add_request(0.0, _request(0, key=7))
    early.add_request(4.0, _request(1, key=7))
    early.add_cancel(2.0, key=8, instance="gen-b")
    assert (early.held_by("gen"), early.held_by("gen-b"), early.held_by("other")) == (2, 1, 0)
    assert [r.instance_rank for r in early.sweep(6.0)] == [0]  # rank 0's is older than ttl
    requests, canceller = early.take(7)
    assert [r.instance_rank for r in requests] == [1]
    assert canceller is None
    assert early.take(8) == ([], "gen-b")  # who cancelled: only its session starts cancelled
    assert early.take(8) == ([], None)
    assert early.held_by("gen") == early.held_by("gen-b") == 0


@pytest.mark.parametrize("status", [ERROR, ResultStatus.CANCELLED])
def test_a_last_result_that_is_not_ok_fails_the_receiver(status: ResultStatus) -> None:
    # The last expected result completes the set; with 0 bytes it needs no notice. It must
    # still fail the session, not read as TRANSFERRED (gen would decode KV that never came).
    r = _receiver(expected=(0, 1))
    r.on_result(_result(0))
    r.on_result(_result(1, status, error="no submit"))
    assert r.status is Status.ERROR
    assert r.error == f"ctx rank 1: {status.value}: no submit"
    assert r.is_quiescent


def test_sender_reports_which_ranks_it_writes_to() -> None:
    s = _sender()
    s.add_request(_request(0))
    s.set_source(_src([[1, 2]], 20))
    s.take_writes()
    assert s.in_flight == {0}
    s.write_finished(0, OK)
    assert not s.in_flight


def test_receiver_takes_the_first_tokens_of_the_lowest_ctx_rank_that_sent_them() -> None:
    r = _receiver(expected=(0, 1, 2))
    assert r.moved()[2] == ()
    r.on_result(_result(2, first_tokens=(7,)))
    assert r.moved()[2] == (7,)
    r.on_result(_result(1))  # a follower without them
    r.on_result(_result(0, first_tokens=(5,)))
    assert r.moved()[2] == (5,)
    r.on_result(_result(0, first_tokens=(9,)))
    assert r.moved()[2] == (5,)  # a duplicate result changes nothing


def test_merged_outcome_keeps_the_first_tokens_of_any_rank() -> None:
    from trtdisagg.transfer.protocol.sessions import TransferOutcome
    from trtdisagg.worker.rank_plan import merge_outcomes

    parts = [
        TransferOutcome(key=3, ok=True, num_bytes=10),
        TransferOutcome(key=3, ok=True, num_bytes=20, first_tokens=(42,)),
    ]
    merged = merge_outcomes(parts)
    assert merged.first_tokens == (42,) and merged.num_bytes == 30
    assert merge_outcomes(parts[:1]).first_tokens == ()


def test_receiver_ends_on_a_write_s_notice_before_its_result() -> None:
    r = _receiver(expected=(0, 1))
    assert not r.is_quiescent
    r.on_notice(_notice(0, num_bytes=64, num_descriptors=1, first_tokens=(5,)))
    r.on_notice(_notice(0, num_bytes=99, num_descriptors=9, first_tokens=(9,)))  # duplicate
    r.on_notice(_notice(7, num_bytes=1, num_descriptors=1))  # unexpected
    assert r._noticed.keys() == {0}
    assert r.status is Status.TRANSFERRING  # rank 1 has not written yet
    assert r.is_quiescent is False
    r.on_result(_result(1))  # rank 1: nothing to move
    assert r.status is Status.TRANSFERRED and r.is_quiescent
    assert r.moved() == (64, 1, (5,))
    # rank 0's result comes last: it changes nothing, even an error (the bytes had landed).
    r.on_result(_result(0, ERROR, num_bytes=64, num_descriptors=1, error="late"))
    assert r.status is Status.TRANSFERRED and r.moved()[0] == 64


def test_a_write_that_fails_before_its_notice_fails_the_receiver() -> None:
    r = _receiver(expected=(0,))
    assert not r.is_quiescent  # the write may still land
    r.on_result(_result(0, ERROR, error="write failed"))
    assert r.status is Status.ERROR and r.is_quiescent
    # a notice after the error result says nothing more
    r.on_notice(_notice(0, num_bytes=64, num_descriptors=1))
    assert r._noticed == {0: None}  # heard, saying nothing
    assert r.status is Status.ERROR and r.moved()[0] == 0


_receiver_events = st.lists(
    st.tuples(
        st.sampled_from(["result", "summary", "notice", "fail", "cancel", "died"]),
        st.integers(0, 3),  # the ctx rank (3 is never expected)
        st.sampled_from(ResultStatus),
        st.integers(0, 2),  # bytes moved
    ),
    max_size=12,
)


def _derived_status(session: ReceiverSession) -> Status:
    """The receiver's status from its facts alone, as its definition reads."""
    if session.cancelled:
        return Status.CANCELLED
    if session.error is not None:
        return Status.ERROR
    if all(session._landed(rank) for rank in session.expected):
        return Status.TRANSFERRED
    return Status.TRANSFERRING


@settings(max_examples=400, deadline=None)
@given(st.sets(st.integers(0, 2), min_size=1), _receiver_events)
def test_a_receiver_s_status_is_always_its_derived_one(
    expected: set[int], events: list[tuple[str, int, ResultStatus, int]]
) -> None:
    """After any sequence of events a receiver's status (and whether it is terminal, and can
    still expire) is the one the module docstring derives from its facts."""
    session = ReceiverSession(key=1, peer_instance="ctx", expected=frozenset(expected), deadline=9)
    for kind, rank, status, num_bytes in events:
        if kind == "result":
            session.on_result(
                _result(rank, status, num_bytes=num_bytes, num_descriptors=1, error="e")
            )
        elif kind == "summary":
            session.on_notice(
                _notice(rank, num_bytes=num_bytes, num_descriptors=1, first_tokens=(7,))
            )
        elif kind == "notice":
            session.on_notice(_notice(rank))
        elif kind == "fail":
            session.fail("failed")
        elif kind == "cancel":
            session.cancel()
        else:
            session.peer_died("gone")
        assert session.status is _derived_status(session)
        assert session.is_terminal == (session.status is not Status.TRANSFERRING)
        assert copy.deepcopy(session).expire(10, 10) == (not session.is_terminal)
