"""Peer instances that are gone are forgotten, and their agents unloaded (transfer/liveness.py).

Two KvTransceivers in one trio run (real ZMQ, loopback agents), each with its own router and
its own cancel scope, so that one side can stop while the other runs on. Probe times are cut to
tens of milliseconds. A peer's loaded agent maps its KV pool on a GPU (UCX cuda_ipc), so a
peer that is gone must not stay loaded.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import numpy as np
import trio

from tests.transceivers import NUM_SLOTS, outcome_of, rank_info, until
from trtdisagg.transfer.protocol.liveness import Gone, PeerLiveness
from trtdisagg.transfer.protocol.sessions import TransferOutcome
from trtdisagg.transfer.protocol.wire import NOT_REGISTERED
from trtdisagg.transfer.runtime.agents.loopback import LoopbackAgent, LoopbackFabric
from trtdisagg.transfer.runtime.driver import KvTransceiver
from trtdisagg.transfer.runtime.messenger import open_router

BLOCK_BYTES = 2 * 2 * 2 * 4 * 8 * 4  # LAYERS x K/V x HEADS x TPB x HEAD_DIM x float32
NUM_TOKENS = 4 * 3 - 1
SRC, DST = [4, 5, 6], [1, 2, 3]
CHURN = 10


def _liveness() -> PeerLiveness:
    return PeerLiveness(idle_s=0.05, answer_s=0.05, misses=2)


def _links_only() -> PeerLiveness:
    """No probe within the test: only a dropped connection can say a peer is gone."""
    return PeerLiveness(idle_s=60, answer_s=60, misses=3, relink_s=0.2)


def _refusals_only() -> PeerLiveness:
    """Probes go out at once, but none is ever missed within the test: only a connection that
    drops, or cannot be made, can say a peer is gone."""
    return PeerLiveness(idle_s=0.05, answer_s=60, misses=3, relink_s=0.2)


@attrs.define
class Side:
    transceiver: KvTransceiver
    agent: LoopbackAgent
    memory: np.ndarray
    scope: trio.CancelScope
    stopped: trio.Event

    def blocks(self, ids: list[int]) -> bytes:
        return b"".join(self.memory[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES].tobytes() for b in ids)

    async def stop(self) -> None:
        """Gone: its transceiver stops and its router closes (probes go unanswered)."""
        self.scope.cancel()
        with trio.fail_after(5):
            await self.stopped.wait()


async def _run_side(
    name: str,
    fabric: LoopbackFabric,
    memory: np.ndarray,
    *,
    liveness: Callable[[], PeerLiveness],
    task_status: trio.TaskStatus[Side],
) -> None:
    agent = LoopbackAgent(f"{name}-agent", fabric=fabric)
    stopped = trio.Event()
    try:
        with trio.CancelScope() as scope:
            async with open_router() as router, trio.open_nursery() as nursery:
                info = rank_info(name, memory, agent, router.endpoint)
                transceiver = KvTransceiver(
                    local=info, instance=(info,), agent=agent, router=router, timeout_s=5,
                    wake=lambda: None, liveness=liveness(),
                )  # fmt: skip
                await nursery.start(transceiver.run)
                task_status.started(Side(transceiver, agent, memory, scope, stopped))
                await trio.sleep_forever()
    finally:
        fabric.detach(agent.name)
        stopped.set()


@asynccontextmanager
async def _pair(
    *, liveness: Callable[[], PeerLiveness] = _liveness
) -> AsyncIterator[tuple[Side, Side]]:
    fabric = LoopbackFabric()
    ctx_memory = np.random.default_rng(3).integers(0, 255, NUM_SLOTS * BLOCK_BYTES, np.uint8)
    gen_memory = np.zeros(NUM_SLOTS * BLOCK_BYTES, np.uint8)
    async with trio.open_nursery() as nursery:
        ctx: Side = await nursery.start(_run_side_kw, "ctx", fabric, ctx_memory, liveness)
        gen: Side = await nursery.start(_run_side_kw, "gen", fabric, gen_memory, liveness)
        yield ctx, gen
        nursery.cancel_scope.cancel()


async def _run_side_kw(
    name: str,
    fabric: LoopbackFabric,
    memory: np.ndarray,
    liveness: Callable[[], PeerLiveness],
    *,
    task_status: trio.TaskStatus[Side] = trio.TASK_STATUS_IGNORED,
) -> None:
    await _run_side(name, fabric, memory, liveness=liveness, task_status=task_status)


async def _transfer(ctx: Side, gen: Side, key: int) -> TransferOutcome:
    ctx.transceiver.respond_and_send_async(key, [SRC], NUM_TOKENS)
    gen.transceiver.request_and_receive_async(key, ctx.transceiver.info_endpoint, [DST], NUM_TOKENS)
    outcome = await outcome_of(gen.transceiver.check_gen_transfer_status)
    await outcome_of(ctx.transceiver.check_context_transfer_status)
    return outcome


def _known_gen(ctx: Side, gen: Side) -> bool:
    key = (gen.transceiver.local.instance_name, 0)
    return ctx.transceiver.protocol.ctx.registrar.get(key) is not None


async def test_ctx_forgets_a_gen_that_is_gone_and_unloads_its_agent() -> None:
    async with _pair() as (ctx, gen):
        assert (await _transfer(ctx, gen, 1)).ok
        assert gen.blocks(DST) == ctx.blocks(SRC)
        assert _known_gen(ctx, gen) and gen.agent.name in ctx.agent.remotes
        await gen.stop()
        await until(lambda: ctx.transceiver.statistics().peers_forgotten == 1, "forgotten")
        assert not _known_gen(ctx, gen)
        await until(lambda: gen.agent.name not in ctx.agent.remotes, "the agent unloaded")
        assert not ctx.transceiver.protocol.liveness


async def test_gen_forgets_a_ctx_that_is_gone() -> None:
    async with _pair() as (ctx, gen):
        assert (await _transfer(ctx, gen, 1)).ok
        rendezvous = gen.transceiver.statistics().rendezvous
        await ctx.stop()
        await until(lambda: gen.transceiver.statistics().peers_forgotten == 1, "forgotten")
        assert not gen.transceiver.protocol.liveness
        assert gen.transceiver.statistics().rendezvous == rendezvous
        assert not gen.agent.remotes  # gen loads no ctx agent: it only receives


async def test_live_idle_peers_answer_their_probes_and_are_kept() -> None:
    async with _pair() as (ctx, gen):
        assert (await _transfer(ctx, gen, 1)).ok
        both = (ctx.transceiver, gen.transceiver)
        await until(lambda: all(t.protocol.probes >= 4 for t in both), "probes")
        assert [t.statistics().peers_forgotten for t in both] == [0, 0]
        assert [len(t.protocol.liveness) for t in both] == [1, 1]
        rendezvous = gen.transceiver.statistics().rendezvous
        assert (await _transfer(ctx, gen, 2)).ok  # no new rendezvous: nothing was forgotten
        assert gen.transceiver.statistics().rendezvous == rendezvous


async def test_a_gen_forgotten_while_alive_is_refused_once_and_meets_ctx_again() -> None:
    async with _pair() as (ctx, gen):
        assert (await _transfer(ctx, gen, 1)).ok
        gone = Gone(gen.transceiver.local.instance_name, False, "a test")
        ctx.transceiver._apply(ctx.transceiver.protocol.forget(gone, ctx.transceiver.clock()))
        await until(lambda: gen.agent.name not in ctx.agent.remotes, "the agent unloaded")
        ctx.transceiver.respond_and_send_async(2, [SRC], NUM_TOKENS)
        gen.transceiver.request_and_receive_async(
            2, ctx.transceiver.info_endpoint, [DST], NUM_TOKENS
        )
        failed = await outcome_of(gen.transceiver.check_gen_transfer_status)
        assert not failed.ok and failed.error is not None and NOT_REGISTERED in failed.error
        assert ctx.transceiver.cancel_request(2)  # its request never came: nothing in flight
        assert (await outcome_of(ctx.transceiver.check_context_transfer_status)).cancelled
        rendezvous = gen.transceiver.statistics().rendezvous
        gen.memory[:] = 0
        assert (await _transfer(ctx, gen, 3)).ok  # registered again
        assert gen.transceiver.statistics().rendezvous == rendezvous + 1
        assert gen.blocks(DST) == ctx.blocks(SRC) and _known_gen(ctx, gen)


async def test_a_ctx_that_ends_fails_the_request_waiting_on_it_and_frees_its_blocks() -> None:
    """A ctx process that ends drops gen's control connection and it stays down: the request
    waiting for its KV fails within about `relink_s`, not at its deadline (5 s here), and its
    blocks are free at once (a process that ended writes nothing any more)."""
    async with _pair(liveness=_links_only) as (ctx, gen):
        assert (await _transfer(ctx, gen, 1)).ok
        gen.transceiver.request_and_receive_async(
            2, ctx.transceiver.info_endpoint, [DST], NUM_TOKENS
        )
        await until(lambda: ctx.transceiver.statistics().early == 1, "ctx holding the request")
        stopped = trio.current_time()
        await ctx.stop()
        outcome = await outcome_of(gen.transceiver.check_gen_transfer_status)
        assert trio.current_time() - stopped < 2
        assert not outcome.ok and not outcome.blocks_held, outcome
        assert outcome.error is not None and "is gone" in outcome.error, outcome.error
        assert "dropped" in outcome.error
        stats = gen.transceiver.statistics()
        assert (stats.peers_dead, stats.peers_forgotten, stats.receivers) == (1, 1, 0)
        assert stats.quarantined == 0 and stats.quarantine_expired == 0


async def test_a_gen_that_ends_before_ctx_ever_connected_to_it_is_found_dead() -> None:
    """A gen can meet ctx, ask for KV and end before ctx has opened a connection to it (ctx
    answers the rendezvous on its own router). ctx's first connection to it, here a probe, is
    refused: that says the process ended as surely as a connection that drops, so the gen is
    forgotten as dead within `relink_s`, not after its probes time out (60 s here)."""
    async with _pair(liveness=_refusals_only) as (ctx, gen):
        gen.transceiver.request_and_receive_async(
            1, ctx.transceiver.info_endpoint, [DST], NUM_TOKENS
        )
        await until(lambda: ctx.transceiver.statistics().early == 1, "ctx holding the request")
        assert ctx.transceiver.statistics().connections == 0  # ctx never connected to gen
        await gen.stop()
        stats = ctx.transceiver.statistics
        await until(lambda: stats().peers_dead == 1, "ctx finding the gen dead")
        assert ctx.transceiver.protocol.probes >= 1 and stats().peers_forgotten == 1
        await until(lambda: gen.agent.name not in ctx.agent.remotes, "the agent unloaded")


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_gen_instances_that_come_and_go_leave_ctx_no_sockets_behind() -> None:
    """One socket (and its monitor) per peer endpoint, never closed, ran a prefill server out of
    file descriptors (peers.md, pain point 8). Here gen instances meet ctx one after another,
    each moves its KV and ends: ctx forgets each as dead and closes what it opened for it, so
    the open files of this process (both sides run in it) come back to where they were."""
    fabric = LoopbackFabric()
    ctx_memory = np.random.default_rng(5).integers(0, 255, NUM_SLOTS * BLOCK_BYTES, np.uint8)
    async with trio.open_nursery() as nursery:
        ctx: Side = await nursery.start(_run_side_kw, "ctx", fabric, ctx_memory, _links_only)
        before = _open_files()
        stats = ctx.transceiver.statistics
        for i in range(CHURN):
            memory = np.zeros(NUM_SLOTS * BLOCK_BYTES, np.uint8)
            gen: Side = await nursery.start(_run_side_kw, f"gen{i}", fabric, memory, _links_only)
            assert (await _transfer(ctx, gen, i + 1)).ok
            assert gen.blocks(DST) == ctx.blocks(SRC)
            assert _open_files() > before  # what ctx opened for gen, and gen's own
            await gen.stop()
            await until(lambda i=i: stats().peers_dead == i + 1, "ctx forgetting a gen as dead")
            await until(lambda: _open_files() <= before, f"files closed after gen {i}")
            await until(lambda: not ctx.agent.remotes, f"gen {i}'s agent unloaded")
            assert not ctx.transceiver.protocol.liveness
        nursery.cancel_scope.cancel()


async def test_many_gen_instances_alive_at_once_each_cost_ctx_a_bounded_few_sockets() -> None:
    """Pain point 8 with many peers alive at once: 24 gen instances meet ctx together and move
    their KV at the same time, four rounds over. Every transfer lands byte for byte; the open
    files grow by a few per peer (both ends run in this process), and not with the transfers
    after the first round; once the gens end, ctx forgets every one and the open files come back
    to where they were."""
    fabric = LoopbackFabric()
    ctx_memory = np.random.default_rng(6).integers(0, 255, NUM_SLOTS * BLOCK_BYTES, np.uint8)
    peers, rounds = 24, 4
    async with trio.open_nursery() as nursery:
        ctx: Side = await nursery.start(_run_side_kw, "ctx", fabric, ctx_memory, _links_only)
        before = _open_files()
        gens: list[Side] = []
        for i in range(peers):
            memory = np.zeros(NUM_SLOTS * BLOCK_BYTES, np.uint8)
            gens.append(await nursery.start(_run_side_kw, f"gen{i}", fabric, memory, _links_only))
        with_gens = _open_files()
        after_first = 0
        for round_ in range(rounds):
            await _transfer_to_all(ctx, gens, first_key=1 + round_ * peers)
            if round_ == 0:  # once every link is up: a DEALER each way per gen
                await until(
                    lambda: (
                        ctx.transceiver.statistics().connections == peers
                        and all(g.transceiver.statistics().connections == 1 for g in gens)
                    ),
                    "every link up",
                )
                after_first = _open_files()
        # both ends of every link are in this process: sockets, their connections and monitors
        per_peer = (after_first - with_gens) / peers
        assert 0 < per_peer <= 12, f"{per_peer:.1f} files opened per gen instance"
        grown = _open_files() - after_first
        assert grown <= 2, f"{(rounds - 1) * peers} more transfers opened {grown} files"
        stats = ctx.transceiver.statistics
        for gen in gens:
            await gen.stop()
        await until(lambda: stats().peers_dead == peers, "ctx forgetting every gen as dead")
        await until(lambda: _open_files() <= before, "files closed after the gens ended")
        await until(lambda: not ctx.agent.remotes, "every gen's agent unloaded")
        nursery.cancel_scope.cancel()


async def _transfer_to_all(ctx: Side, gens: list[Side], *, first_key: int) -> None:
    """One transfer from ctx to each of `gens` at once; each lands exactly and ctx reports all."""
    for i, gen in enumerate(gens):
        ctx.transceiver.respond_and_send_async(first_key + i, [SRC], NUM_TOKENS)
        gen.transceiver.request_and_receive_async(
            first_key + i, ctx.transceiver.info_endpoint, [DST], NUM_TOKENS
        )
    for gen in gens:
        assert (await outcome_of(gen.transceiver.check_gen_transfer_status)).ok
        assert gen.blocks(DST) == ctx.blocks(SRC)
    sent: list[TransferOutcome] = []

    def all_sent() -> bool:
        sent.extend(ctx.transceiver.check_context_transfer_status())
        return len(sent) == len(gens)

    await until(all_sent, "ctx's sends reported")
    assert all(outcome.ok for outcome in sent)
