"""The step driver of a one-rank worker: steps launched and finished in worker threads, transfers
at once.

Launching runs the runner's host work and kernel launches in a worker thread, and then, in the
same thread, waits until the step launched before it has its tokens on the host: one trip off the
Trio loop per step. With `overlaps` the loop launches step N+1 before it processes step N's
outputs (`loop.py`); the device runs step N+1 meanwhile. A CPU runner's forward is its launch:
its steps go to a `HostStream`, whose thread plays the device's part.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

import attrs
import trio

from trtdisagg.transfer.protocol.sessions import TransferOutcome
from trtdisagg.worker.engine.host_stream import HostStream
from trtdisagg.worker.engine.ports import Launched, StepFailed, StepSkipped, Transceiver
from trtdisagg.worker.engine.wakeup import Wakeup
from trtdisagg.worker.launched import LaunchedStep, StepOutput
from trtdisagg.worker.sampling import SampleSpec
from trtdisagg.worker.scheduler import StepPlan
from trtdisagg.worker.step_inputs import StepInputs

# With requests waiting for blocks that a transfer or another request holds, how long the loop
# waits before it schedules again if nothing wakes it: do not spin.
BLOCKED_WAIT_S = 0.01


def _failed(exc: Exception) -> StepFailed:
    failure = StepFailed(exc)
    failure.__cause__ = exc
    return failure


class StepRunner(Protocol):
    """What the local driver needs of `ModelRunner` (a test hook may wrap it)."""

    def prepare(self, plan: StepPlan) -> StepInputs: ...

    def launch(self, inputs: StepInputs, specs: dict[int, SampleSpec]) -> LaunchedStep: ...

    def finish(self, launched: LaunchedStep) -> StepOutput: ...

    def kv_ready(self) -> None: ...

    def lost(self) -> None: ...


@attrs.define(eq=False, kw_only=True)
class LocalDriver:
    runner: StepRunner
    wakeup: Wakeup
    transceiver: Transceiver | None  # None: cache_transceiver disabled (no disaggregated legs)
    overlaps: bool = True  # config `async_scheduling`
    host_stream: HostStream | None = None  # a CPU runner's: its steps compute there

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        if self.host_stream is None:
            yield
            return
        async with self.host_stream.open():
            yield

    def inputs(self, plan: StepPlan) -> StepInputs:
        return self.runner.prepare(plan)

    async def launch(
        self, inputs: StepInputs, specs: dict[int, SampleSpec], *, after: Launched | None = None
    ) -> Launched:
        if self.host_stream is not None:
            runner = self.runner
            only_late = bool(inputs.late) and len(inputs.late) == len(inputs.rows)
            step = self.host_stream.submit(
                lambda: runner.launch(inputs, specs), only_late=only_late
            )
            launched = Launched(on_host=step)
            if after is not None and after.on_host is not None:
                await after.on_host.done.wait()
            return launched
        previous = after.queued if after is not None else None
        launched = Launched()

        def launch_then_wait() -> None:
            try:
                launched.queued = self.runner.launch(inputs, specs)
            except Exception as exc:
                # One rank ran it and nothing else changed meanwhile: only this step is lost.
                launched.failure = _failed(exc)
            if previous is not None and after is not None:
                try:
                    previous.wait()
                except Exception as exc:  # a CUDA error surfaces at the step's first sync
                    after.wait_failure = _failed(exc)

        await trio.to_thread.run_sync(launch_then_wait)
        return launched

    async def finish(self, launched: Launched) -> StepOutput:
        if launched.on_host is not None:
            try:
                computed = await launched.on_host.result()
            except StepSkipped:
                raise
            except Exception as exc:
                raise _failed(exc) from exc
            return self.runner.finish(computed)
        queued = launched.queued
        assert queued is not None, "a one-rank step that launched is queued"
        try:
            if launched.wait_failure is not None:
                raise launched.wait_failure
            if not queued.done:
                await trio.to_thread.run_sync(queued.wait)
            return self.runner.finish(queued)
        except StepFailed:
            raise
        except Exception as exc:  # a CUDA error surfaces at the step's first sync
            raise _failed(exc) from exc

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
