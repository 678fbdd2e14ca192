"""A transfer key (disagg_request_id) used again: nothing of an earlier use reaches a later one.

Clients choose disagg_request_id, and workers refuse a key only while another request of theirs
holds it, so one key may be used again as soon as its last use ended. The control messages of a
transfer name nothing but the key and the sending rank: a REQUEST_DATA, CANCEL or TRANSFER_RESULT
of an earlier use that arrives late reads like one of the current use. ctx holds a REQUEST_DATA
that finds no session (EarlyMessages) and gives it to the next session of its key; gen's session
takes any result from its ctx rank. Were an earlier use's message taken for a later one's, ctx
would write the new KV into blocks that gen freed (and gave to another request), and gen would
call its new request done with its own blocks never written: silent KV corruption.

Two KvTransceivers in one trio run (real ZMQ, loopback agent), as in
test_transceiver_generation_first.py. The fault injector reorders or holds back the message at
issue; ctx's clock, set ahead, ages what ctx holds without waiting for it. What must hold,
whatever the order: blocks of a request that ended are never written again, and a later use of
the key either gets exactly its own KV (and first tokens) in its own blocks or fails.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from tests.transceivers import (
    NUM_TOKENS,
    TPB,
    AheadClock,
    Pair,
    open_pair,
    outcome_of,
    until,
)
from trtdisagg.transfer.protocol.sessions import TransferOutcome
from trtdisagg.transfer.protocol.wire import unpack_block_ids

TIMEOUT_S = 1.0  # both sides; also how long ctx holds a REQUEST_DATA that found no session
HELD_BACK_S = 0.3  # a message held back by a `delay` fault; far below TIMEOUT_S
KEY = 2**43 + 11
# gen's blocks of the first use (A) and of the second (B); ctx's sources, each its own KV.
GEN_A, GEN_B = [1, 2, 3], [4, 5, 6]
SRC_1, SRC_2, SRC_OTHER = [1, 2, 3], [4, 5, 6], [5, 6, 7]


@asynccontextmanager
async def _open_pair(timeout_s: float = TIMEOUT_S) -> AsyncIterator[tuple[Pair, AheadClock]]:
    """ctx and gen, each with a fault injector armed with no rule (`Pair.arm` gives them
    some); ctx's clock can be set ahead. They have met, and their dealers are open."""
    clock = AheadClock()
    async with open_pair(
        ctx_faults="none", gen_faults="none", timeout_s=timeout_s, ctx_clock=clock
    ) as pair:
        await _transfer(pair, 1, [0], [0], num_tokens=TPB)
        yield pair, clock


async def _transfer(
    pair: Pair, key: int, src: list[int], dst: list[int], *, num_tokens: int = NUM_TOKENS
) -> None:
    """One clean transfer (context_first), exact, both sides done, and every message of it
    in: gen may finish on the write's notification, before ctx's TRANSFER_RESULT comes."""
    outcome = await pair.transfer(key, src, dst, num_tokens)
    assert outcome.ok and outcome.first_tokens == (11,)
    assert pair.gen_blocks(dst) == pair.ctx_blocks(src)
    await until(lambda: _results(pair, key) == 1, "ctx's TRANSFER_RESULT")


def _results(pair: Pair, key: int) -> int:
    """TRANSFER_RESULTs of `key` that gen has received (since the pair opened)."""
    return pair.count(key, "gen", "result")


def _requests(pair: Pair, key: int) -> int:
    """REQUEST_DATAs of `key` that ctx has received, whatever it made of them."""
    return pair.count(key, "ctx", "received")


def _held_at_ctx(pair: Pair, blocks: list[int]) -> bool:
    """ctx holds a REQUEST_DATA of KEY into gen's `blocks` (no session took it yet)."""
    return any(
        unpack_block_ids(request.block_ids[0]) == tuple(blocks)
        for _, request in pair.ctx.protocol.ctx.early.requests.get(KEY, [])
    )


