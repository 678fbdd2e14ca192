"""In-process transceiver pairs: one small single-rank KV geometry, its RankInfo, and a ctx and a
gen `KvTransceiver` in one trio run (real ZMQ, loopback agents), with optional test faults.

The pools are numpy arrays registered with a loopback agent; the RankInfo points at them and at
a real ROUTER endpoint, as a worker's would.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import numpy as np
import trio

from tests.rank_infos import make_instance
from trtdisagg.faults.agent import FaultyAgent
from trtdisagg.faults.messenger import faulty_dealers, faulty_router
from trtdisagg.faults.spec import FaultInjector, parse_faults
from trtdisagg.transfer.protocol.liveness import PeerLiveness
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.sessions import TransferOutcome
from trtdisagg.transfer.runtime.agents.base import TransferAgent, pool_regions
from trtdisagg.transfer.runtime.agents.loopback import LoopbackAgent, LoopbackFabric
from trtdisagg.transfer.runtime.driver import KvTransceiver
from trtdisagg.transfer.runtime.messenger import open_dealer, open_router

NUM_SLOTS, TPB, HEADS, HEAD_DIM, LAYERS = 8, 4, 2, 8, 2
BLOCK_BYTES = LAYERS * 2 * HEADS * TPB * HEAD_DIM * 4
NUM_TOKENS = 3 * TPB - 1


def rank_info(name: str, memory: np.ndarray, agent: TransferAgent, endpoint: str) -> RankInfo:
    """Register `memory` as the pool of instance `name` with `agent`; that rank's RankInfo."""
    (info,) = make_instance(
        instance_name=name, tp_size=1, pp_size=1, layer_num_per_pp=(LAYERS,),
        num_kv_heads=HEADS, head_dim=HEAD_DIM, tokens_per_block=TPB, num_slots=NUM_SLOTS,
        base_address=lambda rank: int(memory.ctypes.data),
    )  # fmt: skip
    agent.register_memory(pool_regions(info.page_table))
    return attrs.evolve(
        info,
        control_endpoint=endpoint,
        agent_name=agent.name,
        agent_metadata=agent.local_metadata(),
    )


def blocks_of(memory: np.ndarray, blocks: list[int]) -> bytes:
    """The bytes of `blocks` of a pool laid out as BLOCK_BYTES per block."""
    return b"".join(memory[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES].tobytes() for b in blocks)


async def until(predicate: Callable[[], object], what: str, timeout: float = 5.0) -> None:
    """Wait for state that another task changes, bounded in time."""
    with trio.fail_after(timeout):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.001)


async def outcome_of(
    check: Callable[[], list[TransferOutcome]], key: int | None = None, timeout: float = 5.0
) -> TransferOutcome:
    """The next outcome `check` hands over (of `key`, when given; others are dropped)."""
    found: list[TransferOutcome] = []

    def seen() -> bool:
        found.extend(o for o in check() if key is None or o.key == key)
        return bool(found)

    await until(seen, "an outcome", timeout)
    (outcome,) = found
    return outcome


@attrs.define
class AheadClock:
    """A clock `ahead` seconds ahead of the monotonic one, so that what a side holds ages at
    once."""

    ahead: float = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead


@attrs.define(eq=False)
class Pair:
    ctx: KvTransceiver
    gen: KvTransceiver
    ctx_agent: Any
    gen_agent: Any
    ctx_memory: np.ndarray
    gen_memory: np.ndarray
    ctx_faults: FaultInjector  # ctx's control messages and its agent's writes
    gen_faults: FaultInjector  # gen's control messages and the notifications it receives
    stamps: list[tuple[int, str, str]]  # (key, side, stage) from the tracers

    def gen_blocks(self, blocks: list[int]) -> bytes:
        return blocks_of(self.gen_memory, blocks)

    def ctx_blocks(self, blocks: list[int]) -> bytes:
        return blocks_of(self.ctx_memory, blocks)

    def fill_gen_blocks(self, blocks: list[int], value: int) -> bytes:
        """What another request of gen's would do to blocks it was given: write them."""
        for b in blocks:
            self.gen_memory[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES] = value
        return self.gen_blocks(blocks)

    def arm(self, *, ctx: str = "none", gen: str = "none") -> None:
        self.ctx_faults.replace(parse_faults(ctx))
        self.gen_faults.replace(parse_faults(gen))

    def count(self, key: int, side: str, stage: str) -> int:
        """How often `side` reached `stage` for `key` (the tracer's stamps)."""
        return self.stamps.count((key, side, stage))

    async def transfer(
        self, key: int, src: list[int], dst: list[int], num_tokens: int = NUM_TOKENS
    ) -> TransferOutcome:
        """One context-first transfer; both sides' outcomes, gen's returned."""
        self.ctx.respond_and_send_async(key, [src], num_tokens, first_tokens=(11,))
        self.gen.request_and_receive_async(key, self.ctx.info_endpoint, [dst], num_tokens)
        got = await outcome_of(self.gen.check_gen_transfer_status, key)
        await outcome_of(self.ctx.check_context_transfer_status, key)
        return got


