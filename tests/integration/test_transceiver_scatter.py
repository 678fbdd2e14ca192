"""gen's scatter of a bounced receive on a host pool runs in a worker thread, not on the loop.

The receive is reported only once the staged KV is in the blocks, and `cancel_request` says
False while the thread still writes into them. The session is made TRANSFERRED by hand (the
bounce path itself, with real processes, is in tests/e2e/test_hetero_pairings.py); what is
checked here is the shell's ordering around the copy.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import trio

from tests.transceivers import outcome_of, rank_info
from trtdisagg.transfer.protocol.bounce import StagedRun
from trtdisagg.transfer.protocol.events import NoticeIn, Staged
from trtdisagg.transfer.protocol.sessions import ReceiverSession
from trtdisagg.transfer.protocol.wire import ResultStatus, TransferResult, WriteNotice
from trtdisagg.transfer.runtime.agents.loopback import LoopbackAgent, LoopbackFabric
from trtdisagg.transfer.runtime.driver import KvTransceiver
from trtdisagg.transfer.runtime.messenger import open_router
from trtdisagg.transfer.runtime.staging_area import StagingArea

KEY = 2**41 + 11


class GatedStager:
    """A host-memory stager whose `unpack` runs off the loop and waits for the test."""

    memory_type = "DRAM"
    address = 0
    capacity = 1 << 20

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.loop_thread = threading.get_ident()
        self.unpacked_on: int | None = None

    def pack(
        self,
        offset: int,
        runs: Sequence[StagedRun],
        block_ids: Sequence[int],
        *,
        first_token: int,
        num_tokens: int,
    ) -> None:
        raise AssertionError("gen never packs")

    def unpack(
        self, offset: int, block_ids: Sequence[int], *, first_token: int, num_tokens: int
    ) -> None:
        self.unpacked_on = threading.get_ident()
        self.entered.set()
        if not self.release.wait(10):
            raise TimeoutError("the test never released the scatter")


async def test_host_scatter_runs_off_the_loop_and_holds_the_outcome_and_the_blocks() -> None:
    stager = GatedStager()
    memory = np.zeros(1 << 16, np.uint8)
    agent = LoopbackAgent("gen-agent", fabric=LoopbackFabric())
    async with open_router() as router, trio.open_nursery() as nursery:
        info = rank_info("gen", memory, agent, router.endpoint)
        wakes: list[int] = []
        gen = KvTransceiver(
            local=info, instance=(info,), agent=agent, router=router, timeout_s=30,
            wake=lambda: wakes.append(1),
            staging=StagingArea(stager=stager, clock=trio.current_time),
        )  # fmt: skip
        await nursery.start(gen.run)
        assert gen.staging is not None
        offset = await gen.staging.reserve(4096, trio.current_time() + 1)
        session = ReceiverSession(
            key=KEY, peer_instance="ctx", expected=frozenset({0}), deadline=1e12
        )
        ctx_rank = {"key": KEY, "instance_name": "ctx", "instance_rank": 0}
        session.on_result(TransferResult(status=ResultStatus.OK, num_bytes=4096, **ctx_rank))
        gen.protocol.gen.receivers[KEY] = session
        gen.protocol.gen._staged[KEY] = Staged(
            offset=offset, num_bytes=4096, block_ids=(1, 2), first_token=0, num_tokens=5
        )
        # ctx's write lands: its notice ends the session, whose KV is then scattered
        gen._feed(NoticeIn(notice=WriteNotice(key=KEY, instance_name="ctx", instance_rank=0)))

        assert gen.check_gen_transfer_status() == []  # not before the KV is in the blocks
        await trio.to_thread.run_sync(stager.entered.wait, 5)
        assert stager.unpacked_on != stager.loop_thread
        assert gen.cancel_request(KEY) is False  # the thread still writes into the blocks
        assert gen.check_gen_transfer_status() == []
        assert gen.staging.allocator.free_bytes < gen.staging.allocator.capacity  # room still held

        stager.release.set()
        outcome = await outcome_of(gen.check_gen_transfer_status)
        assert (outcome.key, outcome.ok, outcome.num_bytes) == (KEY, True, 4096)
        assert wakes  # the executor was woken to collect it
        assert gen.cancel_request(KEY) is True
        assert gen.staging.allocator.free_bytes == gen.staging.allocator.capacity
        assert gen.statistics().bounced == 1
        nursery.cancel_scope.cancel()
