"""gen's quarantine after a failed transfer (real ZMQ, loopback agents with injected faults).

A gen session that times out while a ctx write may still land reports the failure at once, but
its blocks stay quarantined (`cancel_request` False) until ctx has answered: the write's own
result, or ctx's answer to the CANCEL. Only a ctx that stays silent for a second timeout past the
deadline is given up on, and that is counted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import numpy as np
import trio

from tests.transceivers import HEAD_DIM, HEADS, LAYERS, NUM_SLOTS, TPB, rank_info
from trtdisagg.faults.agent import FaultyAgent
from trtdisagg.faults.spec import FaultInjector, parse_faults
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.runtime.agents.base import TransferAgent
from trtdisagg.transfer.runtime.agents.loopback import LoopbackAgent, LoopbackFabric
from trtdisagg.transfer.runtime.messenger import open_router
from trtdisagg.transfer.transceiver import KvTransceiver, TransferOutcome

TIMEOUT_S = 0.5
LOST_NOTICE = "drop:WRITE_NOTICE"  # the notification says what WRITE_POSTED says
KEY, NUM_TOKENS = 2**41 + 3, 3 * TPB - 1


@attrs.frozen
class Pair:
    ctx: KvTransceiver
    gen: KvTransceiver
    ctx_faults: FaultInjector


@asynccontextmanager
async def _pair(ctx_spec: str, gen_spec: str = "none") -> AsyncIterator[Pair]:
    """ctx and gen transceivers in this trio run; ctx's sends and writes follow `ctx_spec`,
    the notifications gen receives `gen_spec`."""
    fabric = LoopbackFabric()
    faults = FaultInjector(plan=parse_faults(ctx_spec))
    ctx_agent = FaultyAgent(LoopbackAgent("ctx-agent", fabric=fabric), faults)
    gen_faults = FaultInjector(plan=parse_faults(gen_spec))
    gen_agent = FaultyAgent(LoopbackAgent("gen-agent", fabric=fabric), gen_faults)
    block_bytes = LAYERS * 2 * HEADS * TPB * HEAD_DIM * 4
    ctx_memory = np.random.default_rng(0).integers(0, 255, NUM_SLOTS * block_bytes, np.uint8)
    gen_memory = np.zeros(NUM_SLOTS * block_bytes, np.uint8)
    async with (
        open_router() as ctx_router,
        open_router() as gen_router,
        trio.open_nursery() as nursery,
    ):
        ctx_info = rank_info("ctx", ctx_memory, ctx_agent, ctx_router.endpoint)
        gen_info = rank_info("gen", gen_memory, gen_agent, gen_router.endpoint)

        def service(info: RankInfo, agent: TransferAgent, router: object) -> KvTransceiver:
            return KvTransceiver(
                local=info, instance=(info,), agent=agent, router=router, timeout_s=TIMEOUT_S,
                wake=lambda: None, faults=faults if agent is ctx_agent else None,
            )  # fmt: skip

        ctx = service(ctx_info, ctx_agent, ctx_router)
        gen = service(gen_info, gen_agent, gen_router)
        await nursery.start(ctx.run)
        await nursery.start(gen.run)
        yield Pair(ctx=ctx, gen=gen, ctx_faults=faults)
        nursery.cancel_scope.cancel()


async def _until(predicate: Callable[[], object], what: str, timeout: float = 5.0) -> None:
    """Poll state that other tasks change, bounded in time."""
    with trio.fail_after(timeout):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.002)


def _start(pair: Pair) -> None:
    pair.ctx.respond_and_send_async(KEY, [[1, 2, 3]], NUM_TOKENS)
    pair.gen.request_and_receive_async(KEY, pair.ctx.info_endpoint, [[4, 5, 6]], NUM_TOKENS)


async def _gen_failure(gen: KvTransceiver) -> TransferOutcome:
    outcomes: list[TransferOutcome] = []
    await _until(lambda: outcomes.extend(gen.check_gen_transfer_status()) or outcomes, "failure")
    (outcome,) = outcomes
    return outcome


async def test_timeout_with_a_write_in_flight_holds_the_blocks_until_it_lands() -> None:
    stall_s = TIMEOUT_S * 1.5  # past the deadline, before a second timeout
    async with _pair(f"stall_transfer:{stall_s}s") as pair:
        started = trio.current_time()
        _start(pair)
        failed = await _gen_failure(pair.gen)
        assert not failed.ok and failed.blocks_held and "timed out" in (failed.error or "")
        assert trio.current_time() - started < TIMEOUT_S * 2  # the request fails on time
        assert pair.gen.cancel_request(KEY) is False  # ctx's write is still in flight
        assert pair.gen.statistics().quarantined == 1
        # gen's CANCEL cancels ctx's session, whose write stays in flight: quarantined too.
        await _until(lambda: pair.ctx.statistics().quarantined == 1, "ctx quarantine")
        await _until(lambda: pair.gen.cancel_request(KEY), "the write's result", TIMEOUT_S)
        assert stall_s <= trio.current_time() - started < TIMEOUT_S * 2  # when it landed
        assert pair.gen.check_gen_transfer_status() == []  # told once, not twice
        assert len(pair.gen.receivers) == 0
        assert pair.gen.statistics().quarantine_expired == 0


async def test_ctx_answers_a_cancel_at_once_when_nothing_is_in_flight() -> None:
    # Every word of the write is lost (announcement, result, notification): gen times out. ctx
    # has nothing in flight any more, so it answers gen's CANCEL at once, and gen frees long
    # before a second timeout.
    async with _pair("drop:WRITE_POSTED:1;drop:TRANSFER_RESULT:1", LOST_NOTICE) as pair:
        started = trio.current_time()
        _start(pair)
        failed = await _gen_failure(pair.gen)
        assert failed.blocks_held
        await _until(lambda: pair.gen.cancel_request(KEY), "ctx's answer", TIMEOUT_S)
        assert trio.current_time() - started < TIMEOUT_S * 1.5
        assert pair.ctx_faults.statistics().rules[1].fired == 1  # one result lost, not the answer
        assert pair.gen.statistics().quarantine_expired == 0


async def test_a_silent_ctx_is_given_up_on_after_a_second_timeout() -> None:
    # Every announcement, notification and result, answers to CANCEL too.
    async with _pair("drop:WRITE_POSTED;drop:TRANSFER_RESULT", LOST_NOTICE) as pair:
        started = trio.current_time()
        _start(pair)
        assert (await _gen_failure(pair.gen)).blocks_held
        assert pair.gen.cancel_request(KEY) is False
        await _until(lambda: pair.gen.cancel_request(KEY), "second timeout", TIMEOUT_S * 3)
        assert trio.current_time() - started >= TIMEOUT_S * 2 - 0.05
        pair.gen.check_gen_transfer_status()
        assert len(pair.gen.receivers) == 0
        assert pair.gen.statistics().quarantine_expired == 1
