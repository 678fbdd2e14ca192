"""The step loop, written once for one rank or many: admit, poll, receive, schedule, step, respond.

    admit     commands from the handlers (new requests, aborts, releases) enter the engine
    poll      transfers that finished: gen requests whose KV landed start decoding; ctx requests
              whose KV was sent (or failed, or timed out) free their pinned blocks
    receive   generation_only requests get blocks, then ask ctx for their KV
    schedule  the scheduler picks decode tokens and prefill chunks within the step budget
    step      the driver launches the forward and sampling (off the Trio loop, on every rank)
    respond   sampled tokens are appended, the output processor applies the stop rules and makes
              the outputs; a context_only request's first token ends its HTTP answer and starts
              its send

Asynchronous steps (`driver.overlaps`, one rank): a round launches step N+1 and then finishes
step N (waits for its tokens, in the same trip to a worker thread, then responds), so the device
runs step N+1 while the host processes step N's outputs. Step N+1 was scheduled before step N's
tokens were known: each request that samples in a step counts a pending token
(`Request.pending_tokens`), the next step's decode row for it reads that token on the device,
and a request that surely ends with it is not scheduled again (`Scheduler`). A request whose
token turns out to end it (a stop token, a stop string) is still in step N+1: that step's result
for it is dropped, and its blocks are freed only once step N+1 finished (`in_flight.py`). A
step's inputs are taken from its plan before it launches (`driver.inputs`), and the scheduler
hears of the launch before anything runs concurrently, so requests and blocks still change only
on the Trio thread. One hook, `synchronous`, marks requests that need their previous token on
the host before their next step samples (a grammar's mask): a step holding one is finished
before the next is scheduled. A multi-rank driver does not overlap: every step is finished
before the next is scheduled.

Polling comes before receiving so that blocks a finished transfer frees serve the gen requests
waiting for blocks in the same round. What differs between one rank and many is the driver's
(`ports.StepDriver`); transfer bookkeeping is the tracker's, text and stop rules the output
processor's, and every request ends through `end`, with the reason as data (`Ending`).

A step whose forward raises `StepFailed` fails only the requests in it (500, with the cause),
frees their blocks and leaves the worker serving; `MAX_CONSECUTIVE_STEP_FAILURES` failed steps in
a row stop it (`stopped`, and /health answers 503), since a fault that outlives a step is the
worker's. Any other exception from a step leaves the loop and stops the instance.

The loop alone changes the scheduler, between steps, so a block is never freed under a running
kernel. Outputs go to handlers through unbounded channels: a slow client never stalls the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

import attrs
import trio

from trtdisagg.metrics import WorkerMetrics
from trtdisagg.worker.engine.ending import Ending
from trtdisagg.worker.engine.live import Inbox, Live
from trtdisagg.worker.engine.outputs import OutputProcessor, Processed, RequestOutput, Token
from trtdisagg.worker.engine.ports import Launched, StepDriver, StepFailed
from trtdisagg.worker.engine.tracker import TransferTracker
from trtdisagg.worker.launched import StepOutput
from trtdisagg.worker.request import FinishReason, Request
from trtdisagg.worker.sampling import SampleSpec
from trtdisagg.worker.scheduler import Scheduler, StepPlan

log = logging.getLogger(__name__)

# Failed model steps in a row after which the worker stops serving. One failed step may be a
# request's doing (an input no test foresaw); the same failure three times over, whatever the
# batch, is the worker's own (a sticky CUDA error, memory it cannot get back).
MAX_CONSECUTIVE_STEP_FAILURES = 3


@attrs.frozen(kw_only=True, eq=False)
class InFlight:
    """A launched step whose tokens the loop has not taken yet."""

    plan: StepPlan
    launched: Launched


def _never(live: Live) -> bool:
    return False


@attrs.define(eq=False, kw_only=True)
class StepLoop:
    scheduler: Scheduler
    driver: StepDriver
    tracker: TransferTracker
    outputs: OutputProcessor
    inbox: Inbox
    metrics: WorkerMetrics
    role: str
    clock: Callable[[], float] = time.monotonic
    # The hook for rows that need their previous token on the host before their next step
    # samples (a grammar mask made from it): a step holding such a row is finished before the
    # next step is scheduled, so that step's mask can see the token.
    synchronous: Callable[[Live], bool] = _never
    lives: dict[int, Live] = attrs.Factory(dict)  # every request the engine serves, by id
    # Why this worker stopped serving (too many failed steps in a row); None while it serves.
    stopped: str | None = None
    _failed_steps: int = attrs.field(default=0, alias="failed_steps")  # in a row
    _in_flight: InFlight | None = attrs.field(default=None, alias="in_flight")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self._round()

    async def run_until_idle(self, more: Callable[[], bool] = lambda: False) -> None:
        """Rounds until no request is left, no step is in flight, no command waits and `more()`
        says no request will come (the offline engine, which has no transfers; a closed-loop
        client says `more` while it will submit, and wakes the loop when it stops)."""
        while self.lives or self._in_flight is not None or self.inbox.has_commands or more():
            await self._round()

    async def _round(self) -> None:
        self._admit()
        self._poll()
        self.tracker.start_receives()
        in_flight = self._in_flight
        if in_flight is not None and not self._may_overlap(in_flight):
            self._in_flight = None
            await self._finish(in_flight)
            return
        plan = self._schedule()
        if plan is None:
            if in_flight is not None:
                self._in_flight = None
                await self._finish(in_flight)
            else:
                has_work = self.scheduler.has_work()
                await self.driver.idle(has_work=has_work, in_flight=self.tracker.in_flight)
            return
        specs = self._specs_for(plan)
        inputs = self.driver.inputs(plan)
        self.tracker.prepare_sends(plan, self.lives)
        self.scheduler.step_launched(plan)
        for item in plan.items:
            if item.samples:
                item.request.pending_tokens += 1
        # One trip to a worker thread: launch this step, then wait for the one in flight. The
        # loop yields to the HTTP tasks once per round, and the device has this step queued
        # while the last one's outputs are processed.
        self._in_flight = None
        after = in_flight.launched if in_flight is not None else None
        launched = await self.driver.launch(inputs, specs, after=after)
        if in_flight is not None:
            await self._finish(in_flight)  # its tokens are on the host: nothing waits
        if launched.failure is not None:
            self._step_failed(plan, launched.failure)
            self.scheduler.step_finished(plan)
            return
        self._in_flight = InFlight(plan=plan, launched=launched)

    def _may_overlap(self, in_flight: InFlight) -> bool:
        """Whether the next step may be scheduled before `in_flight`'s tokens are known."""
        if not self.driver.overlaps:
            return False
        for item in in_flight.plan.items:
            live = self.lives.get(item.request.request_id)
            if item.samples and live is not None and self.synchronous(live):
                return False
        return True

    # ---- the phases ----

    def _admit(self) -> None:
        commands = self.inbox.take()
        now = self.clock()
        for live in commands.new:
            self.lives[live.request_id] = live
            if live.source is not None:
                self.tracker.wait_for_blocks(live)
            else:
                self.scheduler.add(live.request)
        for request_id in commands.aborts:
            aborted = self.lives.get(request_id)
            if aborted is None:
                continue  # it ended meanwhile
            request = aborted.request
            log.info(
                "request %d aborted by its client (state %s, %d tokens out)",
                request.request_id,
                request.state.value,
                len(request.output_token_ids),
            )
            self.end(aborted, Ending.aborted(), now)
        for key in commands.releases:
            if self.tracker.release_send(key):
                self.metrics.kv_sends_released.inc()

    def _poll(self) -> None:
        receives, sends = self.driver.outcomes()
        polled = self.tracker.poll(receives, sends)
        if polled.failures:
            self.metrics.kv_transfer_failures.inc(polled.failures)
        now = self.clock()
        for live, ending in polled.failed:
            self.end(live, ending, now)
        self._respond_with(self.outputs.process(polled.arrived, now), now)

    def _schedule(self) -> StepPlan | None:
        """The next step's plan, or None when nothing fits (or nothing is there) to compute."""
        if not self.scheduler.has_work():
            return None
        plan = self.scheduler.schedule()
        if plan.preempted:
            self.metrics.preemptions.inc(len(plan.preempted))
        self._drop(plan.finished)
        return plan if plan.items else None

    async def _finish(self, in_flight: InFlight) -> None:
        plan = in_flight.plan
        try:
            out = await self.driver.finish(in_flight.launched)
        except StepFailed as failure:
            self._step_failed(plan, failure)
            self.scheduler.step_finished(plan)
            return
        self._failed_steps = 0
        self.scheduler.step_finished(plan)
        self.metrics.steps.inc()
        self.metrics.step_device_seconds.inc(out.device_s)
        self._respond(out)

    def _respond(self, out: StepOutput) -> None:
        now = self.clock()
        tokens = []
        for sampled in out.sampled:
            live = self.lives.get(sampled.request_id)
            if live is None:
                continue  # it ended (aborted, or stopped by the step before): dropped
            live.request.sampled(sampled.token_id)
            tokens.append(Token(live=live, token_id=sampled.token_id, logprobs=sampled.logprobs))
        self._respond_with(self.outputs.process(tokens, now), now)

    def _respond_with(self, processed: Iterable[Processed], now: float) -> None:
        for item in processed:
            if item.ending is None:
                item.live.deliver(item.output)
            else:
                self.end(item.live, item.ending, now, last=item.output)

    def _specs_for(self, plan: StepPlan) -> dict[int, SampleSpec]:
        """How each request that samples in this step picks its token."""
        now = self.clock()
        specs = {}
        for item in plan.items:
            live = self.lives[item.request.request_id]
            live.state.scheduled(now)
            if item.samples:
                request = item.request
                suppress = live.spec.suppress
                # The token this step samples is output number num_outputs (pending included).
                num_outputs = request.num_output_tokens + request.pending_tokens
                if suppress and num_outputs >= request.sampling.min_tokens:
                    live.spec = attrs.evolve(live.spec, suppress=frozenset())
                specs[request.request_id] = live.spec
        return specs

    # ---- endings ----

    def end(
        self, live: Live, ending: Ending, now: float, last: RequestOutput | None = None
    ) -> None:
        """End a request, whatever ended it: settle its blocks and transfer, send its last
        output (`last`, when its last token made one), close its outputs, count it."""
        if self.lives.pop(live.request_id, None) is None:
            return
        self.tracker.settle(live, ending)
        live.deliver(last if last is not None else self.outputs.closing(live, ending, now))
        live.close()
        self.metrics.requests_total.labels(role=self.role, status=ending.status).inc()
        if ending.status == "ok":
            self.metrics.e2e_latency.observe(now - live.request.arrival_time)

    def _drop(self, finished: Sequence[Request]) -> None:
        """Requests the scheduler ended on its own (LENGTH when their KV cannot grow)."""
        now = self.clock()
        for request in finished:
            live = self.lives.get(request.request_id)
            if live is not None:
                self.end(live, Ending.dropped(request.finish_reason or FinishReason.LENGTH), now)

    def _step_failed(self, plan: StepPlan, failure: StepFailed) -> None:
        """Fail the requests of the step that raised; the others go on.

        Their tokens were never sampled and their KV may be half written, so they cannot resume;
        nothing else was touched by the step. They end as an abort does (blocks freed once no
        launched step computes them, transfer state released), with the cause in their error.
        The caller closes the plan (`Scheduler.step_finished`).
        """
        self._failed_steps += 1
        self.metrics.step_failures.inc()
        cause = str(failure)
        log.error(
            "model step failed (%d in a row), failing the %d requests in it: %s",
            self._failed_steps,
            len(plan.items),
            cause,
            exc_info=failure.cause,
        )
        now = self.clock()
        ending = Ending.failed(f"internal error in the model step: {cause}")
        for item in plan.items:
            live = self.lives.get(item.request.request_id)
            if live is not None:
                self.end(live, ending, now)
        if self._failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
            self._stop_serving(cause)

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
        self._admit()  # requests submitted during the failed step are failed too
        now = self.clock()
        ending = Ending.failed(f"this worker stopped serving: {self.stopped}")
        for live in list(self.lives.values()):
            self.end(live, ending, now)
