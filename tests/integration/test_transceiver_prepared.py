"""generation-first: ctx prepares a write while its prefill runs, and only posts it at the end.

Two KvTransceivers in one trio run (real ZMQ, loopback agent). gen asks first; ctx holds the
REQUEST_DATA; `prepare_send` says where the KV will be. The write is then prepared (nothing
copied yet) and posted by `respond_and_send_async`. A prepared write is never posted for another
source, and every prepared handle goes back to the agent whatever ends the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import numpy as np
import pytest
import trio

from tests.transceivers import HEAD_DIM, HEADS, LAYERS, NUM_SLOTS, TPB, rank_info
from trtdisagg.faults.spec import FaultInjector, parse_faults
from trtdisagg.transfer.runtime.agents.loopback import LoopbackAgent, LoopbackFabric
from trtdisagg.transfer.runtime.messenger import open_router
from trtdisagg.transfer.transceiver import KvTransceiver, TransferOutcome

BLOCK_BYTES = LAYERS * 2 * HEADS * TPB * HEAD_DIM * 4
NUM_TOKENS = 3 * TPB - 1


def blocks_of(memory: np.ndarray, blocks: list[int]) -> bytes:
    """The bytes of `blocks` of a pool laid out as BLOCK_BYTES per block."""
    return b"".join(memory[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES].tobytes() for b in blocks)


@attrs.define
class Pair:
    ctx: KvTransceiver
    gen: KvTransceiver
    ctx_agent: LoopbackAgent
    gen_agent: LoopbackAgent
    ctx_memory: np.ndarray
    gen_memory: np.ndarray

    def gen_blocks(self, blocks: list[int]) -> bytes:
        return blocks_of(self.gen_memory, blocks)

    def ctx_blocks(self, blocks: list[int]) -> bytes:
        return blocks_of(self.ctx_memory, blocks)


async def _until(predicate: Any, what: str) -> None:
    """Wait for state another task changes, bounded in time."""
    with trio.fail_after(
        5,
    ):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.001)


async def _outcome(check: Any) -> TransferOutcome:
    outcomes: list[TransferOutcome] = []
    await _until(lambda: outcomes.extend(check()) or outcomes, "an outcome")
    (outcome,) = outcomes
    return outcome


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    async with _open_pair() as opened:
        yield opened


@asynccontextmanager
async def _open_pair(
    ctx_faults: str | None = None,
    *,
    request_notices: bool = False,
    gen_faults: str | None = None,
    notify_on_poll: bool = False,
    gen_wake: Callable[[], None] = lambda: None,
) -> AsyncIterator[Pair]:
    """ctx and gen transceivers in this trio run; ctx's control messages follow `ctx_faults`
    (its agent stays the plain loopback one, which prepares writes), gen's `gen_faults`.
    `request_notices`: ctx takes REQUEST_DATA as an agent notification too. `notify_on_poll`:
    ctx's agent sends a write's notification from the poll that finds it done (as NIXL's).
    `gen_wake`: what gen's transceiver calls to wake its executor."""
    faults = FaultInjector(plan=parse_faults(ctx_faults)) if ctx_faults else None
    faults_at_gen = FaultInjector(plan=parse_faults(gen_faults)) if gen_faults else None
    fabric = LoopbackFabric()
    ctx_agent = LoopbackAgent("ctx-agent", fabric=fabric, notify_on_poll=notify_on_poll)
    gen_agent = LoopbackAgent("gen-agent", fabric=fabric)
    ctx_memory = np.random.default_rng(5).integers(0, 255, NUM_SLOTS * BLOCK_BYTES, np.uint8)
    gen_memory = np.zeros(NUM_SLOTS * BLOCK_BYTES, np.uint8)
    async with (
        open_router() as ctx_router,
        open_router() as gen_router,
        trio.open_nursery() as nursery,
    ):

        def service(info: Any, agent: LoopbackAgent, router: Any) -> KvTransceiver:
            return KvTransceiver(
                local=info, instance=(info,), agent=agent, router=router, timeout_s=30,
                wake=gen_wake if agent is gen_agent else lambda: None,
                faults=faults if agent is ctx_agent else faults_at_gen,
            )  # fmt: skip

        ctx_info = rank_info("ctx", ctx_memory, ctx_agent, ctx_router.endpoint)
        ctx = service(
            attrs.evolve(ctx_info, request_notices=request_notices), ctx_agent, ctx_router
        )
        gen = service(
            rank_info("gen", gen_memory, gen_agent, gen_router.endpoint), gen_agent, gen_router
        )
        await nursery.start(ctx.run)
        await nursery.start(gen.run)
        yield Pair(ctx, gen, ctx_agent, gen_agent, ctx_memory, gen_memory)
        nursery.cancel_scope.cancel()


async def _ask_early(pair: Pair, key: int, blocks: list[int]) -> None:
    """gen asks before ctx has a session for `key`; returns once ctx holds the request."""
    pair.gen.request_and_receive_async(key, pair.ctx.info_endpoint, [blocks], NUM_TOKENS)
    await _until(lambda: pair.ctx.statistics().early == 1, "ctx holding the early request")


async def _connect(pair: Pair) -> None:
    """One whole transfer, so that ctx has written to gen before: only writes to a peer
    written to before are prepared (its connection is up, so preparing is quick)."""
    pair.ctx.respond_and_send_async(1, [[0]], TPB)
    pair.gen.request_and_receive_async(1, pair.ctx.info_endpoint, [[0]], TPB)
    assert (await _outcome(pair.gen.check_gen_transfer_status)).ok
    assert (await _outcome(pair.ctx.check_context_transfer_status)).ok


async def _prepared_early(pair: Pair, key: int, dst: list[int]) -> None:
    """A connected pair where gen asked for `key` first and ctx prepared its write from blocks
    4-6 (the prefill's last step runs)."""
    await _connect(pair)
    await _ask_early(pair, key, dst)
    pair.ctx.prepare_send(key, [[4, 5, 6]], NUM_TOKENS)
    assert pair.ctx_agent.num_handles == 1


async def test_a_prepared_write_is_posted_only_when_the_kv_is_ready(pair: Pair) -> None:
    await _connect(pair)

    key, src, dst = 2**41 + 3, [3, 4, 5], [5, 6, 7]
    await _ask_early(pair, key, dst)
    pair.ctx.prepare_send(key, [src], NUM_TOKENS)
    assert pair.ctx.statistics().prepared == 1
    assert pair.gen_blocks(dst) == bytes(len(dst) * BLOCK_BYTES)  # prepared, not written

    pair.ctx.respond_and_send_async(key, [src], NUM_TOKENS, first_tokens=(42,))
    outcome = await _outcome(pair.gen.check_gen_transfer_status)
    assert outcome.ok and outcome.first_tokens == (42,)
    assert pair.gen_blocks(dst) == pair.ctx_blocks(src)
    assert (await _outcome(pair.ctx.check_context_transfer_status)).ok
    stats = pair.ctx.statistics()
    assert (stats.prepared, stats.prepared_posts, stats.early) == (0, 1, 0)
    await _until(lambda: pair.ctx_agent.num_handles == 0, "every handle released")


async def test_gen_finishes_on_the_notice_alone_which_carries_what_the_post_knew() -> None:
    # ctx's WRITE_POSTED and TRANSFER_RESULT never reach gen: the notification, replaced at the
    # post, says what the write moved and the first tokens, which the preparation did not know.
    async with _open_pair("drop:WRITE_POSTED;drop:TRANSFER_RESULT") as pair:
        key, src, dst = 2**41 + 5, [4, 5, 6], [1, 2, 3]
        await _prepared_early(pair, key, dst)
        pair.ctx.respond_and_send_async(key, [src], NUM_TOKENS, first_tokens=(7, 9))
        outcome = await _outcome(pair.gen.check_gen_transfer_status)
        assert outcome.ok and outcome.first_tokens == (7, 9)
        assert outcome.num_bytes == len(src) * BLOCK_BYTES and outcome.num_descriptors == 1
        assert pair.gen_blocks(dst) == pair.ctx_blocks(src)
        assert pair.ctx.statistics().prepared_posts == 1


async def test_a_write_prepared_for_other_blocks_is_dropped_not_posted(pair: Pair) -> None:
    await _connect(pair)

    key, dst = 2**41 + 4, [1, 2, 3]
    await _ask_early(pair, key, dst)
    pair.ctx.prepare_send(key, [[0, 1, 2]], NUM_TOKENS)  # then preempted, prefilled elsewhere
    pair.ctx.prepare_send(key, [[4, 5, 6]], NUM_TOKENS)
    assert pair.ctx.statistics().prepared == 1
    pair.ctx.respond_and_send_async(key, [[5, 6, 7]], NUM_TOKENS)  # and elsewhere again
    assert (await _outcome(pair.gen.check_gen_transfer_status)).ok
    assert pair.gen_blocks(dst) == pair.ctx_blocks([5, 6, 7])
    await _outcome(pair.ctx.check_context_transfer_status)
    assert pair.ctx.statistics().prepared_posts == 0
    await _until(lambda: pair.ctx_agent.num_handles == 0, "every handle released")


async def test_a_prepared_write_is_released_when_gen_cancels(pair: Pair) -> None:
    key, dst = 2**41 + 5, [1, 2, 3]
    await _prepared_early(pair, key, dst)
    pair.gen.cancel_request(key)  # gen's CANCEL reaches ctx before its KV is ready
    await _until(lambda: pair.ctx.statistics().prepared == 0, "the preparation dropped")
    await _until(lambda: pair.ctx_agent.num_handles == 0, "its handle released")
    pair.ctx.respond_and_send_async(key, [[4, 5, 6]], NUM_TOKENS)
    assert not (await _outcome(pair.ctx.check_context_transfer_status)).ok
    assert pair.gen_blocks(dst) == bytes(len(dst) * BLOCK_BYTES)  # nothing was ever written
    assert pair.ctx.statistics().prepared_posts == 0


async def test_a_preparation_whose_kv_never_comes_is_released_by_ctx(pair: Pair) -> None:
    key = 2**41 + 6
    await _prepared_early(pair, key, [1, 2, 3])
    assert pair.ctx.cancel_request(key) is True  # ctx's request ended (aborted) before its KV
    assert pair.ctx.statistics().prepared == 0
    await _until(lambda: pair.ctx_agent.num_handles == 0, "its handle released")


async def test_a_ctx_request_that_ends_without_its_kv_refuses_gen_at_once(pair: Pair) -> None:
    # gen asked first (generation_first); ctx's request is then aborted during its prefill.
    # gen is refused with the reason now, not at its 30 s deadline, and nothing is written.
    key, dst = 2**41 + 8, [1, 2, 3]
    await _prepared_early(pair, key, dst)
    pair.ctx.abandon_send(key, "it was aborted")
    outcome = await _outcome(pair.gen.check_gen_transfer_status)  # within 5 s; deadline 30 s
    assert not outcome.ok and "ctx request ended before its KV was ready: it was aborted" in (
        outcome.error or ""
    )
    stats = pair.ctx.statistics()
    assert (stats.early, stats.prepared, stats.senders) == (0, 0, 0)
    await _until(lambda: pair.ctx_agent.num_handles == 0, "the preparation released")
    assert pair.gen_blocks(dst) == bytes(len(dst) * BLOCK_BYTES)


async def test_abandoning_a_request_that_already_responded_changes_nothing(pair: Pair) -> None:
    key, src, dst = 2**41 + 9, [3, 4, 5], [5, 6, 7]
    pair.ctx.respond_and_send_async(key, [src], NUM_TOKENS)
    pair.ctx.abandon_send(key, "too late to matter")  # the session owns the key now
    pair.gen.request_and_receive_async(key, pair.ctx.info_endpoint, [dst], NUM_TOKENS)
    assert (await _outcome(pair.gen.check_gen_transfer_status)).ok
    assert pair.gen_blocks(dst) == pair.ctx_blocks(src)
