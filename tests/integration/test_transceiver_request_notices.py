"""REQUEST_DATA as a transfer-agent notification (RankInfo.request_notices): two KvTransceivers in
one trio run (real ZMQ, loopback agent), as in test_transceiver_prepared.py.

gen sends it both ways to a ctx rank that takes it so; ctx takes the notification when its
session waits for the request (context_first) and drops the ZMQ copy that follows. Anything
else about a notification (no session yet, a sender other than the rank it names) leaves the
work to the ZMQ copy.
"""

from __future__ import annotations

from tests.integration.test_transceiver_prepared import (
    NUM_TOKENS,
    Pair,
    _ask_early,
    _connect,
    _open_pair,
    _outcome,
    _until,
)
from trtdisagg.transfer.agents.loopback import LoopbackAgent
from trtdisagg.transfer.messenger import open_dealer
from trtdisagg.transfer.wire import RequestData, encode, pack_block_ids

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


async def test_ctx_takes_the_request_from_gen_s_notification() -> None:
    async with _open_pair(request_notices=True) as pair:
        await _connect(pair)  # the rendezvous connected gen's agent to ctx's
        before = pair.ctx.statistics().request_notices
        key = 2**42 + 1
        pair.ctx.respond_and_send_async(key, [SRC], NUM_TOKENS, first_tokens=(5,))
        pair.gen.request_and_receive_async(key, pair.ctx.info_endpoint, [DST], NUM_TOKENS)
        outcome = await _outcome(pair.gen.check_gen_transfer_status)
        assert outcome.ok and outcome.first_tokens == (5,)
        assert pair.gen_blocks(DST) == pair.ctx_blocks(SRC)
        assert (await _outcome(pair.ctx.check_context_transfer_status)).ok
        assert pair.ctx.statistics().request_notices == before + 1
        # The ZMQ copy comes after and is dropped: not held for a prefill to come.
        await _until(lambda: pair.ctx.statistics().request_copies_due == 0, "the ZMQ copy")
        assert pair.ctx.statistics().early == 0


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
