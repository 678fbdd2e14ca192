"""generation-first: gen asks for the KV before ctx has it; ctx writes once the KV is ready.

Two KvTransceivers in one trio run (real ZMQ, loopback agent). gen asks first; ctx holds the
REQUEST_DATA until `respond_and_send_async` says the KV is ready, and only then writes. A gen
that cancels, or a ctx request that ends without its KV, ends the wait at once with nothing
written.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from tests.transceivers import (
    BLOCK_BYTES,
    NUM_TOKENS,
    TPB,
    Pair,
    open_pair,
    outcome_of,
    until,
)


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    async with open_pair() as opened:
        yield opened


async def _ask_early(pair: Pair, key: int, blocks: list[int]) -> None:
    """gen asks before ctx has a session for `key`; returns once ctx holds the request."""
    pair.gen.request_and_receive_async(key, pair.ctx.info_endpoint, [blocks], NUM_TOKENS)
    await until(lambda: pair.ctx.statistics().early == 1, "ctx holding the early request")


async def _met_and_asked_early(pair: Pair, key: int, dst: list[int]) -> None:
    """A pair that met (one transfer done), where gen then asked for `key` first."""
    assert (await pair.transfer(1, [0], [0], num_tokens=TPB)).ok
    await _ask_early(pair, key, dst)


async def test_an_early_request_is_written_only_once_the_kv_is_ready(pair: Pair) -> None:
    key, src, dst = 2**41 + 3, [3, 4, 5], [5, 6, 7]
    await _met_and_asked_early(pair, key, dst)
    await trio.sleep(0.05)  # the prefill runs
    assert pair.ctx.statistics().early == 1 and pair.gen.check_gen_transfer_status() == []
    assert pair.gen_blocks(dst) == bytes(len(dst) * BLOCK_BYTES)  # nothing written yet

    pair.ctx.respond_and_send_async(key, [src], NUM_TOKENS, first_tokens=(42,))
    outcome = await outcome_of(pair.gen.check_gen_transfer_status)
    assert outcome.ok and outcome.first_tokens == (42,)
    assert pair.gen_blocks(dst) == pair.ctx_blocks(src)
    assert (await outcome_of(pair.ctx.check_context_transfer_status)).ok
    assert pair.ctx.statistics().early == 0
    await until(lambda: pair.ctx_agent.handles == {}, "every handle released")


async def test_gen_finishes_on_the_notice_alone_which_carries_what_the_write_moved() -> None:
    # ctx's TRANSFER_RESULT never reaches gen: the notification, made when the KV was ready,
    # says what the write moved and carries the first tokens.
    async with open_pair(ctx_faults="drop:TRANSFER_RESULT") as pair:
        key, src, dst = 2**41 + 5, [4, 5, 6], [1, 2, 3]
        await _met_and_asked_early(pair, key, dst)
        pair.ctx.respond_and_send_async(key, [src], NUM_TOKENS, first_tokens=(7, 9))
        outcome = await outcome_of(pair.gen.check_gen_transfer_status)
        assert outcome.ok and outcome.first_tokens == (7, 9)
        assert outcome.num_bytes == len(src) * BLOCK_BYTES and outcome.num_descriptors == 1
        assert pair.gen_blocks(dst) == pair.ctx_blocks(src)
        # gen may finish before ctx sends the result, and ctx's outcome may come before its
        # DEALER takes the result (a send queued behind a full outbox goes out later).
        assert (await outcome_of(pair.ctx.check_context_transfer_status)).ok
        await until(lambda: pair.ctx_faults.statistics().rules[0].fired >= 1, "the result dropped")


async def test_a_gen_cancel_before_the_kv_is_ready_means_nothing_is_written(pair: Pair) -> None:
    key, dst = 2**41 + 5, [1, 2, 3]
    await _met_and_asked_early(pair, key, dst)
    pair.gen.cancel_request(key)  # gen's CANCEL reaches ctx before its KV is ready
    assert (await outcome_of(pair.gen.check_gen_transfer_status)).cancelled
    pair.ctx.respond_and_send_async(key, [[4, 5, 6]], NUM_TOKENS)
    assert not (await outcome_of(pair.ctx.check_context_transfer_status)).ok
    assert pair.gen_blocks(dst) == bytes(len(dst) * BLOCK_BYTES)  # nothing was ever written
    assert pair.count(key, "ctx", "posted") == 0


async def test_a_ctx_request_that_ends_without_its_kv_refuses_gen_at_once(pair: Pair) -> None:
    # gen asked first (generation_first); ctx's request is then aborted during its prefill.
    # gen is refused with the reason now, not at its 30 s deadline, and nothing is written.
    key, dst = 2**41 + 8, [1, 2, 3]
    await _met_and_asked_early(pair, key, dst)
    pair.ctx.abandon_send(key, "it was aborted")
    outcome = await outcome_of(pair.gen.check_gen_transfer_status)  # within 5 s; deadline 30 s
    assert not outcome.ok and "ctx request ended before its KV was ready: it was aborted" in (
        outcome.error or ""
    )
    stats = pair.ctx.statistics()
    assert (stats.early, stats.senders) == (0, 0)
    assert pair.gen_blocks(dst) == bytes(len(dst) * BLOCK_BYTES)


async def test_abandoning_a_request_that_already_responded_changes_nothing(pair: Pair) -> None:
    key, src, dst = 2**41 + 9, [3, 4, 5], [5, 6, 7]
    pair.ctx.respond_and_send_async(key, [src], NUM_TOKENS)
    pair.ctx.abandon_send(key, "too late to matter")  # the session owns the key now
    pair.gen.request_and_receive_async(key, pair.ctx.info_endpoint, [dst], NUM_TOKENS)
    assert (await outcome_of(pair.gen.check_gen_transfer_status)).ok
    assert pair.gen_blocks(dst) == pair.ctx_blocks(src)


async def test_a_write_whose_notice_goes_out_only_when_polled_still_lands() -> None:
    # NIXL's UCX backend sends a GPU write's notification from the poll that finds it done:
    # gen hears of the write only once ctx's pump polls it.
    async with open_pair(notify_on_poll=True) as pair:
        for key in (1, 2):  # context-first, then generation-first
            if key == 1:
                outcome = await pair.transfer(key, [1, 2, 3], [4, 5, 6])
            else:
                await _ask_early(pair, key, [5, 6, 7])
                pair.ctx.respond_and_send_async(key, [[2, 3, 4]], NUM_TOKENS, first_tokens=(3,))
                outcome = await outcome_of(pair.gen.check_gen_transfer_status)
            assert outcome.ok and outcome.num_descriptors == 1
        assert pair.gen_blocks([5, 6, 7]) == pair.ctx_blocks([2, 3, 4])
        assert pair.count(2, "gen", "notice") == 1 and pair.count(2, "ctx", "posted") == 1
