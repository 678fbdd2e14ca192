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
runs step N+1 while the host processes step N's outputs. On the CPU the forward is the launch: a
host stream's thread (`host_stream.py`) computes the steps in order, step N+1 right after step N,
while the Trio thread finishes step N and schedules step N+2. Step N+1 was scheduled before step
N's tokens were known: each request that samples in a step counts a pending token
(`Request.pending_tokens`), the next step's decode row for it reads that token on the device, and
a request that surely ends with it is not scheduled again (`Scheduler`). A request whose token
turns out to end it (a stop token, a stop string) is still in step N+1: that step's result
for it is dropped, and its blocks are freed only once step N+1 finished (`in_flight.py`). A
step's inputs are taken from its plan before it launches (`driver.inputs`), and the scheduler
hears of the launch before anything runs concurrently, so requests and blocks still change only
on the Trio thread. One hook, `synchronous`, marks requests that need their previous token on
the host before their next step samples (a grammar's mask, penalties' token counts, bad
words' bans): a step holding one is finished before the next is scheduled. A multi-rank driver
does not overlap: every step is finished before the next is scheduled.

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
import torch
import trio

from trtdisagg.metrics import WorkerMetrics
from trtdisagg.worker.engine.ending import Ending
from trtdisagg.worker.engine.forks import hand_over_together, start_choices
from trtdisagg.worker.engine.live import Inbox, Live
from trtdisagg.worker.engine.outputs import OutputProcessor, Processed, RequestOutput, Token
from trtdisagg.worker.engine.ports import Launched, StepDriver, StepFailed, StepSkipped
from trtdisagg.worker.engine.tracker import TransferTracker
from trtdisagg.worker.grammar import allowed_tokens, allows_other_than
from trtdisagg.worker.launched import StepOutput
from trtdisagg.worker.request import FinishReason, Request
from trtdisagg.worker.sampling import SampleSpec
from trtdisagg.worker.scheduler import Scheduler, StepPlan
from trtdisagg.worker.token_bans import banned_next, intersect

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
    prefill_tokens: int  # prompt tokens it computes (not counting recomputed outputs)


def needs_last_token(live: Live) -> bool:
    """Whether `live` needs its previous token on the host before its next step samples: its
    grammar's mask, its penalties' token counts, or its bad words' bans are made from it."""
    sampling = live.request.sampling
    return live.grammar is not None or sampling.penalized or sampling.bans_after_tokens


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
    # Rows that need their previous token on the host before their next step samples: a step
    # holding such a row is finished before the next step is scheduled (a test may replace it).
    synchronous: Callable[[Live], bool] = needs_last_token
    lives: dict[int, Live] = attrs.Factory(dict)  # every request the engine serves, by id
    # Why this worker stopped serving (too many failed steps in a row); None while it serves.
    stopped: str | None = None
    _failed_steps: int = attrs.field(default=0, alias="failed_steps")  # in a row
    _in_flight: InFlight | None = attrs.field(default=None, alias="in_flight")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self.driver.running():
            task_status.started()
            while True:
                await self._round()

    async def run_until_idle(self, more: Callable[[], bool] = lambda: False) -> None:
        """Rounds until no request is left, no step is in flight, no command waits and `more()`
        says no request will come (the offline engine, which has no transfers; a closed-loop
        client says `more` while it will submit, and wakes the loop when it stops)."""
        async with self.driver.running():
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
        prefill_tokens = _prefill_tokens(plan)
        self.scheduler.step_launched(plan)
        for item in plan.items:
            if item.samples:
                item.request.pending_tokens += 1
        self._in_flight = None
        # One trip to a worker thread: launch this step, then wait for the one in flight. The
        # loop yields to the HTTP tasks once per round, and the device (or the host stream) has
        # this step queued while the last one's outputs are processed.
        after = in_flight.launched if in_flight is not None else None
        launched = await self.driver.launch(inputs, specs, after=after)
        if in_flight is not None:
            await self._finish(in_flight)  # its tokens are on the host: nothing waits
        if launched.failure is not None:
            self._step_failed(plan, launched.failure)
            self.scheduler.step_finished(plan)
            return
        self._in_flight = InFlight(plan=plan, launched=launched, prefill_tokens=prefill_tokens)

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
        released = []
        for live in commands.new:
            self.lives[live.request_id] = live
            for fork in live.forks:  # its prompt's other choices (forks.py)
                self.lives[fork.request_id] = fork
            self.metrics.prompt_tokens.inc(live.request.num_prompt_tokens)
            if live.source is not None:
                self.tracker.wait_for_blocks(live)
            else:
                self.scheduler.add(live.request)
                key = live.transfer_key
                if key is not None and self.tracker.take_early_release(key, now):
                    released.append(live)  # its release came first: it ends before it starts
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
            self._release(key, now)
        for live in released:
            self.end(live, Ending.aborted(), now)
            self.metrics.kv_sends_released.inc()

    def _release(self, key: int, now: float) -> None:
        """ctx: the coordinator gave up on `key`'s gen leg. KV pinned for it is released (as a
        CANCEL from gen would); a request still prefilling for it (or waiting to) ends now and
        frees its blocks; a key no request has yet is remembered a while, for a request that
        comes after its release."""
        if self.tracker.release_send(key):
            self.metrics.kv_sends_released.inc()
            return
        live = next((live for live in self.lives.values() if live.transfer_key == key), None)
        if live is None:
            self.tracker.remember_release(key, now)
            return
        log.info("request %d ends before its prefill does: its KV was released", live.request_id)
        self.end(live, Ending.aborted(), now)
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
        except StepSkipped:
            self.scheduler.step_finished(plan)
            return
        except StepFailed as failure:
            self._step_failed(plan, failure)
            self.scheduler.step_finished(plan)
            return
        self._failed_steps = 0
        self.scheduler.step_finished(plan)
        self.metrics.steps.inc()
        self.metrics.prefill_tokens.inc(in_flight.prefill_tokens)
        self.metrics.step_device_seconds.inc(out.device_s)
        if in_flight.prefill_tokens:
            self.metrics.prefill_steps.inc()
            self.metrics.prefill_step_device_seconds.inc(out.device_s)
        self._respond(out)

    def _respond(self, out: StepOutput) -> None:
        now = self.clock()
        tokens: list[Token] = []
        forks: dict[int, list[Token]] = {}  # a leader's id: its forks' first tokens
        for chunk in out.prompt_logprobs:
            prefilled = self.lives.get(chunk.request_id)
            if prefilled is not None:
                prefilled.state.add_prompt_logprobs(chunk.start, chunk.logprobs)
        for sampled in out.sampled:
            live = self.lives.get(sampled.request_id)
            if live is None:
                continue  # it ended (aborted, or stopped by the step before): dropped
            if sampled.choice:  # the first token of one of its forks (forks.py)
                fork = live.forks[sampled.choice - 1]
                token = Token(live=fork, token_id=sampled.token_id, logprobs=sampled.logprobs)
                forks.setdefault(live.request_id, []).append(token)
                continue
            live.request.sampled(sampled.token_id)
            tokens.append(Token(live=live, token_id=sampled.token_id, logprobs=sampled.logprobs))
        for leader_id, firsts in forks.items():
            start_choices(self.scheduler, self.lives[leader_id], firsts)
            tokens += firsts
        processed = self.outputs.process(tokens, now)
        self._respond_with(hand_over_together(processed) if forks else processed, now)

    def _respond_with(self, processed: Iterable[Processed], now: float) -> None:
        for item in processed:
            if item.ending is None:
                item.live.deliver(item.output)
            else:
                self.end(item.live, item.ending, now, last=item.output)

    def _specs_for(self, plan: StepPlan) -> dict[int, SampleSpec]:
        """How each request that samples in this step picks its token (and each of its forks,
        at its first token), with the bitmask of each one that has a grammar."""
        now = self.clock()
        rows: list[tuple[int, list[Live]]] = []  # (outputs so far, the row's choices)
        for item in plan.items:
            live = self.lives[item.request.request_id]
            live.state.scheduled(now)
            if item.samples:
                # The token this step samples is output number num_outputs (pending included).
                request = item.request
                num_outputs = request.num_output_tokens + request.pending_tokens
                # Forks sample with their leader's first token only (a step already in
                # flight may hold it while the next one is scheduled).
                riders = live.forks if num_outputs == 0 else []
                rows.append((num_outputs, [live, *riders]))
        masks = grammar_masks([choice for _, choices in rows for choice in choices])
        specs = {}
        for num_outputs, choices in rows:
            head, *forks = [_current_spec(c, num_outputs, masks.get(id(c))) for c in choices]
            specs[choices[0].request_id] = attrs.evolve(head, forks=tuple(forks)) if forks else head
        return specs

    # ---- endings ----

    def end(
        self, live: Live, ending: Ending, now: float, last: RequestOutput | None = None
    ) -> None:
        """End a request, whatever ended it: settle its blocks and transfer, send its last
        output (`last`, when its last token made one), close its outputs, count it."""
        if self.lives.pop(live.request_id, None) is None:
            return
        leader = live.leader
        if leader is not None:  # a choice with nothing in the scheduler (forks.py)
            leader.forks.remove(live)
            live.leader = None
        else:
            self.tracker.settle(live, ending)
            for fork in list(live.forks):
                if not fork.request.output_token_ids:  # never started: it ends with it
                    self.end(fork, ending, now)
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


def _prefill_tokens(plan: StepPlan) -> int:
    """The prompt tokens a plan computes (call before the scheduler advances its requests)."""
    return sum(
        max(0, min(i.request.num_prompt_tokens - i.request.num_computed_tokens, i.num_new_tokens))
        for i in plan.items
    )


def _current_spec(live: Live, num_outputs: int, grammar: torch.Tensor | None) -> SampleSpec:
    """How `live` samples its next token: once it has `min_tokens` outputs, EOS is no longer
    suppressed; the tokens that would complete a bad word are; `grammar` is its grammar's
    bitmask for this token, met with its `allowed_token_ids`."""
    spec = live.spec
    params = live.request.sampling
    if spec.suppress and num_outputs >= params.min_tokens:
        live.spec = spec = attrs.evolve(spec, suppress=frozenset())
    suppress = spec.suppress
    if params.bad_word_ids:
        suppress = suppress | banned_next(params.bad_word_ids, live.request.output_token_ids)
    allowed = spec.allowed
    if grammar is not None:
        both = grammar if allowed is None else intersect(allowed.numpy(), grammar.numpy())
        allowed = torch.as_tensor(both)
    if allowed is not None and suppress and not allows_other_than(allowed.numpy(), suppress):
        # What the grammar or allowed_token_ids allow, min_tokens or bad_words hold back: the
        # former win (a row with no token left would sample garbage).
        suppress = frozenset()
    if allowed is spec.allowed and suppress is spec.suppress:
        return spec
    return attrs.evolve(spec, allowed=allowed, suppress=suppress)


def grammar_masks(choices: Sequence[Live]) -> dict[int, torch.Tensor]:
    """The allowed-token bitmask of each of a step's sampling choices that has a grammar (by
    `id` of its Live), from its matcher's state after its previous token (`grammar.py`)."""
    constrained = [(id(c), c.grammar) for c in choices if c.grammar is not None]
    if not constrained:
        return {}
    bitmasks = torch.from_numpy(allowed_tokens([matcher for _, matcher in constrained]))
    return {key: mask for (key, _), mask in zip(constrained, bitmasks.unbind(0), strict=True)}
