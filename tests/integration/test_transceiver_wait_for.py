"""A waiter in `KvTransceiver.wait_for` (the executor) spins in `_keep_awake`'s place.

Two KvTransceivers in one trio run (real ZMQ, loopback agents), generation-first: gen asks, ctx
prepares the write and tells gen, which watches for the write's notification. The waiter spins
while it watches, so the notification that ends the transfer is drained in the waiter's own
task: it goes on at once, not one scheduling round after another task woke it.
"""

from __future__ import annotations

import trio

from tests.integration.test_transceiver_prepared import NUM_TOKENS, _open_pair, _until
from tests.transceivers import TPB
from trtdisagg.transfer.transceiver import TransferOutcome


class _Waker:
    """What the executor's wake does, and which task called it each time."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.callers: list[trio.lowlevel.Task] = []

    def __call__(self) -> None:
        self.callers.append(trio.lowlevel.current_task())
        self.event.set()


async def test_the_waiter_drains_the_notice_that_ends_its_transfer() -> None:
    waker = _Waker()
    async with _open_pair(notify_on_poll=True, gen_wake=waker) as pair, trio.open_nursery() as n:
        ctx, gen = pair.ctx, pair.gen
        outcomes: list[TransferOutcome] = []
        waiter: list[trio.lowlevel.Task] = []

        async def executor(*, task_status: trio.TaskStatus[None]) -> None:
            """The executor's loop: check, then wait until woken."""
            waiter.append(trio.lowlevel.current_task())
            task_status.started()
            while not outcomes:
                outcomes.extend(gen.check_gen_transfer_status())
                if outcomes:
                    return
                with trio.fail_after(10):
                    await gen.wait_for(waker.event)
                waker.event = trio.Event()

        # A first transfer connects ctx to gen: only writes to a peer written to are prepared.
        ctx.respond_and_send_async(1, [[0]], TPB)
        gen.request_and_receive_async(1, ctx.info_endpoint, [[0]], TPB)
        await n.start(executor)
        await _until(lambda: outcomes, "the first outcome")
        assert outcomes.pop().ok
        await _until(lambda: ctx.check_context_transfer_status(), "ctx's first outcome")

        # generation-first: gen asks, ctx prepares (gen is told and watches), the KV is ready.
        gen.request_and_receive_async(2, ctx.info_endpoint, [[1, 2, 3]], NUM_TOKENS)
        await _until(lambda: ctx.statistics().early == 1, "ctx holding the request")
        await n.start(executor)
        ctx.prepare_send(2, [[4, 5, 6]], NUM_TOKENS)
        await _until(lambda: gen.statistics().watched == 1, "gen watching for the write")
        waker.callers.clear()
        ctx.respond_and_send_async(2, [[4, 5, 6]], NUM_TOKENS, first_tokens=[7])
        await _until(lambda: outcomes, "the outcome")
        (outcome,) = outcomes
        assert outcome.ok and outcome.first_tokens == (7,)
        assert pair.gen_blocks([1, 2, 3]) == pair.ctx_blocks([4, 5, 6])
        # The end of the transfer woke the waiter from its own task, and nothing else did.
        assert waker.callers == [waiter[-1]], [task.name for task in waker.callers]
        assert gen.statistics().watched == 0