def _cancel_held(pair: Pair) -> bool:
    return KEY in pair.ctx.protocol.ctx.early.cancelled


def _ask(pair: Pair, blocks: list[int]) -> None:
    pair.gen.request_and_receive_async(KEY, pair.ctx.info_endpoint, [blocks], NUM_TOKENS)


def _settled(pair: Pair) -> bool:
    """Neither side has a session left (every write ended and was reported)."""
    pair.ctx.check_context_transfer_status()
    pair.gen.check_gen_transfer_status()
    return not pair.ctx.statistics().senders and not pair.gen.statistics().receivers


def _safe(pair: Pair, outcome: TransferOutcome, freed: bytes) -> list[str]:
    """What went wrong with the second use of KEY (into GEN_B from SRC_2), given what the
    first use's blocks GEN_A hold since they were freed and given to another request."""
    problems = []
    if pair.gen_blocks(GEN_A) != freed:
        wrote = "the new KV" if pair.gen_blocks(GEN_A) == pair.ctx_blocks(SRC_2) else "something"
        problems.append(f"{wrote} was written into blocks {GEN_A}, freed by KEY's first use")
    if outcome.ok and pair.gen_blocks(GEN_B) != pair.ctx_blocks(SRC_2):
        problems.append(f"the second use reported ok but its blocks {GEN_B} lack its KV")
    if not outcome.ok and not (outcome.error or outcome.cancelled):
        problems.append(f"the second use failed without saying why: {outcome}")
    return problems


@pytest.mark.parametrize("order", ["context_first", "generation_first"])
async def test_a_key_used_again_after_a_clean_transfer_gets_its_own_kv(order: str) -> None:
    async with _open_pair() as (pair, _):
        await _transfer(pair, KEY, SRC_1, GEN_A)
        other = pair.fill_gen_blocks(GEN_A, 0x5A)  # freed, and another request's now

        if order == "context_first":
            pair.ctx.respond_and_send_async(KEY, [SRC_2], NUM_TOKENS, first_tokens=(22,))
            _ask(pair, GEN_B)
        else:
            _ask(pair, GEN_B)
            await until(lambda: _held_at_ctx(pair, GEN_B), "ctx holding the request")
            pair.ctx.respond_and_send_async(KEY, [SRC_2], NUM_TOKENS, first_tokens=(22,))
        outcome = await outcome_of(pair.gen.check_gen_transfer_status)
        assert outcome.ok and outcome.first_tokens == (22,)
        assert pair.gen_blocks(GEN_B) == pair.ctx_blocks(SRC_2)
        assert (await outcome_of(pair.ctx.check_context_transfer_status)).ok
        assert pair.gen_blocks(GEN_A) == other
        assert pair.ctx.statistics().early == 0


@pytest.mark.parametrize("first_use_on_ctx", ["responds", "ended_before"])
async def test_a_key_used_again_after_a_cancelled_generation_first_request(
    first_use_on_ctx: str,
) -> None:
    # gen asks first and cancels: both its REQUEST_DATA and its CANCEL reach ctx before any
    # session of KEY exists there, and ctx holds both. "responds": ctx's first request of KEY
    # then finishes its prefill (its session starts cancelled). "ended_before": that request
    # had ended before gen asked (`abandon_send` found nothing to refuse), so what ctx holds
    # waits for the next session of KEY, which is the second use's.
    async with _open_pair() as (pair, _):
        if first_use_on_ctx == "ended_before":
            pair.ctx.abandon_send(KEY, "aborted")
        _ask(pair, GEN_A)
        await until(lambda: _held_at_ctx(pair, GEN_A), "ctx holding the request")
        pair.gen.cancel_request(KEY)
        await until(lambda: _cancel_held(pair), "ctx holding the cancel")
        first = await outcome_of(pair.gen.check_gen_transfer_status)
        assert first.cancelled
        assert pair.gen.cancel_request(KEY)  # gen frees GEN_A
        if first_use_on_ctx == "responds":
            pair.ctx.respond_and_send_async(KEY, [SRC_1], NUM_TOKENS)
            assert (await outcome_of(pair.ctx.check_context_transfer_status)).cancelled
        freed = pair.fill_gen_blocks(GEN_A, 0x5A)

        _ask(pair, GEN_B)
        await until(lambda: _held_at_ctx(pair, GEN_B), "ctx holding the second request")
        pair.ctx.respond_and_send_async(KEY, [SRC_2], NUM_TOKENS)
        with trio.fail_after(3 * TIMEOUT_S):  # a failure may take gen's timeout
            outcome = await outcome_of(pair.gen.check_gen_transfer_status)
            await until(lambda: _settled(pair), "both sides settled")
        problems = _safe(pair, outcome, freed)
        assert not problems, "; ".join(problems)
        if first_use_on_ctx == "responds":  # nothing of the first use is left to get in the way
            assert outcome.ok and pair.gen_blocks(GEN_B) == pair.ctx_blocks(SRC_2)


