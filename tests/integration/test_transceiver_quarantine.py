"""gen's quarantine after a failed transfer (real ZMQ, loopback agents with injected faults).

A gen session that times out while a ctx write may still land reports the failure at once, but
its blocks stay quarantined (`cancel_request` False) until ctx has answered: the write's own
result, or ctx's answer to the CANCEL. Only a ctx that stays silent for a second timeout past the
deadline is given up on, and that is counted.
"""

from __future__ import annotations

import trio

from tests.transceivers import NUM_TOKENS, Pair, open_pair, outcome_of, until

TIMEOUT_S = 0.5
LOST_NOTICE = "drop:WRITE_NOTICE"  # at gen: the notification that says the bytes landed
KEY = 2**41 + 3


def _start(pair: Pair) -> None:
    pair.ctx.respond_and_send_async(KEY, [[1, 2, 3]], NUM_TOKENS)
    pair.gen.request_and_receive_async(KEY, pair.ctx.info_endpoint, [[4, 5, 6]], NUM_TOKENS)


async def test_timeout_with_a_write_in_flight_holds_the_blocks_until_it_lands() -> None:
    stall_s = TIMEOUT_S * 1.5  # past the deadline, before a second timeout
    async with open_pair(ctx_faults=f"stall_transfer:{stall_s}s", timeout_s=TIMEOUT_S) as pair:
        started = trio.current_time()
        _start(pair)
        failed = await outcome_of(pair.gen.check_gen_transfer_status)
        assert not failed.ok and failed.blocks_held and "timed out" in (failed.error or "")
        assert trio.current_time() - started < TIMEOUT_S * 2  # the request fails on time
        assert pair.gen.cancel_request(KEY) is False  # ctx's write is still in flight
        assert pair.gen.statistics().quarantined == 1
        # gen's CANCEL cancels ctx's session, whose write stays in flight: quarantined too.
        await until(lambda: pair.ctx.statistics().quarantined == 1, "ctx quarantine")
        await until(lambda: pair.gen.cancel_request(KEY), "the write's result", TIMEOUT_S)
        assert stall_s <= trio.current_time() - started < TIMEOUT_S * 2  # when it landed
        assert pair.gen.check_gen_transfer_status() == []  # told once, not twice
        assert pair.gen.statistics().receivers == 0
        assert pair.gen.statistics().quarantine_expired == 0


async def test_ctx_answers_a_cancel_at_once_when_nothing_is_in_flight() -> None:
    # Every word of the write is lost (result, notification): gen times out. ctx has nothing in
    # flight any more, so it answers gen's CANCEL at once, and gen frees long before a second
    # timeout.
    faults = {"ctx_faults": "drop:TRANSFER_RESULT:1", "gen_faults": LOST_NOTICE}
    async with open_pair(**faults, timeout_s=TIMEOUT_S) as pair:
        started = trio.current_time()
        _start(pair)
        failed = await outcome_of(pair.gen.check_gen_transfer_status)
        assert failed.blocks_held
        await until(lambda: pair.gen.cancel_request(KEY), "ctx's answer", TIMEOUT_S)
        assert trio.current_time() - started < TIMEOUT_S * 1.5
        assert pair.ctx_faults.statistics().rules[0].fired == 1  # one result lost, not the answer
        assert pair.gen.statistics().quarantine_expired == 0


async def test_a_silent_ctx_is_given_up_on_after_a_second_timeout() -> None:
    # Every notification and result is lost, answers to CANCEL too.
    faults = {"ctx_faults": "drop:TRANSFER_RESULT", "gen_faults": LOST_NOTICE}
    async with open_pair(**faults, timeout_s=TIMEOUT_S) as pair:
        started = trio.current_time()
        _start(pair)
        assert (await outcome_of(pair.gen.check_gen_transfer_status)).blocks_held
        assert pair.gen.cancel_request(KEY) is False
        await until(lambda: pair.gen.cancel_request(KEY), "second timeout", TIMEOUT_S * 3)
        assert trio.current_time() - started >= TIMEOUT_S * 2 - 0.05
        assert pair.gen.statistics().receivers == 0
        assert pair.gen.statistics().quarantine_expired == 1
