"""The step driver of a one-rank worker: each forward in a worker thread, transfers at once."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import attrs
import trio

from trtdisagg.transfer.protocol.sessions import TransferOutcome
from trtdisagg.worker.engine.ports import StepFailed, Transceiver
from trtdisagg.worker.engine.wakeup import Wakeup
from trtdisagg.worker.runner import StepOutput
from trtdisagg.worker.sampling import SampleSpec
from trtdisagg.worker.scheduler import StepPlan

# With requests waiting for blocks that a transfer or another request holds, how long the loop
# waits before it schedules again if nothing wakes it: do not spin.
BLOCKED_WAIT_S = 0.01


class StepRunner(Protocol):
    """What the local driver needs of `ModelRunner` (a test hook may wrap it)."""

    def execute(self, plan: StepPlan, specs: dict[int, SampleSpec]) -> StepOutput: ...

    def kv_ready(self) -> None: ...


@attrs.define(eq=False, kw_only=True)
class LocalDriver:
    runner: StepRunner
    wakeup: Wakeup
    transceiver: Transceiver | None  # None: cache_transceiver disabled (no disaggregated legs)

    async def step(self, plan: StepPlan, specs: dict[int, SampleSpec]) -> StepOutput:
        try:
            return await trio.to_thread.run_sync(self.runner.execute, plan, specs)
        except Exception as exc:
            # One rank ran it and nothing else changed meanwhile: only this step is lost.
            raise StepFailed(exc) from exc

    async def idle(self, *, has_work: bool, in_flight: bool) -> None:
        # A transfer's end wakes the loop through the transceiver's `wake`.
        await self.wakeup.wait(BLOCKED_WAIT_S if has_work else math.inf)

    # ---- TransferPort ----

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

    def prepare(self, key: int, block_ids: Sequence[int], num_tokens: int) -> None:
        self._transfers().prepare_send(key, [list(block_ids)], num_tokens)

    def send(
        self, key: int, block_ids: Sequence[int], num_tokens: int, first_tokens: Sequence[int]
    ) -> None:
        transceiver = self._transfers()
        self.runner.kv_ready()  # the step's KV writes are in device memory before NIXL reads
        transceiver.respond_and_send_async(key, [list(block_ids)], num_tokens, first_tokens)

    def abandon(self, key: int, reason: str) -> None:
        self._transfers().abandon_send(key, reason)

    def cancel(self, key: int) -> bool:
        return self._transfers().cancel_request(key)

    def settled(self, key: int) -> bool:
        return self._transfers().cancel_request(key)

    def outcomes(self) -> tuple[list[TransferOutcome], list[TransferOutcome]]:
        if self.transceiver is None:
            return [], []
        return (
            self.transceiver.check_gen_transfer_status(),
            self.transceiver.check_context_transfer_status(),
        )