async def test_a_late_refusal_of_the_first_use_does_not_end_the_second_that_ctx_holds() -> None:
    # As "ended_before" above, with nothing reordered: ctx holds the first use's request and CANCEL.
    # gen's second use asks, and ctx holds that request too while its second request of KEY
    # prefills, longer than what it held of the first use may wait: ctx then refuses the
    # first use's request (ERROR, "no request with transfer key"). That answer must not
    # end the second use (and free its blocks) while ctx still holds the second use's request
    # and writes it when the prefill ends.
    timeout_s = 2.0  # ctx holds what finds no session this long, and sweeps every second
    async with _open_pair(timeout_s) as (pair, ctx_clock):
        pair.ctx.abandon_send(KEY, "aborted")
        _ask(pair, GEN_A)
        await until(lambda: _held_at_ctx(pair, GEN_A), "ctx holding the request")
        pair.gen.cancel_request(KEY)
        await until(lambda: _cancel_held(pair), "ctx holding the cancel")
        assert (await outcome_of(pair.gen.check_gen_transfer_status)).cancelled
        assert pair.gen.cancel_request(KEY)
        freed_a = pair.fill_gen_blocks(GEN_A, 0x5A)

        ctx_clock.ahead = timeout_s - 0.05  # the first use's messages are about to expire
        _ask(pair, GEN_B)
        await until(lambda: _held_at_ctx(pair, GEN_B), "ctx holding the second request")
        with trio.fail_after(2 * timeout_s):  # ended by a refusal, or by gen's timeout
            second = await outcome_of(pair.gen.check_gen_transfer_status)
            await until(lambda: pair.gen.cancel_request(KEY), "gen freeing the blocks")
        assert not second.ok and (second.error or second.cancelled)
        freed_b = pair.fill_gen_blocks(GEN_B, 0xA5)
        # What ctx held of the first use expires within a sweep of its request's expiry.
        await until(
            lambda: not _cancel_held(pair) or not _held_at_ctx(pair, GEN_B),
            "ctx dropping the first use's cancel",
        )
        pair.ctx.respond_and_send_async(KEY, [SRC_2], NUM_TOKENS)  # the second prefill ends
        await until(lambda: _settled(pair), "both sides settled", 2 * timeout_s)
        assert pair.gen_blocks(GEN_A) == freed_a
        assert pair.gen_blocks(GEN_B) == freed_b, "ctx wrote the second use's freed blocks"


