"""The step driver of rank 0 of a multi-rank instance: every step is a tick all ranks take.

Each tick rank 0 broadcasts one `StepCommand` (the forward's inputs and the transfer work it
decided since the last tick), every rank applies it and runs its shard of the forward, and all
report the transfers their own transceivers finished (`RankReport`). The followers' side of this
is `worker/ranks.py`. A transfer is final for the engine only when every rank has reported it
(`OutcomeGate`): done when all succeeded, failed or cancelled when any did. When one rank fails
first, the others are cancelled at once rather than at their deadline.

While a transfer is in flight somewhere, rank 0 ticks every `RANK_POLL_S` even with nothing to
compute, since only a tick brings the other ranks' transfer states; an idle instance still ticks
every `HEARTBEAT_S`, so that no rank's collective waits long enough to time out.

A step that raises stops the instance (the exception leaves the loop): the other ranks may be
left inside one of the step's collectives, and nothing brings them back in step with rank 0.

Steps are synchronous here (`overlaps` is False): every rank takes its inputs from rank 0's
broadcast, so a step's tokens must be on rank 0's host before the next tick.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from trtdisagg.kv.block_pool import BlockCopy
from trtdisagg.transfer.protocol.sessions import TransferOutcome
from trtdisagg.worker.engine.local import BLOCKED_WAIT_S
from trtdisagg.worker.engine.ports import Launched, Transceiver
from trtdisagg.worker.engine.wakeup import Wakeup
from trtdisagg.worker.rank_group import HEARTBEAT_S, RankGroup
from trtdisagg.worker.rank_plan import (
    ItemInputs,
    OutcomeGate,
    RankReport,
    ReceiveCommand,
    SendCommand,
    Side,
    StepCommand,
)
from trtdisagg.worker.ranks import rank_outcomes
from trtdisagg.worker.runner import ModelRunner, StepOutput
from trtdisagg.worker.sampling import SampleSpec
from trtdisagg.worker.scheduler import StepPlan
from trtdisagg.worker.step_inputs import StepInputs, plan_items

# How often rank 0 ticks, with nothing to compute, while a transfer is in flight on some rank.
RANK_POLL_S = 0.002


@attrs.define(eq=False, kw_only=True)
class Outbox:
    """Transfer work rank 0 did since the last tick, for the other ranks to do at the next."""

    sends: list[SendCommand] = attrs.Factory(list)
    receives: list[ReceiveCommand] = attrs.Factory(list)
    cancels: list[int] = attrs.Factory(list)

    def __bool__(self) -> bool:
        return bool(self.sends or self.receives or self.cancels)

    def take(
        self, items: tuple[ItemInputs, ...], copies: tuple[BlockCopy, ...] = ()
    ) -> StepCommand:
        command = StepCommand(
            items=items,
            copies=copies,
            sends=tuple(self.sends),
            receives=tuple(self.receives),
            cancels=tuple(self.cancels),
        )
        self.sends.clear()
        self.receives.clear()
        self.cancels.clear()
        return command


@attrs.define(eq=False, kw_only=True)
class MultiRankDriver:
    group: RankGroup
    runner: ModelRunner
    wakeup: Wakeup
    transceiver: Transceiver | None
    # Every tick's reports, once gated: what else they carry (the followers' KV writes, for the
    # metrics; KV digests when test hooks are on) is for whoever built this driver.
    on_reports: Callable[[Sequence[RankReport]], None] = lambda reports: None
    clock: Callable[[], float] = time.monotonic
    _outbox: Outbox = attrs.field(factory=Outbox, alias="outbox")
    _gate: OutcomeGate = attrs.field(
        default=attrs.Factory(lambda self: OutcomeGate(world_size=self.group.world_size), True),
        alias="gate",
    )
    _merged: dict[Side, list[TransferOutcome]] = attrs.field(
        factory=lambda: {Side.SEND: [], Side.RECEIVE: []}, alias="merged"
    )
    _last_tick: float = attrs.field(default=attrs.Factory(lambda self: self.clock(), True))

    # Every rank must take the same inputs at every tick: steps stay synchronous.
    overlaps: bool = attrs.field(default=False, init=False)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield

    def inputs(self, plan: StepPlan) -> StepInputs:
        rows = tuple((item.request.request_id, item.samples) for item in plan.items)
        return StepInputs(
            rows=rows, items=plan_items(plan, self.runner.tokens_per_block), copies=plan.copies
        )

    async def launch(
        self, inputs: StepInputs, specs: dict[int, SampleSpec], *, after: Launched | None = None
    ) -> Launched:
        assert after is None, "multi-rank steps do not overlap"
        out = await self._tick(inputs.items, specs, inputs.copies)
        assert out is not None
        return Launched(done=out)

    async def finish(self, launched: Launched) -> StepOutput:
        assert launched.done is not None, "a multi-rank tick is done when it returns"
        return launched.done

    async def idle(self, *, has_work: bool, in_flight: bool) -> None:
        """Tick now if transfer work waits for the other ranks; else wait for a wake-up, and
        tick if transfers are in flight (their states come only with a tick) or the
        heartbeat is due."""
        if not self._outbox:
            in_flight = in_flight or len(self._gate) > 0
            if in_flight:
                wait = RANK_POLL_S
            elif has_work:
                wait = BLOCKED_WAIT_S
            else:
                wait = max(HEARTBEAT_S - (self.clock() - self._last_tick), 0.0)
            await self.wakeup.wait(wait)
            if not in_flight and self.clock() - self._last_tick < HEARTBEAT_S:
                return
        await self._tick((), {})

    async def _tick(
        self,
        items: tuple[ItemInputs, ...],
        specs: dict[int, SampleSpec],
        copies: tuple[BlockCopy, ...] = (),
    ) -> StepOutput | None:
        command = self._outbox.take(items, copies)
        local = RankReport(rank=0, outcomes=rank_outcomes(self.transceiver))
        group, runner = self.group, self.runner

        def tick() -> tuple[StepOutput | None, list[RankReport]]:
            group.broadcast_command(command)
            out = None
            if command.has_forward:
                runner.copy_blocks(command.copies)
                out = runner.execute_items(command.items, specs, group)
            return out, group.gather_reports(local)

        out, reports = await trio.to_thread.run_sync(tick, abandon_on_cancel=True)
        self._last_tick = self.clock()
        self._gate_outcomes(reports)
        self.on_reports(reports)
        return out

    def _gate_outcomes(self, reports: Sequence[RankReport]) -> None:
        """A transfer is final once every rank says so; one rank's failure cancels the rest."""
        for report in reports:
            for reported in report.outcomes:
                merged = self._gate.add(report.rank, reported)
                side, key = reported.side, reported.outcome.key
                if merged is not None:
                    self._merged[merged.side].append(merged.outcome)
                elif not reported.outcome.ok and self._gate.newly_failed(side, key):
                    # One rank failed: the others need not wait for their deadline.
                    self.cancel(key)

    # ---- TransferPort: here now, on the other ranks at the next tick ----

    def _transfers(self) -> Transceiver:
        if self.transceiver is None:
            raise AssertionError("transfer work on a worker whose cache_transceiver is disabled")
        return self.transceiver

    def receive(
        self,
        key: int,
        endpoint: str,
        block_ids: Sequence[int],
        num_tokens: int,
        ctx_instance: str | None,
    ) -> None:
        self._transfers().request_and_receive_async(
            key, endpoint, [list(block_ids)], num_tokens, ctx_instance=ctx_instance
        )
        self._outbox.receives.append(
            ReceiveCommand(
                key=key,
                endpoint=endpoint,
                block_ids=tuple(block_ids),
                num_tokens=num_tokens,
                ctx_instance=ctx_instance,
            )
        )

    def send(
        self, key: int, block_ids: Sequence[int], num_tokens: int, first_tokens: Sequence[int]
    ) -> None:
        transceiver = self._transfers()
        self.runner.kv_ready()  # the step's KV writes are in device memory before NIXL reads
        transceiver.respond_and_send_async(key, [list(block_ids)], num_tokens, first_tokens)
        self._outbox.sends.append(
            SendCommand(
                key=key,
                block_ids=tuple(block_ids),
                num_tokens=num_tokens,
                first_tokens=tuple(first_tokens),
            )
        )

    def abandon(self, key: int, reason: str) -> None:
        self._transfers().abandon_send(key, reason)

    def cancel(self, key: int) -> bool:
        self._transfers().cancel_request(key)
        self._outbox.cancels.append(key)
        return False  # every rank must settle first: the gated outcome says when

    def settled(self, key: int) -> bool:
        return False  # only the gated outcome says so

    def outcomes(self) -> tuple[list[TransferOutcome], list[TransferOutcome]]:
        receives, self._merged[Side.RECEIVE] = self._merged[Side.RECEIVE], []
        sends, self._merged[Side.SEND] = self._merged[Side.SEND], []
        return receives, sends
