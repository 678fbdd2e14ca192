"""The executor loop: one per process, explicit steps each iteration.

    admit     commands from HTTP handlers (new requests, aborts) enter the scheduler
    schedule  the scheduler picks decode tokens and prefill chunks within the step budget
    forward   the runner builds tensors, runs the model and samples, in a worker thread
    respond   sampled tokens are appended, stop rules checked, outputs sent to the handlers

Handlers never touch the scheduler directly: they queue commands, which the loop applies between
steps. So the scheduler is only ever changed while no forward is in flight, and a block is never
freed under a running kernel.

A request's outputs go to its handler through an unbounded memory channel: a slow client must
never stall the loop. An abandoned handler simply aborts its request.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable

import attrs
import trio

from trtdisagg.api.protocol import PerfMetrics
from trtdisagg.errors import CapacityError
from trtdisagg.metrics import WorkerMetrics
from trtdisagg.worker.request import FinishReason, Request
from trtdisagg.worker.runner import ModelRunner, Sampled, StepOutput
from trtdisagg.worker.sampling import SampleSpec, TokenLogprobs, make_generator
from trtdisagg.worker.scheduler import Scheduler, StepPlan
from trtdisagg.worker.stopping import StopStrings
from trtdisagg.worker.tokenization import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


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
    perf: PerfMetrics | None = None


@attrs.define(eq=False, kw_only=True)
class _Live:
    request: Request
    send: trio.MemorySendChannel[RequestOutput]
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    spec: SampleSpec
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


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
    clock: Callable[[], float] = time.monotonic
    _live: dict[int, _Live] = attrs.field(factory=dict, alias="live")
    _new: list[_Live] = attrs.field(factory=list, alias="new")
    _aborts: list[int] = attrs.field(factory=list, alias="aborts")
    _wake: trio.Event = attrs.field(factory=trio.Event, alias="wake")
    steps: int = 0

    # ---- commands from handlers (sync, never block) ----

    def submit(self, request: Request) -> RequestHandle:
        """Queue a request. Raises CapacityError if it could never fit, so the caller can 400."""
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
        )
        self._new.append(live)
        self._wake.set()
        return RequestHandle(request=request, outputs=receive)

    def abort(self, request_id: int) -> None:
        self._aborts.append(request_id)
        self._wake.set()

    def num_active(self) -> int:
        return len(self._live) + len(self._new)

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
        while True:
            self._admit()
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
            out = await trio.to_thread.run_sync(self.runner.execute, plan, specs)
            self.steps += 1
            self.scheduler.step_done(plan)
            self._respond(plan, out)
            self.refresh_gauges()

    async def _wait_for_work(self, timeout: float = math.inf) -> None:
        with trio.move_on_after(timeout):
            await self._wake.wait()
        self._wake = trio.Event()

    def _admit(self) -> None:
        now = self.clock()
        for live in self._new:
            self._live[live.request.request_id] = live
            self.scheduler.add(live.request)
        self._new.clear()
        for request_id in self._aborts:
            aborted = self._live.get(request_id)
            if aborted is None:
                continue
            if not aborted.request.is_finished:
                self.scheduler.abort(request_id)
            self._close(aborted, FinishReason.ABORT, now)
        self._aborts.clear()

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
        request = live.request
        token = sampled.token_id
        request.output_token_ids.append(token)
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
        self._emit(live, (token,), text, (sampled.logprobs,), reason, now)
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
    ) -> None:
        request = live.request
        perf = self._perf(live, now) if reason is not None else None
        output = RequestOutput(
            token_ids=tokens,
            text=text,
            logprobs=logprobs,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_token_ids),
            perf=perf,
        )
        # A gone handler is fine: its abort is already queued.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            live.send.send_nowait(output)

    def _perf(self, live: _Live, now: float) -> PerfMetrics:
        arrival = live.request.arrival_time
        scheduled = live.first_scheduled or now
        first = live.first_token or now
        return PerfMetrics(
            queue_s=scheduled - arrival,
            prefill_s=first - scheduled,
            first_token_s=first - arrival,
            decode_s=now - first,
        )

    def _close(
        self, live: _Live, reason: FinishReason, now: float, *, emitted: bool = False
    ) -> None:
        request = live.request
        if self._live.pop(request.request_id, None) is None:
            return
        if not emitted:
            self._emit(live, (), "", (), reason, now)
        live.send.close()
        status = {FinishReason.ABORT: "aborted", FinishReason.ERROR: "error"}.get(reason, "ok")
        self.metrics.requests_total.labels(role=self.role, status=status).inc()
        if status == "ok":
            self.metrics.e2e_latency.observe(now - request.arrival_time)

    def refresh_gauges(self) -> None:
        stats = self.scheduler.statistics()
        self.metrics.requests_running.set(stats.num_running)
        self.metrics.requests_waiting.set(stats.num_waiting)
        pool = stats.pool
        self.metrics.kv_total_blocks.set(pool.total_blocks)
        self.metrics.kv_free_blocks.set(pool.free_blocks)
        self.metrics.kv_reusable_blocks.set(pool.reusable_blocks)
