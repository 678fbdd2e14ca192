"""The executor loop: one per process, explicit steps each iteration.

    admit     commands from HTTP handlers (new requests, aborts) enter the scheduler
    receive   generation_only requests get blocks, then `request_and_receive_async`
    poll      finished transfers: gen requests whose KV landed start decoding; ctx requests
              whose KV was sent (or failed, or timed out) free their pinned blocks
    schedule  the scheduler picks decode tokens and prefill chunks within the step budget
    forward   the runner builds tensors, runs the model and samples, in a worker thread
    respond   sampled tokens are appended, stop rules checked, outputs sent to the handlers;
              a context_only request's first token ends its HTTP answer and starts the send

A step whose forward raises fails only the requests in it (500, with the cause), frees their
blocks and leaves the worker serving; `MAX_CONSECUTIVE_STEP_FAILURES` failed steps in a row stop
it (`stopped`, and /health answers 503), since a fault that outlives a step is the worker's.

Handlers never touch the scheduler directly: they queue commands, which the loop applies between
steps. So the scheduler is only ever changed while no forward is in flight, and a block is never
freed under a running kernel.

A request's outputs go to its handler through an unbounded memory channel: a slow client must
never stall the loop. An abandoned handler simply aborts its request.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator

import attrs
import trio
from prometheus_client import Counter

from trtdisagg.api.protocol import PerfMetrics
from trtdisagg.errors import CapacityError, WorkerStopped
from trtdisagg.metrics import WorkerMetrics
from trtdisagg.transfer.protocol.sessions import TransferOutcome
from trtdisagg.transfer.runtime.driver import KvTransceiver
from trtdisagg.worker.rank_group import HEARTBEAT_S, RankGroup
from trtdisagg.worker.rank_plan import (
    DigestCommand,
    HeadDigest,
    ItemInputs,
    OutcomeGate,
    RankDigest,
    RankReport,
    ReceiveCommand,
    SendCommand,
    Side,
    StepCommand,
)
from trtdisagg.worker.ranks import rank_outcomes
from trtdisagg.worker.request import FinishReason, Request, RequestType
from trtdisagg.worker.runner import ModelRunner, Sampled, StepOutput, plan_items
from trtdisagg.worker.sampling import SampleSpec, TokenLogprobs, make_generator
from trtdisagg.worker.scheduler import Scheduler, StepPlan
from trtdisagg.worker.stopping import StopStrings
from trtdisagg.worker.test_hooks import TestHooks, fail_step
from trtdisagg.worker.tokenization import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

# Multi-rank: how often rank 0 ticks, with nothing to compute, while a transfer is in flight on
# some rank (only a tick brings the other ranks' transfer states).
RANK_POLL_S = 0.002

# Why a context_only request ended without sending its KV, as gen's error says it.
_ENDED: dict[FinishReason, str] = {
    FinishReason.ABORT: "it was aborted",
    FinishReason.ERROR: "it failed",
    FinishReason.STOP: "it finished at its first token (stop), so there is nothing to decode",
    FinishReason.LENGTH: "it finished at its first token (length), so there is nothing to decode",
}

# Failed model steps in a row after which the worker stops serving. One failed step may be a
# request's doing (an input no test foresaw); the same failure three times over, whatever the
# batch, is the worker's own (a sticky CUDA error, memory it cannot get back).
MAX_CONSECUTIVE_STEP_FAILURES = 3


@attrs.frozen(kw_only=True)
class RequestOutput:
    """What one step produced for one request; the last one carries `finish_reason`."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs | None, ...]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    error: str | None = None
    # With `error`: the worker's own failure (a model step raised), a 500 even on gen, where an
    # error otherwise means the KV could not come from ctx (502).
    internal: bool = False
    perf: PerfMetrics | None = None
    context_done: bool = False  # context_only: prefill done, KV pinned for gen; answer now


@attrs.frozen(kw_only=True)
class GenerationSource:
    """Where a generation_only request's KV and first token come from (ctx's answer)."""

    key: int  # disagg_request_id: the transfer key
    ctx_info_endpoint: str
    first_token: int | None  # None: generation_first, the token comes with the KV
    ctx_instance: str | None = None  # the ctx instance that answered, if it said (handoff.py)


