"""generation-first: ctx prepares a write while its prefill runs, and only posts it at the end.

Two KvTransceivers in one trio run (real ZMQ, loopback agent). gen asks first; ctx holds the
REQUEST_DATA; `prepare_send` says where the KV will be. The write is then prepared (nothing
copied yet) and posted by `respond_and_send_async`. A prepared write is never posted for another
source, and every prepared handle goes back to the agent whatever ends the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

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


async def _prepared_early(pair: Pair, key: int, dst: list[int]) -> None:
    """A pair that met, where gen asked for `key` first and ctx prepared its write from blocks
    4-6 (the prefill's last step runs)."""
    assert (await pair.transfer(1, [0], [0], num_tokens=TPB)).ok
    await _ask_early(pair, key, dst)
    pair.ctx.prepare_send(key, [[4, 5, 6]], NUM_TOKENS)
    assert pair.ctx_agent.num_handles == 1


async def test_a_prepared_write_is_posted_only_when_the_kv_is_ready(pair: Pair) -> None:
    key, src, dst = 2**41 + 3, [3, 4, 5], [5, 6, 7]
    assert (await pair.transfer(1, [0], [0], num_tokens=TPB)).ok
    await _ask_early(pair, key, dst)
    pair.ctx.prepare_send(key, [src], NUM_TOKENS)
    assert pair.ctx.statistics().prepared == 1
    assert pair.gen_blocks(dst) == bytes(len(dst) * BLOCK_BYTES)  # prepared, not written

    pair.ctx.respond_and_send_async(key, [src], NUM_TOKENS, first_tokens=(42,))
    outcome = await outcome_of(pair.gen.check_gen_transfer_status)
    assert outcome.ok and outcome.first_tokens == (42,)
    assert pair.gen_blocks(dst) == pair.ctx_blocks(src)
    assert (await outcome_of(pair.ctx.check_context_transfer_status)).ok
    stats = pair.ctx.statistics()
    assert (stats.prepared, stats.prepared_posts, stats.early) == (0, 1, 0)
    await until(lambda: pair.ctx_agent.num_handles == 0, "every handle released")


async def test_gen_finishes_on_the_notice_alone_which_carries_what_the_post_knew() -> None:
    # ctx's TRANSFER_RESULT never reaches gen: the notification, replaced at the post, says
    # what the write moved and the first tokens, which the preparation did not know.
    plain = lambda agent, _faults: agent  # noqa: E731 -- ctx's agent prepares writes
    async with open_pair(ctx_faults="drop:TRANSFER_RESULT", ctx_agent=plain) as pair:
        key, src, dst = 2**41 + 5, [4, 5, 6], [1, 2, 3]
        await _prepared_early(pair, key, dst)
        pair.ctx.respond_and_send_async(key, [src], NUM_TOKENS, first_tokens=(7, 9))
        outcome = await outcome_of(pair.gen.check_gen_transfer_status)
        assert outcome.ok and outcome.first_tokens == (7, 9)
        assert outcome.num_bytes == len(src) * BLOCK_BYTES and outcome.num_descriptors == 1
        assert pair.gen_blocks(dst) == pair.ctx_blocks(src)
        assert pair.ctx.statistics().prepared_posts == 1
        assert pair.ctx_faults.statistics().rules[0].fired >= 1


async def test_a_write_prepared_for_other_blocks_is_dropped_not_posted(pair: Pair) -> None:
    key, dst = 2**41 + 4, [1, 2, 3]
    assert (await pair.transfer(1, [0], [0], num_tokens=TPB)).ok
    await _ask_early(pair, key, dst)
    pair.ctx.prepare_send(key, [[0, 1, 2]], NUM_TOKENS)  # then preempted, prefilled elsewhere
    pair.ctx.prepare_send(key, [[4, 5, 6]], NUM_TOKENS)
    assert pair.ctx.statistics().prepared == 1
    pair.ctx.respond_and_send_async(key, [[5, 6, 7]], NUM_TOKENS)  # and elsewhere again
    assert (await outcome_of(pair.gen.check_gen_transfer_status)).ok
    assert pair.gen_blocks(dst) == pair.ctx_blocks([5, 6, 7])
    await outcome_of(pair.ctx.check_context_transfer_status)
    assert pair.ctx.statistics().prepared_posts == 0
    await until(lambda: pair.ctx_agent.num_handles == 0, "every handle released")


async def test_a_prepared_write_is_released_when_gen_cancels(pair: Pair) -> None:
    key, dst = 2**41 + 5, [1, 2, 3]
    await _prepared_early(pair, key, dst)
    pair.gen.cancel_request(key)  # gen's CANCEL reaches ctx before its KV is ready
    await until(lambda: pair.ctx.statistics().prepared == 0, "the preparation dropped")
    await until(lambda: pair.ctx_agent.num_handles == 0, "its handle released")
    pair.ctx.respond_and_send_async(key, [[4, 5, 6]], NUM_TOKENS)
    assert not (await outcome_of(pair.ctx.check_context_transfer_status)).ok
    assert pair.gen_blocks(dst) == bytes(len(dst) * BLOCK_BYTES)  # nothing was ever written
    assert pair.ctx.statistics().prepared_posts == 0


async def test_a_preparation_whose_kv_never_comes_is_released_by_ctx(pair: Pair) -> None:
    key = 2**41 + 6
    await _prepared_early(pair, key, [1, 2, 3])
    assert pair.ctx.cancel_request(key) is True  # ctx's request ended (aborted) before its KV
    assert pair.ctx.statistics().prepared == 0
    await until(lambda: pair.ctx_agent.num_handles == 0, "its handle released")


async def test_a_ctx_request_that_ends_without_its_kv_refuses_gen_at_once(pair: Pair) -> None:
    # gen asked first (generation_first); ctx's request is then aborted during its prefill.
    # gen is refused with the reason now, not at its 30 s deadline, and nothing is written.
    key, dst = 2**41 + 8, [1, 2, 3]
    await _prepared_early(pair, key, dst)
    pair.ctx.abandon_send(key, "it was aborted")
    outcome = await outcome_of(pair.gen.check_gen_transfer_status)  # within 5 s; deadline 30 s
    assert not outcome.ok and "ctx request ended before its KV was ready: it was aborted" in (
        outcome.error or ""
    )
    stats = pair.ctx.statistics()
    assert (stats.early, stats.prepared, stats.senders) == (0, 0, 0)
    await until(lambda: pair.ctx_agent.num_handles == 0, "the preparation released")
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
        for key in (1, 2):  # context-first, then generation-first with a prepared write
            if key == 1:
                outcome = await pair.transfer(key, [1, 2, 3], [4, 5, 6])
            else:
                await _ask_early(pair, key, [5, 6, 7])
                pair.ctx.prepare_send(key, [[2, 3, 4]], NUM_TOKENS)
                pair.ctx.respond_and_send_async(key, [[2, 3, 4]], NUM_TOKENS, first_tokens=(3,))
                outcome = await outcome_of(pair.gen.check_gen_transfer_status)
            assert outcome.ok and outcome.num_descriptors == 1
        assert pair.gen_blocks([5, 6, 7]) == pair.ctx_blocks([2, 3, 4])
        assert pair.count(2, "gen", "notice") == 1 and pair.count(2, "ctx", "posted") == 1