async def test_a_request_overtaken_by_its_cancel_is_not_served_by_the_next_use() -> None:
    # First use, context_first: ctx's session waits; gen's REQUEST_DATA is held back (`delay`:
    # later messages may overtake it), and gen cancels. The CANCEL overtakes the request, and
    # ctx's session, which never had one, takes it: cancelled, and ctx answers at once, so
    # gen's blocks GEN_A are free and go to another request. The request then arrives and
    # finds no session: ctx holds it. The second use of KEY asks for GEN_B and ctx's new
    # session takes what it holds, the stale request first.
    async with _open_pair() as (pair, _):
        pair.arm(gen=f"delay:REQUEST_DATA:{HELD_BACK_S * 1000:g}ms:1")
        pair.ctx.respond_and_send_async(KEY, [SRC_1], NUM_TOKENS)
        _ask(pair, GEN_A)
        pair.gen.cancel_request(KEY)
        assert (await outcome_of(pair.gen.check_gen_transfer_status)).cancelled
        assert pair.gen.cancel_request(KEY)  # ctx answered the CANCEL: nothing can land
        assert (await outcome_of(pair.ctx.check_context_transfer_status)).cancelled
        assert pair.gen_faults.statistics().rules[0].fired == 1
        assert _requests(pair, KEY) == 0, "the request was not overtaken: no test"
        await _transfer(pair, KEY + 1, SRC_OTHER, GEN_A)  # GEN_A: another request's KV
        freed = pair.gen_blocks(GEN_A)
        await until(lambda: _requests(pair, KEY) == 1, "the stale request", 2 * HELD_BACK_S)

        _ask(pair, GEN_B)
        await until(lambda: _held_at_ctx(pair, GEN_B), "ctx holding the second request")
        pair.ctx.respond_and_send_async(KEY, [SRC_2], NUM_TOKENS)
        with trio.fail_after(3 * TIMEOUT_S):
            outcome = await outcome_of(pair.gen.check_gen_transfer_status)
            await until(lambda: _settled(pair), "both sides settled")
        problems = _safe(pair, outcome, freed)
        assert not problems, "; ".join(problems)


@pytest.mark.parametrize("gen_gives_up", [True, False])
async def test_a_late_result_of_the_previous_use_is_not_taken_for_the_next_one(
    gen_gives_up: bool,
) -> None:
    # First use: gen finishes on the write's notification (it says what the write moved), and
    # ctx's TRANSFER_RESULT, held back, comes later, while the second use's write is in flight
    # (stalled). If gen gives up on the second use, its blocks must stay quarantined until
    # that write has ended, not be freed on the first use's result; if not, the second use
    # ends with its own first tokens, not the first use's.
    async with _open_pair() as (pair, _):
        pair.arm(ctx=f"delay:TRANSFER_RESULT:{HELD_BACK_S * 1000:g}ms:1")
        pair.ctx.respond_and_send_async(KEY, [SRC_1], NUM_TOKENS, first_tokens=(11,))
        _ask(pair, GEN_A)
        first = await outcome_of(pair.gen.check_gen_transfer_status)
        assert first.ok and first.first_tokens == (11,)
        assert (await outcome_of(pair.ctx.check_context_transfer_status)).ok
        assert _results(pair, KEY) == 0, "the result was not held back: no test"

        pair.arm(ctx=f"stall_transfer:{TIMEOUT_S / 2:g}s:1")
        pair.ctx.respond_and_send_async(KEY, [SRC_2], NUM_TOKENS, first_tokens=(22,))
        _ask(pair, GEN_B)
        await until(lambda: _results(pair, KEY) == 1, "the first use's result", 2 * HELD_BACK_S)
        assert pair.ctx.statistics().senders == 1 and not pair.ctx.check_context_transfer_status()
        if not gen_gives_up:
            second = await outcome_of(pair.gen.check_gen_transfer_status)
            assert second.ok and pair.gen_blocks(GEN_B) == pair.ctx_blocks(SRC_2)
            assert second.first_tokens == (22,), "the first use's result was taken for this one"
            return

        released_at_once = pair.gen.cancel_request(KEY)  # the second use's write is in flight
        await until(lambda: pair.gen.cancel_request(KEY), "the blocks released", 2 * TIMEOUT_S)
        freed = pair.fill_gen_blocks(GEN_B, 0xA5)  # and another request's
        await until(lambda: _settled(pair), "both sides settled", 2 * TIMEOUT_S)
        assert pair.gen_blocks(GEN_B) == freed, "the second use's write landed in freed blocks"
        assert not released_at_once
