"""A waiter in `KvTransceiver.wait_for` (the executor) spins in `_keep_awake`'s place.

Two KvTransceivers in one trio run (real ZMQ, loopback agents), generation-first: gen asks, ctx
prepares the write and tells gen, which watches for the write's notification. The waiter spins
while it watches, so the notification that ends the transfer is drained in the waiter's own
task: it goes on at once, not one scheduling round after another task woke it. While it spins,
gen rehearses the hand-over on a twin (transfer/rehearsal.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import pytest
import trio

from tests.integration.test_transceiver_prepared import NUM_TOKENS, Pair, _open_pair, _until
from tests.transceivers import TPB
from trtdisagg.transfer.rehearsal import REHEARSAL_KEY, HandoverRehearsal, RehearsalEffect
from trtdisagg.transfer.runtime.agents.loopback import LoopbackAgent
from trtdisagg.transfer.transceiver import TransferOutcome


class _Waker:
    """What the executor's wake does, and which task called it each time."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.callers: list[trio.lowlevel.Task] = []

    def __call__(self) -> None:
        self.callers.append(trio.lowlevel.current_task())
        self.event.set()


@attrs.define
class _Watching:
    """A pair where gen asked for `key`, ctx prepared its write, and gen's executor waits."""

    pair: Pair
    waker: _Waker
    outcomes: list[TransferOutcome]
    waiter: trio.lowlevel.Task
    key: int


@asynccontextmanager
async def _gen_watching(key: int = 2) -> AsyncIterator[_Watching]:
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
        gen.request_and_receive_async(key, ctx.info_endpoint, [[1, 2, 3]], NUM_TOKENS)
        await _until(lambda: ctx.statistics().early == 1, "ctx holding the request")
        await n.start(executor)
        ctx.prepare_send(key, [[4, 5, 6]], NUM_TOKENS)
        await _until(lambda: gen.statistics().watched == 1, "gen watching for the write")
        yield _Watching(pair, waker, outcomes, waiter[-1], key)


async def _respond(watching: _Watching) -> TransferOutcome:
    """The KV is ready: ctx writes it, and the waiter has the outcome of the watched key."""
    pair = watching.pair
    pair.ctx.respond_and_send_async(watching.key, [[4, 5, 6]], NUM_TOKENS, first_tokens=[7])
    await _until(lambda: watching.outcomes, "the outcome")
    (outcome,) = watching.outcomes
    assert outcome.key == watching.key and outcome.ok and outcome.first_tokens == (7,)
    assert pair.gen_blocks([1, 2, 3]) == pair.ctx_blocks([4, 5, 6])
    assert pair.gen.statistics().watched == 0
    return outcome


async def test_the_waiter_drains_the_notice_that_ends_its_transfer() -> None:
    async with _gen_watching() as watching:
        gen = watching.pair.gen
        # While it spins, gen rehearses the hand-over on its twin (rehearsal.py), untold.
        await _until(lambda: gen.statistics().rehearsals >= 3, "gen rehearsing its hand-over")
        assert gen.statistics().receivers == 1 and not watching.outcomes
        watching.waker.callers.clear()
        await _respond(watching)
        # The end of the transfer woke the waiter from its own task, and nothing else did.
        callers = watching.waker.callers
        assert callers == [watching.waiter], [task.name for task in callers]


async def test_a_transfer_with_the_rehearsal_s_key_keeps_its_session_and_timing() -> None:
    """A client may pick any transfer key: the twin's share nothing with the real ones."""
    async with _gen_watching(key=REHEARSAL_KEY) as watching:
        gen = watching.pair.gen
        await _until(lambda: gen.statistics().rehearsals >= 3, "gen rehearsing its hand-over")
        assert gen.statistics().receivers == 1 and not watching.outcomes
        outcome = await _respond(watching)
        assert outcome.seconds > 0


async def test_a_rehearsal_that_fails_is_logged_once_and_the_transfer_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tries: list[float] = []

    def fail(self: HandoverRehearsal, now: float) -> None:
        tries.append(now)
        raise RehearsalEffect("the twin reached a callback with effects")

    drains = [0]
    get_notifications = LoopbackAgent.get_notifications

    def counted(self: LoopbackAgent) -> list[tuple[str, bytes]]:
        drains[0] += 1
        return get_notifications(self)

    monkeypatch.setattr(HandoverRehearsal, "run", fail)
    monkeypatch.setattr(LoopbackAgent, "get_notifications", counted)
    with caplog.at_level(logging.ERROR, logger="trtdisagg.transfer.transceiver"):
        async with _gen_watching() as watching:
            await _until(lambda: tries, "a rehearsal tried")
            # gen spins on through many bursts, at the end of any of which it would rehearse
            spun = drains[0]
            await _until(lambda: drains[0] > spun + 2000, "gen spinning on")
            await _respond(watching)
    assert len(tries) == 1 and watching.pair.gen.statistics().rehearsals == 0
    failures = [r for r in caplog.records if "rehearsal failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
