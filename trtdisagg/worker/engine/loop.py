"""The step loop, written once for one rank or many: admit, poll, receive, schedule, step, respond.

    admit     commands from the handlers (new requests, aborts, releases) enter the engine
    poll      transfers that finished: gen requests whose KV landed start decoding; ctx requests
              whose KV was sent (or failed, or timed out) free their pinned blocks
    receive   generation_only requests get blocks, then ask ctx for their KV
    schedule  the scheduler picks decode tokens and prefill chunks within the step budget
    step      the driver runs the forward and samples (off the Trio loop, on every rank)
    respond   sampled tokens are appended, the output processor applies the stop rules and makes
              the outputs; a context_only request's first token ends its HTTP answer and starts
              its send

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
from trtdisagg.worker.engine.ports import StepDriver, StepFailed
from trtdisagg.worker.engine.tracker import TransferTracker
from trtdisagg.worker.grammar import allowed_tokens, allows_other_than
from trtdisagg.worker.request import FinishReason, Request
from trtdisagg.worker.runner import StepOutput
from trtdisagg.worker.sampling import SampleSpec
from trtdisagg.worker.scheduler import Scheduler, StepPlan

log = logging.getLogger(__name__)

# Failed model steps in a row after which the worker stops serving. One failed step may be a
# request's doing (an input no test foresaw); the same failure three times over, whatever the
# batch, is the worker's own (a sticky CUDA error, memory it cannot get back).
MAX_CONSECUTIVE_STEP_FAILURES = 3


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
    lives: dict[int, Live] = attrs.Factory(dict)  # every request the engine serves, by id
    # Why this worker stopped serving (too many failed steps in a row); None while it serves.
    stopped: str | None = None
    _failed_steps: int = attrs.field(default=0, alias="failed_steps")  # in a row

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._admit()
            self._poll()
            self.tracker.start_receives()
            plan = self._schedule()
            if plan is None:
                has_work = self.scheduler.has_work()
                await self.driver.idle(has_work=has_work, in_flight=self.tracker.in_flight)
                continue
            await self._step(plan)

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

    async def _step(self, plan: StepPlan) -> None:
        specs = self._specs_for(plan)
        self.tracker.prepare_sends(plan, self.lives)
        prefill_tokens = sum(
            max(
                0,
                min(i.request.num_prompt_tokens - i.request.num_computed_tokens, i.num_new_tokens),
            )
            for i in plan.items
        )
        try:
            out = await self.driver.step(plan, specs)
        except StepFailed as failure:
            self._step_failed(plan, failure)
            return
        self._failed_steps = 0
        self.metrics.prefill_tokens.inc(prefill_tokens)
        self.scheduler.step_done(plan)
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
                continue  # aborted during the step
            if sampled.choice:  # the first token of one of its forks (forks.py)
                fork = live.forks[sampled.choice - 1]
                token = Token(live=fork, token_id=sampled.token_id, logprobs=sampled.logprobs)
                forks.setdefault(live.request_id, []).append(token)
                continue
            live.request.output_token_ids.append(sampled.token_id)
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
                rows.append((len(item.request.output_token_ids), [live, *live.forks]))
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
        nothing else was touched by the step. They end as an abort does (blocks freed, transfer
        state released), with the cause in their error.
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
        self.scheduler.step_done(plan)  # no item is RUNNING any more: this only closes the plan
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


def _current_spec(live: Live, num_outputs: int, allowed: torch.Tensor | None) -> SampleSpec:
    """How `live` samples its next token: once it has `min_tokens` outputs, EOS is no longer
    suppressed; `allowed` is its grammar's bitmask for this token."""
    spec = live.spec
    if spec.suppress and num_outputs >= live.request.sampling.min_tokens:
        live.spec = spec = attrs.evolve(spec, suppress=frozenset())
    if allowed is None:
        return spec
    if spec.suppress and not allows_other_than(allowed, spec.suppress):
        # The grammar allows only the end, which min_tokens holds back: the grammar wins.
        return attrs.evolve(spec, allowed=allowed, suppress=frozenset())
    return attrs.evolve(spec, allowed=allowed)


def grammar_masks(choices: Sequence[Live]) -> dict[int, torch.Tensor]:
    """The allowed-token bitmask of each of a step's sampling choices that has a grammar (by
    `id` of its Live), from its matcher's state after its previous token (`grammar.py`)."""
    constrained = [(id(c), c.grammar) for c in choices if c.grammar is not None]
    if not constrained:
        return {}
    bitmasks = allowed_tokens([matcher for _, matcher in constrained])
    return {key: mask for (key, _), mask in zip(constrained, bitmasks, strict=True)}
