"""What shortens the way from KV ready to the write's post: two KvTransceivers in one trio run
(real ZMQ, loopback agent), as in test_transceiver_prepared.py.

context_first: REQUEST_DATA as a transfer-agent notification (RankInfo.request_notices). gen
sends it both ways to a ctx rank that takes it so; ctx takes the notification when its session
waits for the request and drops the ZMQ copy that follows. Anything else about a notification
(no session yet, a sender other than the rank it names) leaves the work to the ZMQ copy.

generation_first: a write prepared during the prefill is posted as soon as the KV is ready,
before the session is made, when that session is sure to take the request it was made for.
"""

from __future__ import annotations

import time

import attrs
import pytest

from tests.integration.test_transceiver_prepared import (
    NUM_TOKENS,
    Pair,
    _ask_early,
    _connect,
    _open_pair,
    _outcome,
    _prepared_early,
    _until,
)
from trtdisagg.transfer import pacing
from trtdisagg.transfer.pacing import ANNOUNCE_AFTER_S
from trtdisagg.transfer.protocol.wire import RequestData, decode, encode, pack_block_ids
from trtdisagg.transfer.runtime.agents.loopback import LoopbackAgent
from trtdisagg.transfer.runtime.messenger import open_dealer
from trtdisagg.transfer.send_side import CtxSender

SRC, DST = [4, 5, 6], [1, 2, 3]


def _request(pair: Pair, key: int) -> RequestData:
    """The REQUEST_DATA gen's transceiver would send for `key` into DST."""
    return RequestData(
        key=key,
        instance_name=pair.gen.local.instance_name,
        instance_rank=0,
        block_ids=(pack_block_ids(DST),),
        num_tokens=NUM_TOKENS,
    )


async def test_gen_sends_the_request_both_ways_and_ctx_answers_it_once() -> None:
    async with _open_pair(request_notices=True) as pair:
        await _connect(pair)  # the rendezvous connected gen's agent to ctx's
        seen: list[tuple[str, RequestData | None]] = []
        drain = pair.ctx_agent.get_notifications

        def recording() -> list[tuple[str, bytes]]:
            found = drain()
            seen.extend((remote, _as_request(payload)) for remote, payload in found)
            return found

        pair.ctx_agent.get_notifications = recording  # type: ignore[method-assign]
        before = pair.ctx.statistics().request_notices
        key = 2**42 + 1
        pair.ctx.respond_and_send_async(key, [SRC], NUM_TOKENS, first_tokens=(5,))
        pair.gen.request_and_receive_async(key, pair.ctx.info_endpoint, [DST], NUM_TOKENS)
        outcome = await _outcome(pair.gen.check_gen_transfer_status)
        assert outcome.ok and outcome.first_tokens == (5,)
        assert pair.gen_blocks(DST) == pair.ctx_blocks(SRC)
        assert (await _outcome(pair.ctx.check_context_transfer_status)).ok
        mine = [(remote, r) for remote, r in seen if r is not None and r.key == key]
        assert mine == [(pair.gen_agent.name, _request(pair, key))]
        # Whichever copy came first was taken (in one process ZMQ may win the race), and the
        # other one dropped: nothing is held for a prefill to come, nothing awaited.
        taken = pair.ctx.statistics().request_notices - before
        assert taken in (0, 1)
        await _until(lambda: pair.ctx.statistics().request_copies_due == 0, "the ZMQ copy")
        assert pair.ctx.statistics().early == 0


def _as_request(payload: bytes) -> RequestData | None:
    message = decode(payload)
    return message if isinstance(message, RequestData) else None


async def test_the_zmq_copy_is_dropped_even_after_the_transfer_ended() -> None:
    async with _open_pair(request_notices=True) as pair:
        await _connect(pair)
        key = 2**42 + 2
        pair.ctx.respond_and_send_async(key, [SRC], NUM_TOKENS)
        request = _request(pair, key)
        pair.gen_agent.send_notification(pair.ctx_agent.name, encode(request))
        assert (await _outcome(pair.ctx.check_context_transfer_status)).ok  # session gone
        assert pair.gen_blocks(DST) == pair.ctx_blocks(SRC)
        assert pair.ctx.statistics().request_copies_due == 1
        async with open_dealer(pair.ctx.local.control_endpoint) as dealer:
            await dealer.send_message(request)  # the ZMQ copy, late
            await _until(lambda: pair.ctx.statistics().request_copies_due == 0, "the copy")
        assert pair.ctx.statistics().early == 0  # else refused 30 s later as a stale request