@attrs.define(eq=False, kw_only=True)
class _Live:
    request: Request
    send: trio.MemorySendChannel[RequestOutput]
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    spec: SampleSpec
    source: GenerationSource | None = None
    transfer_key: int | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    transfer_bytes: int | None = None
    transfer_s: float | None = None


@attrs.define(eq=False, kw_only=True)
class _Outbox:
    """Transfer work rank 0 decided since the last step, for the other ranks to apply."""

    sends: list[SendCommand] = attrs.Factory(list)
    prepares: list[SendCommand] = attrs.Factory(list)
    receives: list[ReceiveCommand] = attrs.Factory(list)
    cancels: list[int] = attrs.Factory(list)
    digests: list[DigestCommand] = attrs.Factory(list)

    def __bool__(self) -> bool:
        return bool(self.sends or self.prepares or self.receives or self.cancels or self.digests)

    def take(self, items: tuple[ItemInputs, ...] = ()) -> StepCommand:
        command = StepCommand(
            items=items,
            sends=tuple(self.sends),
            prepares=tuple(self.prepares),
            receives=tuple(self.receives),
            cancels=tuple(self.cancels),
            digests=tuple(self.digests),
        )
        self.sends.clear()
        self.prepares.clear()
        self.receives.clear()
        self.cancels.clear()
        self.digests.clear()
        return command


@attrs.define(eq=False, kw_only=True)
class RequestHandle:
    request: Request
    outputs: trio.MemoryReceiveChannel[RequestOutput]


