"""The agent pump outlives what its agent raises: a write whose poll raises ends as failed, and
the writes after it are polled and end as before. (A gen killed mid-write made NIXL's poll
raise NIXL_ERR_REMOTE_DISCONNECT; the pump's thread died of it, and no transfer of that ctx
ended again.)"""

from __future__ import annotations

from typing import Any, cast

import trio

from trtdisagg.transfer.runtime.agents.base import TransferAgent, XferHandle, XferStatus
from trtdisagg.transfer.runtime.pump import AgentPump, Ended, Notifications, Posted


class DisconnectingAgent:
    """Write 1's peer is gone: polling it raises what a backend raises, not an AgentError."""

    def __init__(self) -> None:
        self.released: list[int] = []

    def poll(self, handle: XferHandle) -> XferStatus:
        if handle == 1:
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        return XferStatus.DONE

    def release(self, handle: XferHandle) -> None:
        self.released.append(handle)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        return []


async def test_a_write_whose_poll_raises_ends_failed_and_the_pump_goes_on() -> None:
    agent = DisconnectingAgent()
    ended: dict[int, XferStatus] = {}
    news = trio.Event()

    def deliver(posted: Posted, got: Notifications, done: Ended) -> None:
        assert all(error is None for _, error in posted)
        ended.update(done)
        news.set()

    async def until_ended(write_id: int) -> None:
        nonlocal news
        with trio.fail_after(10):
            while write_id not in ended:
                await news.wait()
                news = trio.Event()

    pump = AgentPump(cast(TransferAgent, cast(Any, agent)), deliver)
    pump.start()
    try:
        pump.post(1, lambda: XferHandle(1), quick=True)
        await until_ended(1)
        pump.post(2, lambda: XferHandle(2), quick=True)
        await until_ended(2)
    finally:
        pump.stop()
    assert ended == {1: XferStatus.ERROR, 2: XferStatus.DONE}
    assert agent.released == [1, 2]