async def test_a_notification_from_another_agent_than_the_rank_it_names_is_dropped() -> None:
    async with _open_pair(request_notices=True) as pair:
        await _connect(pair)
        key = 2**42 + 3
        zeros = pair.gen_blocks(DST)
        intruder = LoopbackAgent("intruder", fabric=pair.ctx_agent._fabric)
        intruder.add_remote(pair.ctx_agent.local_metadata())
        before = pair.ctx.statistics().request_notices
        pair.ctx.respond_and_send_async(key, [SRC], NUM_TOKENS)  # ctx watches: it drains
        request = _request(pair, key)
        intruder.send_notification(pair.ctx_agent.name, encode(request))
        await _until(lambda: pair.ctx_agent.num_notifications == 0, "ctx draining it")
        assert pair.ctx.statistics().request_notices == before
        assert pair.gen_blocks(DST) == zeros  # nothing written on its word
        async with open_dealer(pair.ctx.local.control_endpoint) as dealer:
            await dealer.send_message(request)  # the real request, over ZMQ
            assert (await _outcome(pair.ctx.check_context_transfer_status)).ok
        assert pair.gen_blocks(DST) == pair.ctx_blocks(SRC)


async def test_a_request_before_the_response_waits_in_the_early_buffer_as_before() -> None:
    async with _open_pair(request_notices=True) as pair:
        await _connect(pair)
        before = pair.ctx.statistics().request_notices
        key = 2**42 + 4
        await _ask_early(pair, key, DST)  # the notification found no session: the copy is held
        await _until(lambda: pair.ctx_agent.num_notifications == 0, "ctx draining it")
        pair.ctx.respond_and_send_async(key, [SRC], NUM_TOKENS)
        assert (await _outcome(pair.gen.check_gen_transfer_status)).ok
        assert pair.gen_blocks(DST) == pair.ctx_blocks(SRC)
        stats = pair.ctx.statistics()
        assert (stats.request_notices, stats.request_copies_due) == (before, 0)


async def test_gen_sends_zmq_only_to_a_ctx_that_does_not_take_notices_or_with_faults() -> None:
    for notices, gen_faults in ((False, None), (True, "none")):
        async with _open_pair(request_notices=notices, gen_faults=gen_faults) as pair:
            await _connect(pair)
            key = 2**42 + 5
            pair.ctx.respond_and_send_async(key, [SRC], NUM_TOKENS)
            pair.gen.request_and_receive_async(key, pair.ctx.info_endpoint, [DST], NUM_TOKENS)
            assert (await _outcome(pair.gen.check_gen_transfer_status)).ok
            assert pair.ctx.statistics().request_notices == 0, (notices, gen_faults)
            assert pair.ctx_agent.num_notifications == 0  # none was ever sent


# ---- generation_first: a prepared write posted ahead of the session's bookkeeping ----


async def _watching(pair: Pair) -> None:
    """Until gen watches for the prepared write, as far as ctx can tell (pacing.gen_watches)."""
    told = time.monotonic()
    await _until(lambda: time.monotonic() >= told + ANNOUNCE_AFTER_S, "gen told a hop ago")


async def test_a_prepared_write_is_posted_before_the_session_is_made() -> None:
    async with _open_pair() as pair:
        pair.ctx.stages = []
        key = 2**42 + 6
        await _prepared_early(pair, key, DST)
        await _watching(pair)
        pair.ctx.respond_and_send_async(key, [SRC], NUM_TOKENS, first_tokens=(8,))
        outcome = await _outcome(pair.gen.check_gen_transfer_status)
        assert outcome.ok and outcome.first_tokens == (8,)
        assert pair.gen_blocks(DST) == pair.ctx_blocks(SRC)
        assert (await _outcome(pair.ctx.check_context_transfer_status)).ok
        stages = [stage for k, stage, _ in pair.ctx.stages if k == key]
        assert stages.index("posted") < stages.index("write")  # the session's write came after
        assert pair.ctx.statistics().prepared_posts == 1
        await _until(lambda: pair.ctx_agent.num_handles == 0, "every handle released")


async def test_a_rank_that_asked_twice_differently_is_not_posted_ahead() -> None:
    # The session takes the first request; the write prepared for the second must not go.
    async with _open_pair() as pair:
        pair.ctx.stages = []
        await _connect(pair)
        key, other = 2**42 + 7, [7, 8, 9]
        first = _request(pair, key)
        second = attrs.evolve(first, block_ids=(pack_block_ids(other),))
        zeros = pair.gen_blocks(other)
        async with open_dealer(pair.ctx.local.control_endpoint) as dealer:
            await dealer.send_message(first)
            await dealer.send_message(second)
            await _until(lambda: pair.ctx.statistics().early == 1, "ctx holding them")
            await _until(lambda: len(pair.ctx.early.peek(key)) == 2, "both held")
            pair.ctx.prepare_send(key, [SRC], NUM_TOKENS)
            await _watching(pair)
            pair.ctx.respond_and_send_async(key, [SRC], NUM_TOKENS)
            assert (await _outcome(pair.ctx.check_context_transfer_status)).ok
        assert pair.gen_blocks(DST) == pair.ctx_blocks(SRC)
        assert pair.gen_blocks(other) == zeros
        stages = [stage for k, stage, _ in pair.ctx.stages if k == key]
        assert stages.index("write") < stages.index("post")  # posted by the session, not ahead
        await _until(lambda: pair.ctx_agent.num_handles == 0, "every handle released")