@asynccontextmanager
async def open_pair(
    *,
    ctx_faults: str | None = None,
    gen_faults: str | None = None,
    timeout_s: float = 30.0,
    ctx_clock: Callable[[], float] = time.monotonic,
    ctx_agent: Callable[[LoopbackAgent, FaultInjector], Any] | None = None,
    liveness: Callable[[], PeerLiveness] = PeerLiveness,
    gen_wake: Callable[[], None] = lambda: None,
    notify_on_poll: bool = False,
) -> AsyncIterator[Pair]:
    """ctx and gen transceivers in this trio run. `*_faults` (a spec) arms that side's fault
    injector: its control messages, and ctx's writes / the notifications gen receives, go
    through the faulty wrappers (given "none", they are there with no rule). `ctx_agent`
    wraps ctx's loopback agent another way. `notify_on_poll`: ctx's agent sends a write's
    notification from the poll that finds it done, as NIXL's UCX backend does."""
    fabric = LoopbackFabric()
    injectors = {
        side: FaultInjector(plan=parse_faults(spec or "none"))
        for side, spec in (("ctx", ctx_faults), ("gen", gen_faults))
    }
    loopback = {
        "ctx": LoopbackAgent("ctx-agent", fabric=fabric, notify_on_poll=notify_on_poll),
        "gen": LoopbackAgent("gen-agent", fabric=fabric),
    }
    memory = {
        "ctx": np.random.default_rng(5).integers(0, 255, NUM_SLOTS * BLOCK_BYTES, np.uint8),
        "gen": np.zeros(NUM_SLOTS * BLOCK_BYTES, np.uint8),
    }
    stamps: list[tuple[int, str, str]] = []
    sides: dict[str, KvTransceiver] = {}
    agents: dict[str, Any] = {}
    async with AsyncExitStack() as stack:
        for side, spec in (("ctx", ctx_faults), ("gen", gen_faults)):
            faults = injectors[side]
            router: Any = await stack.enter_async_context(open_router())
            agent: Any = loopback[side]
            connect: Any = open_dealer
            if spec is not None:
                router = await stack.enter_async_context(faulty_router(router, faults))
                agent = FaultyAgent(agent, faults)
                connect = faulty_dealers(faults)
            if side == "ctx" and ctx_agent is not None:
                agent = ctx_agent(loopback[side], faults)
            agents[side] = agent
            info = rank_info(side, memory[side], agent, router.endpoint)

            def trace(key: int, stage: str, _at: float, side: str = side) -> None:
                stamps.append((key, side, stage))

            sides[side] = KvTransceiver(
                local=info, instance=(info,), agent=agent, router=router, timeout_s=timeout_s,
                wake=gen_wake if side == "gen" else lambda: None, connect=connect,
                clock=ctx_clock if side == "ctx" else time.monotonic, liveness=liveness(),
                tracer=trace,
            )  # fmt: skip
        nursery = await stack.enter_async_context(trio.open_nursery())
        for transceiver in sides.values():
            await nursery.start(transceiver.run)
        yield Pair(
            sides["ctx"], sides["gen"], agents["ctx"], agents["gen"], memory["ctx"],
            memory["gen"], injectors["ctx"], injectors["gen"], stamps,
        )  # fmt: skip
        nursery.cancel_scope.cancel()
