"""Two KvTransceivers in one trio run (real ZMQ, loopback agent): cancellation vs a write in flight.

Cancellation is not quiescence: while ctx's write is in flight, cancelling returns False on both
sides, and no session is released; once the write completes, both sides settle.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from tests.transceivers import NUM_TOKENS, open_pair, outcome_of, until
from trtdisagg.transfer.protocol.fragments import Fragments
from trtdisagg.transfer.runtime.agents.base import MemoryRegion, XferHandle, XferStatus
from trtdisagg.transfer.runtime.agents.loopback import LoopbackAgent


@attrs.define(eq=False)
class StallingAgent:
    """A loopback agent whose writes stay in flight until `finish()`, as on a slow network:
    neither the bytes nor the notification land, and the initiator sees PENDING."""

    inner: LoopbackAgent
    submitted: int = 0
    _held: dict[XferHandle, Callable[[], XferHandle]] = attrs.field(factory=dict)  # not landed
    _landed: dict[XferHandle, XferHandle] = attrs.field(factory=dict)  # -> the loopback's handle
    _ids: Any = attrs.field(factory=lambda: itertools.count(-1, -1))  # never a loopback handle

    def finish(self) -> None:
        """The held writes land now (bytes, then notification)."""
        for handle, submit in self._held.items():
            self._landed[handle] = submit()
        self._held.clear()

    @property
    def name(self) -> str:
        return self.inner.name

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        self.inner.register_memory(regions)

    def local_metadata(self) -> bytes:
        return self.inner.local_metadata()

    def add_remote(self, metadata: bytes) -> str:
        return self.inner.add_remote(metadata)

    def remove_remote(self, name: str) -> None:
        self.inner.remove_remote(name)

    def submit_is_quick(self, fragments: Fragments, remote: str) -> bool:
        return self.inner.submit_is_quick(fragments, remote)

    def submit(self, fragments: Fragments, remote: str, notif: bytes, **kw: Any) -> XferHandle:
        self.submitted += 1
        handle = XferHandle(next(self._ids))
        self._held[handle] = functools.partial(self.inner.submit, fragments, remote, notif, **kw)
        return handle

    def poll(self, handle: XferHandle) -> XferStatus:
        if handle in self._held:
            return XferStatus.PENDING
        return self.inner.poll(self._landed[handle])

    def release(self, handle: XferHandle) -> None:
        self._held.pop(handle, None)
        if handle in self._landed:
            self.inner.release(self._landed.pop(handle))

    def get_notifications(self) -> list[tuple[str, bytes]]:
        return self.inner.get_notifications()

    def close(self) -> None:
        self.inner.close()


async def test_cancel_returns_false_until_the_write_in_flight_completes() -> None:
    stalling: list[StallingAgent] = []

    def stall(agent: LoopbackAgent, _faults: object) -> StallingAgent:
        stalling.append(StallingAgent(agent))
        return stalling[0]

    async with open_pair(ctx_agent=stall) as pair:
        (ctx_agent,), ctx, gen = stalling, pair.ctx, pair.gen
        key = 2**41 + 7
        ctx.respond_and_send_async(key, [[1, 2, 3]], NUM_TOKENS)
        gen.request_and_receive_async(key, ctx.info_endpoint, [[4, 5, 6]], NUM_TOKENS)
        # Wait until the agent has the write (a write not yet submitted is simply not issued).
        await until(lambda: ctx_agent.submitted == 1, "the write in flight")

        # Both sides refuse to call the transfer over while ctx's write is in flight.
        assert gen.cancel_request(key) is False
        assert ctx.cancel_request(key) is False
        for _ in range(20):
            await trio.sleep(0.001)
            assert ctx.check_context_transfer_status() == []
            assert gen.check_gen_transfer_status() == []

        ctx_agent.finish()  # the write completes; ctx reports it, gen learns every rank is done
        sent = await outcome_of(ctx.check_context_transfer_status)
        assert sent.key == key and not sent.ok
        received = await outcome_of(gen.check_gen_transfer_status)
        assert received.key == key and received.cancelled
        assert gen.cancel_request(key) is True  # nothing left that could write
        assert ctx.statistics().senders == 0 and gen.statistics().receivers == 0
