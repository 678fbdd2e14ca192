"""A ctx restarted on the same control endpoint is met again, never taken for its old self.

Two KvTransceivers in one trio run (real ZMQ, loopback agent). The first ctx instance serves a
transfer and goes away; a new instance (a new name, new memory) binds the very same endpoint.
gen's cached rendezvous names the old instance, which no longer knows gen: the second request
succeeds only because gen is told which instance answered (ctx's opaque state) and meets the
endpoint again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import trio
import zmq

from tests.procs import free_port
from tests.transceivers import BLOCK_BYTES, NUM_SLOTS, TPB, rank_info
from trtdisagg.transfer.protocol.sessions import TransferOutcome
from trtdisagg.transfer.runtime.agents.loopback import LoopbackAgent, LoopbackFabric
from trtdisagg.transfer.runtime.driver import KvTransceiver
from trtdisagg.transfer.runtime.messenger import Router, open_router

NUM_TOKENS = 2 * TPB


def _transceiver(
    name: str, memory: np.ndarray, fabric: LoopbackFabric, router: Router
) -> KvTransceiver:
    agent = LoopbackAgent(f"{name}-agent", fabric=fabric)
    info = rank_info(name, memory, agent, router.endpoint)
    return KvTransceiver(
        local=info, instance=(info,), agent=agent, router=router, timeout_s=10, wake=lambda: None
    )


async def _outcome(check: Callable[[], list[TransferOutcome]], key: int) -> TransferOutcome:
    with trio.fail_after(10):
        while True:
            for outcome in check():
                if outcome.key == key:
                    return outcome
            await trio.sleep(0.001)


async def _bind(stack: contextlib.AsyncExitStack, bind: str) -> Router:
    """A ROUTER at `bind`. zmq releases a closed socket's port on its I/O thread a moment
    later, so binding the same port again is retried until it is free (bounded)."""
    # (A deadline, not fail_after: the router's nursery must not open inside a scope we leave.)
    deadline = trio.current_time() + 5
    while True:
        try:
            return await stack.enter_async_context(open_router(bind))
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or trio.current_time() > deadline:
                raise
        await trio.sleep(0.01)  # polling an observable condition (the port), bounded above


def _block(memory: np.ndarray, block: int) -> np.ndarray:
    return memory[block * BLOCK_BYTES : (block + 1) * BLOCK_BYTES]


async def test_a_new_ctx_instance_on_the_old_endpoint_is_met_again() -> None:
    fabric = LoopbackFabric()
    rng = np.random.default_rng(1)
    gen_memory = np.zeros(NUM_SLOTS * BLOCK_BYTES, np.uint8)
    async with open_router() as gen_router, trio.open_nursery() as nursery:
        gen = _transceiver("gen", gen_memory, fabric, gen_router)
        await nursery.start(gen.run)

        async def serve_once(name: str, bind: str, key: int, dst: list[int]) -> str:
            """One ctx instance at `bind`: answer one transfer of blocks 1-2, then go away."""
            memory = rng.integers(0, 255, NUM_SLOTS * BLOCK_BYTES, np.uint8)
            async with contextlib.AsyncExitStack() as stack:
                router = await _bind(stack, bind)
                ctx_nursery = await stack.enter_async_context(trio.open_nursery())
                ctx = _transceiver(name, memory, fabric, router)
                await ctx_nursery.start(ctx.run)
                ctx.respond_and_send_async(key, [[1, 2]], NUM_TOKENS)
                gen.request_and_receive_async(
                    key, router.endpoint, [dst], NUM_TOKENS, ctx_instance=ctx.local.instance_name
                )
                got = await _outcome(gen.check_gen_transfer_status, key)
                assert got.ok, got.error
                sent = await _outcome(ctx.check_context_transfer_status, key)
                assert sent.ok, sent.error
                for src_block, dst_block in zip([1, 2], dst, strict=True):
                    assert np.array_equal(_block(gen_memory, dst_block), _block(memory, src_block))
                ctx_nursery.cancel_scope.cancel()
            return router.endpoint

        first = f"tcp://127.0.0.1:{free_port()}"  # re-bound by the second ctx
        endpoint = await serve_once("ctx-first", first, key=11, dst=[3, 4])
        assert gen.statistics().rendezvous == 1
        # Same endpoint, new instance: without the name check gen would send REQUEST_DATA on the
        # dead registration, the new ctx would drop it, and the transfer would time out.
        assert await serve_once("ctx-second", endpoint, key=12, dst=[5, 6]) == endpoint
        assert gen.statistics().rendezvous == 2
        assert not gen.agent.remotes  # type: ignore[attr-defined]  # gen loads no ctx agent
        nursery.cancel_scope.cancel()


async def test_a_burst_of_first_requests_to_a_new_ctx_shares_one_rendezvous() -> None:
    """peers.md, pain point 21: the first requests to a ctx arrive together (a cold start, a
    new ctx joining under load). They must wait on one handshake, not run one each."""
    fabric = LoopbackFabric()
    memory = np.random.default_rng(2).integers(0, 255, NUM_SLOTS * BLOCK_BYTES, np.uint8)
    gen_memory = np.zeros(NUM_SLOTS * BLOCK_BYTES, np.uint8)
    burst = NUM_SLOTS // 2  # one block each way per request
    async with (
        open_router() as ctx_router,
        open_router() as gen_router,
        trio.open_nursery() as nursery,
    ):
        ctx = _transceiver("ctx-burst", memory, fabric, ctx_router)
        gen = _transceiver("gen-burst", gen_memory, fabric, gen_router)
        await nursery.start(ctx.run)
        await nursery.start(gen.run)
        for i in range(burst):  # all asked before the first rendezvous can answer
            ctx.respond_and_send_async(100 + i, [[i]], TPB)
            gen.request_and_receive_async(
                100 + i, ctx_router.endpoint, [[burst + i]], TPB,
                ctx_instance=ctx.local.instance_name,
            )  # fmt: skip
        outcomes: dict[int, TransferOutcome] = {}
        with trio.fail_after(10):
            while len(outcomes) < burst:  # each check hands its outcomes over once
                outcomes.update((o.key, o) for o in gen.check_gen_transfer_status())
                await trio.sleep(0.001)
        for i in range(burst):
            assert outcomes[100 + i].ok, outcomes[100 + i].error
            assert np.array_equal(_block(gen_memory, burst + i), _block(memory, i))
        assert gen.statistics().rendezvous == 1
        nursery.cancel_scope.cancel()
