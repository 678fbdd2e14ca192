"""The engine's edges as protocols: the transceiver it calls, and what a step driver does (pure).

`StepDriver` is what differs between one rank and many, so the loop (`loop.py`) is written once:
a driver runs each step's forward (`local.LocalDriver` in a worker thread; `multi_rank.
MultiRankDriver` on every rank together) and carries out transfer work on every rank
(`TransferPort`). The tracker decides transfer work; only a driver does it.

`Transceiver` lists exactly the `KvTransceiver` methods the engine calls, so that the transfer
layer may change behind them, and so that a test hook can wrap them (`test_hooks.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol

import attrs

if TYPE_CHECKING:
    from trtdisagg.transfer.protocol.sessions import TransferOutcome
    from trtdisagg.worker.engine.host_stream import HostStep
    from trtdisagg.worker.launched import LaunchedStep, StepOutput
    from trtdisagg.worker.sampling import SampleSpec
    from trtdisagg.worker.scheduler import StepPlan
    from trtdisagg.worker.step_inputs import StepInputs


class StepSkipped(Exception):
    """A step that was not computed: each of its requests failed with the step before it (a
    CPU runner's host stream had it queued before that step's outcome was known)."""


class StepFailed(Exception):
    """The forward of one step raised, and only that step's requests are lost (one rank: nothing
    else ran or changed). A driver raises anything else when the step may have left the
    instance inconsistent (ranks out of step), and the loop then stops."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class Transceiver(Protocol):
    """The KV transceiver calls the engine makes (`transfer/runtime/driver.py` documents them)."""

    def respond_and_send_async(
        self,
        key: int,
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        first_tokens: Sequence[int] = (),
    ) -> None: ...

    def abandon_send(self, key: int, reason: str) -> None: ...

    def check_context_transfer_status(self) -> list[TransferOutcome]: ...

    def request_and_receive_async(
        self,
        key: int,
        ctx_info_endpoint: str,
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        *,
        ctx_instance: str | None = None,
    ) -> None: ...

    def check_gen_transfer_status(self) -> list[TransferOutcome]: ...

    def cancel_request(self, key: int) -> bool: ...


class TransferPort(Protocol):
    """Transfer work, done on every rank of the instance (blocks are one list: one KV group)."""

    def receive(
        self,
        key: int,
        endpoint: str,
        block_ids: Sequence[int],
        num_tokens: int,
        ctx_instance: str | None,
    ) -> None:
        """gen: ask the ctx at `endpoint` to write `key`'s KV into `block_ids`."""

    def send(
        self, key: int, block_ids: Sequence[int], num_tokens: int, first_tokens: Sequence[int]
    ) -> None:
        """ctx: `key`'s KV is in `block_ids`; write it to the gen that asks."""

    def abandon(self, key: int, reason: str) -> None:
        """ctx: `key`'s request ended before its KV was ready; refuse a gen that asked."""

    def cancel(self, key: int) -> bool:
        """Stop transfer `key`. True when no write can land in (or read from) its blocks any
        more on any rank; False when that is for a later `settled` or outcome to say."""

    def settled(self, key: int) -> bool:
        """A cancelled transfer: whether no write can reach its blocks any more. False also
        when only the transfer's outcome can say so (every rank must report it)."""

    def outcomes(self) -> tuple[list[TransferOutcome], list[TransferOutcome]]:
        """Transfers that reached a final state on every rank: (receives, sends)."""


@attrs.define(eq=False, kw_only=True)
class Launched:
    """A step a driver launched: queued on the device (one rank) or on the host stream (one
    CPU rank), or already done (a tick of a multi-rank instance), or failed at its launch. The
    driver's `finish` brings its output."""

    queued: LaunchedStep | None = None
    on_host: HostStep | None = None
    done: StepOutput | None = None
    failure: StepFailed | None = None  # its launch raised: only its requests are lost
    wait_failure: StepFailed | None = None  # waiting for its tokens raised (a CUDA error)


class StepDriver(TransferPort, Protocol):
    """Runs the engine's steps and transfer work on the instance's ranks."""

    @property
    def overlaps(self) -> bool:
        """Whether the loop may launch the next step before it finished this one (the next
        step's decode rows then read their tokens on the device)."""

    def running(self) -> AbstractAsyncContextManager[None]:
        """The driver's own machinery (a CPU runner's `HostStream`), for the loop's lifetime."""

    def inputs(self, plan: StepPlan) -> StepInputs:
        """The step's host-side inputs, taken from the plan before the step launches (the
        plan's requests may change while it runs)."""

    async def launch(
        self, inputs: StepInputs, specs: dict[int, SampleSpec], *, after: Launched | None = None
    ) -> Launched:
        """Queue one step's forward and sampling; then wait until `after` (the step launched
        before, when it overlaps) has its tokens on the host. A launch that raises, when only
        this step is lost, comes back as `failure`."""

    async def finish(self, launched: Launched) -> StepOutput:
        """The sampled tokens of a launched step, once they are on the host. Raises StepFailed
        when only this step is lost."""

    async def idle(self, *, has_work: bool, in_flight: bool) -> None:
        """Nothing to compute now: wait for a wake-up. `has_work`: requests wait for blocks;
        `in_flight`: transfers are not final yet."""