@attrs.define(eq=False, kw_only=True)
class Executor:
    scheduler: Scheduler
    runner: ModelRunner
    tokenizer: Tokenizer
    metrics: WorkerMetrics
    role: str
    max_seq_len: int
    transceiver: KvTransceiver | None = None
    test_hooks: TestHooks | None = None
    clock: Callable[[], float] = time.monotonic
    _live: dict[int, _Live] = attrs.field(factory=dict, alias="live")
    _new: list[_Live] = attrs.field(factory=list, alias="new")
    _aborts: list[int] = attrs.field(factory=list, alias="aborts")
    _releases: list[int] = attrs.field(factory=list, alias="releases")  # ctx: transfer keys
    _pending_gen: collections.deque[_Live] = attrs.field(
        factory=collections.deque, alias="pending_gen"
    )
    _receiving: dict[int, _Live] = attrs.field(factory=dict, alias="receiving")
    _sending: dict[int, Request] = attrs.field(factory=dict, alias="sending")
    _cancelling: dict[int, _Live] = attrs.field(factory=dict, alias="cancelling")
    _synced: dict[str, float] = attrs.field(factory=dict, alias="synced")
    _wake: trio.Event = attrs.field(factory=trio.Event, alias="wake")
    steps: int = 0
    _stepping: bool = False  # a step (or a multi-rank tick) runs in a worker thread
    # Why this worker stopped serving (too many failed steps in a row); None while it serves.
    stopped: str | None = None
    _failed_steps: int = attrs.field(default=0, alias="failed_steps")  # in a row
    # Multi-rank instances: this is rank 0, which schedules; the other ranks follow its steps.
    ranks: RankGroup | None = None
    _outbox: _Outbox = attrs.field(factory=lambda: _Outbox(), alias="outbox")
    _gate: OutcomeGate | None = attrs.field(default=None, alias="gate")
    _merged: dict[Side, list[TransferOutcome]] = attrs.field(
        factory=lambda: {Side.SEND: [], Side.RECEIVE: []}, alias="merged"
    )

    # ---- commands from handlers (sync, never block) ----

    def submit(
        self,
        request: Request,
        *,
        source: GenerationSource | None = None,
        transfer_key: int | None = None,
    ) -> RequestHandle:
        """Queue a request. Raises CapacityError if it could never fit, so the caller can 400.

        `source` is required for generation_only requests, `transfer_key` for context_only.
        Raises WorkerStopped once the worker stopped serving, so the caller can 503.
        """
        if self.stopped is not None:
            raise WorkerStopped(f"this worker stopped serving: {self.stopped}")
        self._check_fits(request)
        send, receive = trio.open_memory_channel[RequestOutput](math.inf)
        params = request.sampling
        eos = frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
        spec = SampleSpec(
            params=params,
            generator=make_generator(params.seed, self.runner.device),
            suppress=eos if params.min_tokens > 0 else frozenset(),
        )
        live = _Live(
            request=request,
            send=send,
            detokenizer=self.tokenizer.incremental_detokenizer(),
            stops=StopStrings(stops=params.stop),
            spec=spec,
            source=source,
            transfer_key=transfer_key,
        )
        self._new.append(live)
        self._wake.set()
        return RequestHandle(request=request, outputs=receive)

    def abort(self, request_id: int) -> None:
        self._aborts.append(request_id)
        self._wake.set()

    def release_send(self, key: int) -> bool:
        """ctx: the coordinator gave up on the gen leg of transfer `key` before any gen took
        its KV (no gen, refused, unreachable, or its client left): stop holding the KV now, as
        a gen's CANCEL would, not at `kv_transfer_timeout_ms`. A write already in flight runs
        to its end first. False when no request of this worker holds KV under `key`."""
        if key not in self._sending:
            return False
        self._releases.append(key)
        self._wake.set()
        return True

    def wake(self) -> None:
        self._wake.set()

    def num_active(self) -> int:
        return len(self._live) + len(self._new)

    def num_transfers(self) -> int:
        return len(self._receiving) + len(self._sending) + len(self._cancelling)

    def transfer_key_in_use(self, key: int, *, sending: bool) -> bool:
        """Whether a request of this worker already sends (ctx) or receives (gen) under `key`.

        A second one would share the first one's transfer session and mix two requests' KV
        (DESIGN.md §6), so the HTTP layer refuses it. One worker may send and receive the same
        key (it is then its own ctx and gen), hence the side.
        """
        lives = [*self._new, *self._live.values()]
        if sending:
            return key in self._sending or any(live.transfer_key == key for live in lives)
        busy = key in self._receiving or key in self._cancelling
        return busy or any(live.source is not None and live.source.key == key for live in lives)

    def _check_fits(self, request: Request) -> None:
        pool = self.scheduler.pool
        capacity = pool.num_blocks * pool.tokens_per_block
        if request.num_prompt_tokens >= self.max_seq_len:
            raise CapacityError(
                f"prompt has {request.num_prompt_tokens} tokens; this model's context is "
                f"{self.max_seq_len} tokens"
            )
        if request.num_prompt_tokens + 1 > capacity:
            raise CapacityError(
                f"prompt has {request.num_prompt_tokens} tokens; the KV cache holds {capacity}"
            )

    # ---- the loop ----

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        if self.ranks is not None:
            await self._lead(self.ranks)
            return
        while True:
            self._admit()
            self._poll_transfers()
            self._receive()
            if not self.scheduler.has_work():
                self.refresh_gauges()
                await self._wait_for_work()
                continue
            plan = self.scheduler.schedule()
            if plan.preempted:
                self.metrics.preemptions.inc(len(plan.preempted))
            self._finish_dropped(plan)
            if not plan.items:
                # Nothing fits this step (waiting for KV to free up elsewhere): do not spin.
                await self._wait_for_work(timeout=0.01)
                continue
            specs = self._specs_for(plan)
            self._prepare_sends(plan)
            out = await self._forward(plan, specs)
            if out is None:
                continue
            self.steps += 1
            self.scheduler.step_done(plan)
            self._respond(plan, out)
            self.refresh_gauges()

    async def _forward(self, plan: StepPlan, specs: dict[int, SampleSpec]) -> StepOutput | None:
        """The step's forward, off the loop; None when it raised and its requests were failed."""
        execute: Callable[[StepPlan, dict[int, SampleSpec]], StepOutput] = self.runner.execute
        if self.test_hooks is not None and self.test_hooks.take_step_failure():
            execute = fail_step
        try:
            with self._step_running():
                out = await trio.to_thread.run_sync(execute, plan, specs)
        except Exception as exc:
            self._step_failed(plan, exc)
            return None
        self._failed_steps = 0
        return out

    def _step_failed(self, plan: StepPlan, exc: Exception) -> None:
        """Fail the requests of the step that raised; the others go on.

        Their tokens were never sampled and their KV may be half written, so they cannot resume;
        nothing else was touched by the step. They end as an abort does (`_end`: blocks freed,
        transfer state released), with the cause in their error.
        """
        self._failed_steps += 1
        self.metrics.step_failures.inc()
        cause = f"{type(exc).__name__}: {exc}"
        log.exception(
            "model step failed (%d in a row), failing the %d requests in it: %s",
            self._failed_steps,
            len(plan.items),
            cause,
            exc_info=exc,
        )
        now = self.clock()
        for item in plan.items:
            live = self._live.get(item.request.request_id)
            if live is not None:
                self._fail(live, f"internal error in the model step: {cause}", now)
        self.scheduler.step_done(plan)  # no item is RUNNING any more: this only closes the plan
        if self._failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
            self._stop_serving(cause)
        self.refresh_gauges()

    def _stop_serving(self, cause: str) -> None:
        """Steps keep failing whatever they hold: fail every request and take no new one.

        The worker stays up, answering 503 on /health with the reason, rather than exiting: the
        coordinator's health checks already take a 503 server out of rotation (and retry its
        5xx answers elsewhere), whereas an exit would end every process under `up`, which
        stops the whole cluster when one child dies. Its metrics and log stay readable, and the
        transfers it still owes (ctx sends in flight) settle; whoever supervises it restarts it.
        """
        self.stopped = f"{self._failed_steps} model steps failed in a row; the last: {cause}"
        log.error("worker stopped serving: %s; /health answers 503 until a restart", self.stopped)
        now = self.clock()
        self._admit()  # requests submitted during the failed step are failed too
        error = f"this worker stopped serving: {self.stopped}"
        for live in list(self._live.values()):
            self._fail(live, error, now)

    # ---- multi-rank: rank 0 leads every step ----

    async def _lead(self, group: RankGroup) -> None:
        """The loop of rank 0 of a multi-rank instance.

        Same steps as `run`, but each one is a tick that every rank takes together: rank 0
        broadcasts the step's inputs and transfer work, all ranks run their shard of the
        forward, and all report the transfers they finished. While transfers are in flight
        somewhere, rank 0 ticks every few milliseconds even with nothing to compute, since only
        a tick tells it what the other ranks' transceivers did; an idle instance still ticks
        every HEARTBEAT_S, so no rank's collective waits long enough to time out.

        Unlike `run`, a step that raises here still stops the instance: the other ranks may be
        left inside one of the step's collectives, and nothing brings them back in step with
        rank 0, so failing only that step's requests would leave the ranks out of step.
        """
        self._gate = OutcomeGate(world_size=group.world_size)
        last_tick = self.clock()
        while True:
            self._admit()
            self._poll_transfers()
            self._receive()
            plan: StepPlan | None = None
            if self.scheduler.has_work():
                plan = self.scheduler.schedule()
                if plan.preempted:
                    self.metrics.preemptions.inc(len(plan.preempted))
                self._finish_dropped(plan)
                if not plan.items:
                    plan = None
            if plan is None and not self._outbox:
                in_flight = self.num_transfers() > 0 or len(self._gate) > 0
                if in_flight:
                    wait = RANK_POLL_S
                elif self.scheduler.has_work():
                    wait = 0.01  # nothing fits this step: do not spin
                else:
                    wait = max(HEARTBEAT_S - (self.clock() - last_tick), 0.0)
                self.refresh_gauges()
                await self._wait_for_work(timeout=wait)
                if not in_flight and self.clock() - last_tick < HEARTBEAT_S:
                    continue
            if plan is not None:
                self._prepare_sends(plan)  # here now, on the other ranks with the command
            await self._tick(group, plan)
            last_tick = self.clock()

    async def _tick(self, group: RankGroup, plan: StepPlan | None) -> None:
        items = plan_items(plan, self.runner.tokens_per_block) if plan is not None else ()
        command = self._outbox.take(items)
        specs = self._specs_for(plan) if plan is not None else {}
        local = RankReport(
            rank=0,
            outcomes=rank_outcomes(self.transceiver),
            digests=self._local_digests(command),
        )

        def tick() -> tuple[StepOutput | None, list[RankReport]]:
            group.broadcast_command(command)
            out = None
            if command.has_forward:
                out = self.runner.execute_items(command.items, specs, group)
            return out, group.gather_reports(local)

        with self._step_running():
            out, reports = await trio.to_thread.run_sync(tick, abandon_on_cancel=True)
        self._apply_reports(reports)
        if plan is not None and out is not None:
            self.steps += 1
            self.scheduler.step_done(plan)
            self._respond(plan, out)
        self.refresh_gauges()

    def _local_digests(self, command: StepCommand) -> tuple[RankDigest, ...]:
        if self.test_hooks is None:
            return ()
        hooks, cache = self.test_hooks, self.runner.cache
        return tuple(
            RankDigest(key=d.key, parts=hooks.local_parts(cache, list(d.block_ids), d.num_tokens))
            for d in command.digests
        )

    def _apply_reports(self, reports: list[RankReport]) -> None:
        """Gate every rank's finished transfers: a transfer is final once all ranks say so."""
        assert self._gate is not None
        digests: dict[int, list[HeadDigest]] = {}
        for report in reports:
            for reported in report.outcomes:
                merged = self._gate.add(report.rank, reported)
                side, key = reported.side, reported.outcome.key
                if merged is not None:
                    self._merged[merged.side].append(merged.outcome)
                elif not reported.outcome.ok and self._gate.newly_failed(side, key):
                    # One rank failed: the others need not wait for their deadline.
                    self._queue_cancel(key)
            for rank_digest in report.digests:
                digests.setdefault(rank_digest.key, []).extend(rank_digest.parts)
            if self.transceiver is not None:  # the followers' writes (rank 0 counts its own)
                for write in report.writes:
                    count = self.transceiver.count_write
                    count(write.num_bytes, write.num_descriptors, write.seconds)
        if self.test_hooks is not None:
            for key, parts in digests.items():
                self.test_hooks.store(key, parts)

    def _queue_cancel(self, key: int) -> None:
        """Cancel transfer `key` on every rank (here now, the others at the next tick)."""
        assert self.transceiver is not None
        self.transceiver.cancel_request(key)
        self._outbox.cancels.append(key)

    async def _wait_for_work(self, timeout: float = math.inf) -> None:
        with trio.move_on_after(timeout):
            await self._wake.wait()
        self._wake = trio.Event()

    def _admit(self) -> None:
        now = self.clock()
        for live in self._new:
            self._live[live.request.request_id] = live
            if live.source is not None:
                self._pending_gen.append(live)
            else:
                self.scheduler.add(live.request)
        self._new.clear()
        for request_id in self._aborts:
            aborted = self._live.get(request_id)
            if aborted is None:
                continue
            self._abort(aborted, now)
        self._aborts.clear()
        for key in self._releases:
            if key not in self._sending:
                continue  # its transfer ended meanwhile
            log.info("KV send %d released: its gen leg never took it", key)
            self.metrics.kv_sends_released.inc()
            if self.ranks is not None:
                self._queue_cancel(key)
            else:
                assert self.transceiver is not None
                self.transceiver.cancel_request(key)
        self._releases.clear()

    def _abort(self, live: _Live, now: float) -> None:
        request = live.request
        log.info(
            "request %d aborted by its client (state %s, %d tokens out)",
            request.request_id,
            request.state.value,
            len(request.output_token_ids),
        )
        self._end(live, FinishReason.ABORT, now)

    def _fail(self, live: _Live, error: str, now: float) -> None:
        """End a request with an internal error (a 500 to its client), wherever it is."""
        self._emit(live, (), "", (), FinishReason.ERROR, now, error=error, internal=True)
        self._end(live, FinishReason.ERROR, now, emitted=True)

    def _end(self, live: _Live, reason: FinishReason, now: float, *, emitted: bool = False) -> None:
        """End a live request wherever it is; its blocks are freed once no write can reach them."""
        request = live.request
        if live in self._pending_gen:
            self._pending_gen.remove(live)
        elif live.source is not None and live.source.key in self._receiving:
            # KV may still be landing in these blocks: free them only once no write can.
            del self._receiving[live.source.key]
            assert self.transceiver is not None
            if self.ranks is not None:
                # Every rank must settle before the blocks are free: the merged outcome says so.
                self._queue_cancel(live.source.key)
                self._cancelling[live.source.key] = live
                self._close(live, reason, now, emitted=emitted)
                return
            if not self.transceiver.cancel_request(live.source.key):
                self._cancelling[live.source.key] = live
                self._close(live, reason, now, emitted=emitted)
                return
            self.scheduler.abort(request.request_id)
        elif not request.is_finished:
            self.scheduler.abort(request.request_id)
        self._close(live, reason, now, emitted=emitted)

    # ---- disaggregation: receive and poll ----

    def _receive(self) -> None:
        """Give waiting generation_only requests blocks, then ask ctx for their KV."""
        while self._pending_gen:
            live = self._pending_gen[0]
            if not self.scheduler.add_generation_only(live.request):
                return
            self._pending_gen.popleft()
            source = live.source
            table = live.request.block_table
            assert source is not None and table is not None and self.transceiver is not None
            self._receiving[source.key] = live
            self.transceiver.request_and_receive_async(
                source.key,
                source.ctx_info_endpoint,
                [list(table.block_ids)],
                live.request.num_prompt_tokens,
                ctx_instance=source.ctx_instance,
            )
            if self.ranks is not None:
                self._outbox.receives.append(
                    ReceiveCommand(
                        key=source.key,
                        endpoint=source.ctx_info_endpoint,
                        block_ids=tuple(table.block_ids),
                        num_tokens=live.request.num_prompt_tokens,
                        ctx_instance=source.ctx_instance,
                    )
                )

    def _poll_transfers(self) -> None:
        if self.transceiver is None:
            return
        now = self.clock()
        for outcome in self._finished_transfers(Side.RECEIVE):
            if outcome.key in self._cancelling:
                live = self._cancelling.pop(outcome.key)
                self.scheduler.abort(live.request.request_id)
                continue
            receiving = self._receiving.pop(outcome.key, None)
            if receiving is None:
                continue
            self._count_transfer(outcome.ok, outcome.num_bytes, outcome.num_descriptors)
            receiving.transfer_bytes, receiving.transfer_s = outcome.num_bytes, outcome.seconds
            if outcome.ok:
                self._kv_arrived(receiving, outcome, now)
            else:
                if outcome.blocks_held:
                    # A ctx write may still land: the request fails now, its blocks stay
                    # quarantined until cancel_request(key) says no write can.
                    self._cancelling[outcome.key] = receiving
                else:
                    self.scheduler.finish(receiving.request, FinishReason.ERROR)
                error = outcome.error or "KV transfer failed"
                self._emit(receiving, (), "", (), FinishReason.ERROR, now, error=error)
                self._close(receiving, FinishReason.ERROR, now, emitted=True)
        if self.ranks is None:
            for key in list(self._cancelling):
                if self.transceiver.cancel_request(key):
                    self.scheduler.abort(self._cancelling.pop(key).request.request_id)
        for outcome in self._finished_transfers(Side.SEND):
            request = self._sending.pop(outcome.key, None)
            if request is None:
                continue
            if not outcome.ok and not outcome.cancelled:
                self.metrics.kv_transfer_failures.inc()
                log.warning("KV send %d failed: %s", outcome.key, outcome.error)
            reason = FinishReason.STOP if outcome.ok else FinishReason.ABORT
            self.scheduler.release(request, reason)

    def _finished_transfers(self, side: Side) -> list[TransferOutcome]:
        """Transfers that reached a final state: this process's, or every rank's (gated)."""
        assert self.transceiver is not None
        if self.ranks is not None:
            done, self._merged[side] = self._merged[side], []
            return done
        if side is Side.RECEIVE:
            return self.transceiver.check_gen_transfer_status()
        return self.transceiver.check_context_transfer_status()

    def _record_digest(self, key: int, block_ids: tuple[int, ...], num_tokens: int) -> None:
        if self.test_hooks is None:
            return
        if self.ranks is not None:  # every rank digests its share at the next tick
            self._outbox.digests.append(
                DigestCommand(key=key, block_ids=block_ids, num_tokens=num_tokens)
            )
        else:
            self.test_hooks.record(key, self.runner.cache, block_ids, num_tokens)

    def _count_transfer(self, ok: bool, num_bytes: int, descriptors: int) -> None:
        if not ok:
            self.metrics.kv_transfer_failures.inc()

    def _kv_arrived(self, live: _Live, outcome: TransferOutcome, now: float) -> None:
        """gen: the prompt's KV landed; the first token is ctx's, decoding starts next step."""
        source = live.source
        assert source is not None
        request = live.request
        token = source.first_token
        if token is None:  # generation_first: ctx sent it with the KV
            token = outcome.first_tokens[0] if outcome.first_tokens else None
        if token is None or not 0 <= token < self.tokenizer.vocab_size:
            error = (
                f"KV transfer {source.key}: ctx sent no first token"
                if token is None
                else f"KV transfer {source.key}: ctx's first token {token} is outside the "
                f"vocabulary ({self.tokenizer.vocab_size})"
            )
            self.metrics.kv_transfer_failures.inc()
            self.scheduler.finish(request, FinishReason.ERROR)
            self._emit(live, (), "", (), FinishReason.ERROR, now, error=error)
            self._close(live, FinishReason.ERROR, now, emitted=True)
            return
        self.scheduler.kv_received(request, token)
        table = request.block_table
        assert table is not None
        self._record_digest(source.key, tuple(table.block_ids), request.num_prompt_tokens)
        self._after_token(live, token, None, now)

    def _start_send(self, live: _Live, now: float) -> None:
        """ctx: the first token is out; pin the blocks and answer, the KV goes when gen asks."""
        request = live.request
        key = live.transfer_key
        table = request.block_table
        assert key is not None and table is not None and self.transceiver is not None
        self.scheduler.hold_for_transfer(request)
        self._sending[key] = request
        self._record_digest(key, tuple(table.block_ids), request.num_prompt_tokens)
        self.runner.kv_ready()  # the step's KV writes are in device memory before NIXL reads
        first_tokens = tuple(request.output_token_ids[:1])
        self.transceiver.respond_and_send_async(
            key, [list(table.block_ids)], request.num_prompt_tokens, first_tokens
        )
        if self.ranks is not None:
            self._outbox.sends.append(
                SendCommand(
                    key=key,
                    block_ids=tuple(table.block_ids),
                    num_tokens=request.num_prompt_tokens,
                    first_tokens=first_tokens,
                )
            )

    def _prepare_sends(self, plan: StepPlan) -> None:
        """ctx: a context_only request whose last prefill chunk is in this step has its KV in
        these blocks when the step ends. Said now, a gen request that already asked
        (generation_first) gets its write prepared during the forward; only the post is left
        once the KV is ready."""
        if self.transceiver is None:
            return
        for item in plan.items:
            live = self._live.get(item.request.request_id)
            table = item.request.block_table
            if not item.samples or live is None or live.transfer_key is None or table is None:
                continue
            self.transceiver.prepare_send(
                live.transfer_key, [list(table.block_ids)], item.request.num_prompt_tokens
            )
            if self.ranks is not None:
                self._outbox.prepares.append(
                    SendCommand(
                        key=live.transfer_key,
                        block_ids=tuple(table.block_ids),
                        num_tokens=item.request.num_prompt_tokens,
                    )
                )

    def _specs_for(self, plan: StepPlan) -> dict[int, SampleSpec]:
        now = self.clock()
        specs = {}
        for item in plan.items:
            live = self._live[item.request.request_id]
            if live.first_scheduled is None:
                live.first_scheduled = now
            if item.samples:
                request = item.request
                suppress = live.spec.suppress
                if suppress and len(request.output_token_ids) >= request.sampling.min_tokens:
                    live.spec = attrs.evolve(live.spec, suppress=frozenset())
                specs[request.request_id] = live.spec
        return specs

    def _respond(self, plan: StepPlan, out: StepOutput) -> None:
        now = self.clock()
        for sampled in out.sampled:
            live = self._live.get(sampled.request_id)
            if live is None:
                continue
            self._append(live, sampled, now)

    def _append(self, live: _Live, sampled: Sampled, now: float) -> None:
        live.request.output_token_ids.append(sampled.token_id)
        self._after_token(live, sampled.token_id, sampled.logprobs, now)

    def _after_token(
        self, live: _Live, token: int, logprobs: TokenLogprobs | None, now: float
    ) -> None:
        """Stop rules, text and output for the token just appended to the request."""
        request = live.request
        if live.first_token is None:
            live.first_token = now
            self.metrics.time_to_first_token.observe(now - request.arrival_time)
        elif live.last_token is not None:
            self.metrics.inter_token_latency.observe(now - live.last_token)
        live.last_token = now

        params = request.sampling
        reason: FinishReason | None = None
        text = ""
        is_eos = token in self.tokenizer.eos_token_ids and not params.ignore_eos
        if is_eos or token in params.stop_token_ids:
            reason = FinishReason.STOP
        else:
            text = live.stops.feed(live.detokenizer.add(token))
            if live.stops.stopped:
                reason = FinishReason.STOP
        if reason is None and (
            len(request.output_token_ids) >= params.max_tokens
            or request.num_tokens >= self.max_seq_len
        ):
            reason = FinishReason.LENGTH
        if reason is not None and not live.stops.stopped:
            text += live.stops.feed(live.detokenizer.flush())
            if not live.stops.stopped:
                text += live.stops.flush()
        if reason is None and request.request_type is RequestType.CONTEXT_ONLY:
            self._start_send(live, now)
            self._emit(live, (token,), text, (logprobs,), None, now, context_done=True)
            self._close(live, FinishReason.STOP, now, emitted=True)
            return
        self._emit(live, (token,), text, (logprobs,), reason, now)
        if reason is not None:
            self.scheduler.finish(request, reason)
            self._close(live, reason, now, emitted=True)

    def _finish_dropped(self, plan: StepPlan) -> None:
        """Requests the scheduler ended on its own (LENGTH when their KV cannot grow)."""
        now = self.clock()
        for request in plan.finished:
            live = self._live.get(request.request_id)
            if live is None:
                continue
            reason = request.finish_reason or FinishReason.LENGTH
            self._emit(live, (), live.stops.flush(), (), reason, now)
            self._close(live, reason, now, emitted=True)

    def _emit(
        self,
        live: _Live,
        tokens: tuple[int, ...],
        text: str,
        logprobs: tuple[TokenLogprobs | None, ...],
        reason: FinishReason | None,
        now: float,
        *,
        error: str | None = None,
        internal: bool = False,
        context_done: bool = False,
    ) -> None:
        request = live.request
        final = reason is not None or context_done
        perf = self._perf(live, now) if final else None
        output = RequestOutput(
            token_ids=tokens,
            text=text,
            logprobs=logprobs,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_token_ids),
            perf=perf,
            error=error,
            internal=internal,
            context_done=context_done,
        )
        # A gone handler is fine: its abort is already queued.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            live.send.send_nowait(output)

    def _perf(self, live: _Live, now: float) -> PerfMetrics:
        arrival = live.request.arrival_time
        first = live.first_token or now
        # A generation_only request's first token (ctx's) precedes its first scheduled step.
        scheduled = min(live.first_scheduled or first, first)
        return PerfMetrics(
            queue_s=scheduled - arrival,
            prefill_s=first - scheduled,
            first_token_s=first - arrival,
            decode_s=now - first,
            kv_transfer_bytes=live.transfer_bytes,
            kv_transfer_s=live.transfer_s,
        )

    def _close(
        self, live: _Live, reason: FinishReason, now: float, *, emitted: bool = False
    ) -> None:
        request = live.request
        if self._live.pop(request.request_id, None) is None:
            return
        key = live.transfer_key
        if key is not None and key not in self._sending and self.transceiver is not None:
            # A context_only request that ends without sending (aborted, failed, or finished at
            # its first token): a gen that asked for its KV first is refused now, not at its
            # deadline.
            self.transceiver.abandon_send(key, _ENDED.get(reason, f"it ended ({reason.value})"))
        if not emitted:
            self._emit(live, (), "", (), reason, now)
        live.send.close()
        status = {FinishReason.ABORT: "aborted", FinishReason.ERROR: "error"}.get(reason, "ok")
        self.metrics.requests_total.labels(role=self.role, status=status).inc()
        if status == "ok":
            self.metrics.e2e_latency.observe(now - request.arrival_time)

    @contextlib.contextmanager
    def _step_running(self) -> Iterator[None]:
        self._stepping = True
        try:
            yield
        finally:
            self._stepping = False

    def idle(self) -> bool:
        """Whether no step runs now (the transceiver may then spin its loop, pacing.py)."""
        return not self._stepping

    def _advance(self, counter: Counter, name: str, total: float) -> None:
        """Bring a Prometheus counter up to a running total kept by the transceiver."""
        delta = total - self._synced.get(name, 0)
        if delta > 0:
            counter.inc(delta)
            self._synced[name] = total

    def refresh_gauges(self) -> None:
        stats = self.scheduler.statistics()
        self.metrics.requests_running.set(stats.num_running)
        self.metrics.requests_waiting.set(stats.num_waiting)
        pool = stats.pool
        self.metrics.kv_total_blocks.set(pool.total_blocks)
        self.metrics.kv_free_blocks.set(pool.free_blocks)
        self.metrics.kv_reusable_blocks.set(pool.reusable_blocks)
