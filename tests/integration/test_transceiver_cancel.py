"""Two KvTransceivers in one trio run (real ZMQ, loopback agent): cancellation vs a write in flight.

Cancellation is not quiescence: while ctx's write is in flight, cancelling returns False on both
sides, and no session is released; once the write completes, both sides settle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import trio

from tests.transceivers import HEAD_DIM, HEADS, LAYERS, NUM_SLOTS, TPB, rank_info
from trtdisagg.transfer.protocol.fragments import Fragments
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.runtime.agents.base import (
    MemoryRegion,
    TransferAgent,
    XferHandle,
    XferStatus,
)
from trtdisagg.transfer.runtime.agents.loopback import LoopbackAgent, LoopbackFabric
from trtdisagg.transfer.runtime.messenger import open_router
from trtdisagg.transfer.transceiver import KvTransceiver, TransferOutcome


@attrs.define(eq=False)
class StallingAgent:
    """A loopback agent whose writes stay in flight until `finish()`, as on a slow network:
    neither the bytes nor the notification land, and the initiator sees PENDING."""

    inner: LoopbackAgent
    stalled: bool = True
    submitted: int = 0
    _held: list[tuple[XferHandle, tuple[Any, ...], dict[str, Any]]] = attrs.field(factory=list)
    _landed: dict[XferHandle, XferHandle] = attrs.field(factory=dict)

    def finish(self) -> None:
        """The held writes land now (bytes, then notification)."""
        self.stalled = False
        for handle, args, kw in self._held:
            self._landed[handle] = self.inner.submit_write(*args, **kw)
        self._held.clear()

    @property
    def name(self) -> str:
        return self.inner.name

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        self.inner.register_memory(regions)

    def deregister_memory(self) -> None:
        self.inner.deregister_memory()

    def local_metadata(self) -> bytes:
        return self.inner.local_metadata()

    def add_remote(self, metadata: bytes) -> str:
        return self.inner.add_remote(metadata)

    def remove_remote(self, name: str) -> None:
        self.inner.remove_remote(name)

    def submit_write(
        self, fragments: Fragments, remote: str, notif: bytes, **kw: Any
    ) -> XferHandle:
        self.submitted += 1
        handle = XferHandle(-self.submitted)  # the inner agent's handles are positive
        self._held.append((handle, (fragments, remote, notif), kw))
        return handle

    def poll(self, handle: XferHandle) -> XferStatus:
        landed = self._landed.get(handle)
        return XferStatus.PENDING if landed is None else self.inner.poll(landed)

    def release(self, handle: XferHandle) -> None:
        landed = self._landed.pop(handle, None)
        if landed is not None:
            self.inner.release(landed)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        return self.inner.get_notifications()

    def close(self) -> None:
        self.inner.close()


async def _wait(predicate: Any, what: str) -> None:
    """Poll an observable condition (state inside another task), bounded in time."""
    with trio.fail_after(5):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.001)


async def test_cancel_returns_false_until_the_write_in_flight_completes() -> None:
    fabric = LoopbackFabric()
    ctx_agent = StallingAgent(LoopbackAgent("ctx-agent", fabric=fabric))
    gen_agent = LoopbackAgent("gen-agent", fabric=fabric)
    block_bytes = LAYERS * 2 * HEADS * TPB * HEAD_DIM * 4
    ctx_memory = np.random.default_rng(0).integers(0, 255, NUM_SLOTS * block_bytes, np.uint8)
    gen_memory = np.zeros(NUM_SLOTS * block_bytes, np.uint8)
    wakes: list[str] = []
    async with (
        open_router() as ctx_router,
        open_router() as gen_router,
        trio.open_nursery() as nursery,
    ):
        ctx_info = rank_info("ctx", ctx_memory, ctx_agent, ctx_router.endpoint)
        gen_info = rank_info("gen", gen_memory, gen_agent, gen_router.endpoint)

        def service(info: RankInfo, agent: TransferAgent, router: Any, side: str) -> KvTransceiver:
            return KvTransceiver(
                local=info, instance=(info,), agent=agent, router=router, timeout_s=30,
                wake=lambda: wakes.append(side),
            )  # fmt: skip

        ctx = service(ctx_info, ctx_agent, ctx_router, "ctx")
        gen = service(gen_info, gen_agent, gen_router, "gen")
        await nursery.start(ctx.run)
        await nursery.start(gen.run)

        key, num_tokens = 2**41 + 7, 3 * TPB - 1
        ctx.respond_and_send_async(key, [[1, 2, 3]], num_tokens)
        gen.request_and_receive_async(key, ctx.info_endpoint, [[4, 5, 6]], num_tokens)
        # Wait until the agent has the write (a write not yet submitted is simply not issued).
        await _wait(lambda: ctx_agent.submitted == 1, "the write in flight")

        # Both sides refuse to call the transfer over while ctx's write is in flight.
        assert gen.cancel_request(key) is False
        assert ctx.cancel_request(key) is False
        for _ in range(20):
            await trio.sleep(0.001)
            assert ctx.check_context_transfer_status() == []
            assert gen.check_gen_transfer_status() == []

        ctx_agent.finish()  # the write completes; ctx reports it, gen learns every rank is done
        outcomes: list[TransferOutcome] = []
        await _wait(lambda: outcomes.extend(ctx.check_context_transfer_status()) or outcomes, "")
        assert [o.key for o in outcomes] == [key] and not outcomes[0].ok
        gen_outcomes: list[TransferOutcome] = []
        await _wait(
            lambda: gen_outcomes.extend(gen.check_gen_transfer_status()) or gen_outcomes, ""
        )
        assert [o.key for o in gen_outcomes] == [key]
        assert gen_outcomes[0].cancelled
        assert gen.cancel_request(key) is True  # nothing left that could write
        assert len(ctx.senders) == 0 and len(gen.receivers) == 0
        nursery.cancel_scope.cancel()