# ---- WRITE_POSTED: left out where gen watches for a write that ends soon ----


def _seen_posted(pair: Pair, key: int) -> bool:
    assert pair.gen.stages is not None
    return (key, "posted_seen") in [(k, stage) for k, stage, _ in pair.gen.stages]


async def test_a_short_write_that_gen_watches_for_goes_unannounced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "Short": below SILENT_WRITE_S by ctx's estimate, which on a loaded 2-core machine may
    # learn a loopback copy as slow as 1 ms; the threshold itself has its unit test (pacing).
    monkeypatch.setattr(pacing, "SILENT_WRITE_S", 60.0)
    async with _open_pair(request_notices=True) as pair:
        pair.gen.stages = []
        await _connect(pair)  # key 1: no estimate of the write's time yet, so announced
        await _until(lambda: _seen_posted(pair, 1), "WRITE_POSTED of the first write")
        key = 2**42 + 8  # context_first: gen watches just after its request
        pair.ctx.respond_and_send_async(key, [SRC], NUM_TOKENS, first_tokens=(4,))
        pair.gen.request_and_receive_async(key, pair.ctx.info_endpoint, [DST], NUM_TOKENS)
        outcome = await _outcome(pair.gen.check_gen_transfer_status)
        assert outcome.ok and outcome.first_tokens == (4,)  # the notice said it all
        prepared = 2**42 + 9  # generation_first, told of the prepared write
        await _ask_early(pair, prepared, [0, 6, 7])
        pair.ctx.prepare_send(prepared, [SRC], NUM_TOKENS)
        await _watching(pair)
        pair.ctx.respond_and_send_async(prepared, [SRC], NUM_TOKENS, first_tokens=(6,))
        outcome = await _outcome(pair.gen.check_gen_transfer_status)
        assert outcome.ok and outcome.first_tokens == (6,)
        for done in (key, prepared):  # TRANSFER_RESULT comes after; WRITE_POSTED never did
            await _until(
                lambda k=done: (k, "result") in [(s[0], s[1]) for s in pair.gen.stages or []],
                "TRANSFER_RESULT",
            )
            assert not _seen_posted(pair, done)


async def test_a_write_posted_ahead_that_the_session_does_not_take_is_settled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Unreachable by design (ctx posts ahead only for requests its session will take); should
    # one slip through, the session fails, keeps its blocks until the write ended, and the
    # handle goes back to the agent.
    async with _open_pair() as pair:
        pair.ctx.stages = []
        key = 2**42 + 10
        await _prepared_early(pair, key, DST)
        await _watching(pair)
        monkeypatch.setattr(CtxSender, "_accept_request", lambda self, session, request: False)
        pair.ctx.respond_and_send_async(key, [SRC], NUM_TOKENS)
        assert pair.ctx.senders.get(key) is not None  # held: not quiescent before the write ends
        outcome = await _outcome(pair.ctx.check_context_transfer_status)
        assert not outcome.ok and "did not take" in (outcome.error or "")
        await _until(lambda: pair.ctx_agent.num_handles == 0, "the handle released")


# NIXL's UCX backend sends a write's notification from the first poll that finds the write
# done; the write's own task polls only once the loop is back from the caller. The transceiver
# therefore polls young writes itself before handing control back (`CtxWrites.nudge`).


async def test_a_write_that_ended_during_the_call_is_told_before_the_call_returns() -> None:
    async with _open_pair(notify_on_poll=True) as pair:
        key = 2**42 + 10
        await _prepared_early(pair, key, DST)
        await _watching(pair)
        assert pair.gen_agent.num_notifications == 0
        pair.ctx.respond_and_send_async(key, [SRC], NUM_TOKENS, first_tokens=(9,))
        # No checkpoint since the call: only the call itself can have polled the write.
        assert pair.gen_agent.num_notifications == 1
        outcome = await _outcome(pair.gen.check_gen_transfer_status)
        assert outcome.ok and outcome.first_tokens == (9,)
        assert pair.gen_blocks(DST) == pair.ctx_blocks(SRC)
        assert (await _outcome(pair.ctx.check_context_transfer_status)).ok
        await _until(lambda: pair.ctx_agent.num_handles == 0, "every handle released")


async def test_a_write_started_by_a_noticed_request_is_polled_at_once() -> None:
    async with _open_pair(request_notices=True, notify_on_poll=True) as pair:
        await _connect(pair)
        key = 2**42 + 11
        pair.ctx.respond_and_send_async(key, [SRC], NUM_TOKENS)  # context_first: ctx watches
        pair.gen_agent.send_notification(pair.ctx_agent.name, encode(_request(pair, key)))
        pair.ctx._drain_notifications()  # what ctx's watching loop does at its next round
        assert pair.gen_agent.num_notifications == 1  # the write's, sent from within that round
        assert pair.gen_blocks(DST) == pair.ctx_blocks(SRC)
        assert (await _outcome(pair.ctx.check_context_transfer_status)).ok
        await _until(lambda: pair.ctx_agent.num_handles == 0, "every handle released")
