"""The gen side of one prompt's answer (its `n` choices): its first leg opened within its
deadline and read through a `GenRelay` (relayed as a stream, or assembled into a whole answer),
and the continuations that resume it on another gen when a leg dies or stalls (`GenLegs` is the
relay's `Resumer`: a continuation resumes one choice).

Failures before the first leg's stream is open (gen refused, unreachable, or silent past its
first-token deadline) go back to the service's retries, as any failed attempt. Once it is open,
failures are the relay's: the answer is resumed from what was relayed (``max_migrations``).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs
import httpx
import trio

from trtdisagg.api.reasoning import ReasoningSplitter, thinks_after
from trtdisagg.coordinator.cluster import ServerRole
from trtdisagg.coordinator.continuation import TextReplay, continuation_request, stop_strings
from trtdisagg.coordinator.ledger import ChoiceLedger, Ledger
from trtdisagg.coordinator.relay import RelayBody
from trtdisagg.coordinator.replies import JsonReply, Reply, StreamReply
from trtdisagg.coordinator.resume import (
    GEN_FIRST_TOKEN,
    AnswerFailed,
    CannotResume,
    DeadlineMissed,
    GenRelay,
    Leg,
    LegFailure,
    RequestTimeout,
    leg_failure,
)
from trtdisagg.coordinator.split import AttemptIds, CtxResult, ahead_tokens, gen_stream_request
from trtdisagg.coordinator.upstream import UpstreamError, UpstreamRejected

if TYPE_CHECKING:
    from trtdisagg.coordinator.placement import Lease
    from trtdisagg.coordinator.service import DisaggService, _Call

log = logging.getLogger(__name__)

Json = dict[str, Any]

GEN: Final = ServerRole.GENERATION
INLINE_REPLAY_TOKENS: Final = 256
"""Rebuilding the text state of more tokens than this runs in a worker thread."""


@attrs.define(eq=False, kw_only=True)
class GenLegs:
    """One answer's gen legs: the first, and the continuations (`resume.Resumer`), each of
    one choice."""

    service: DisaggService
    call: _Call
    ctx: CtxResult | None = None
    ids: AttemptIds | None = None
    """What ctx holds the KV under, released when the first leg fails before any token."""
    ctx_answered: trio.Event | None = None
    """generation_first: set when ctx's answer joins this one. A first leg that fails before
    then is neither resumed nor released until it is: the failure may only be ctx finishing
    the request itself (a stop or max_tokens at its first token), which leaves nothing to
    resume, and the answer's owner then ends these legs."""
    relay: GenRelay | None = None
    _ctx_released: bool = False
    _led: bool = False  # the stream began with ctx's first tokens (`_lead`)

    async def first(self, body: Json, lease: Lease, *, first_token_timeout: float | None) -> Reply:
        """Open the first leg and hand it to a relay: a stream reply, or the whole answer.

        A stream that may start with ctx's first tokens (`split.ahead_tokens`) starts with
        them (`_lead`), at once, and its relay posts the leg: a leg that fails then is the
        relay's to resume, as one that fails after its first token (choice by choice, for an
        answer of several). Any other answer starts once gen's stream is open (a failure
        before is the service's to retry, as ever); so does a generation_first one, whose gen
        leg is posted before ctx answers.

        Raises:
            what opening raises (UpstreamError, DeadlineMissed: the service retries);
            for a whole answer, what ended it (`AnswerFailed.cause`).
        """
        call, service, ctx = self.call, self.service, self.ctx
        call.clock.gen_start = trio.current_time()
        ahead = ahead_tokens(call.raw, call.ask, ctx) if ctx is not None else None
        if ahead is not None:  # posted by the relay's first read
            opener = functools.partial(self._post, lease, gen_stream_request(body))
            leg = Leg(response=None, opener=opener, lease=lease, posted=call.clock.gen_start,
                      first_token_timeout=first_token_timeout)  # fmt: skip
        else:
            try:
                leg = await self._open(lease, gen_stream_request(body), first_token_timeout)
            except DeadlineMissed as exc:
                self.missed(exc)
                raise
        lease.handed_off = True  # the relay owns it now, and releases it when the answer ends
        prompt_ids = call.route.prompt_token_ids
        if ctx is not None and ctx.prompt_token_ids:
            prompt_ids = tuple(ctx.prompt_token_ids)  # the worker's own tokenization
        ledger = Ledger(
            ask=call.ask,
            ctx_usage=ctx.usage if ctx is not None else None,
            perf=service.perf_of(call, ctx),
            prompt_token_ids=list(prompt_ids) if prompt_ids is not None else None,
            num_choices=call.req.n,
        )
        if ctx is not None:
            ledger.heard_ctx(ctx.body)
        self.relay = GenRelay(
            ledger=ledger,
            leg=leg,
            deadline=call.deadline,
            inter_token_timeout=service.config.inter_token_timeout,
            max_migrations=service.config.max_migrations,
            resumer=self,
            on_first_token=self._first_token,
            on_gen_token=self._gen_token,
        )
        self._lead()
        if call.ask.stream:
            return StreamReply(body=RelayBody(relay=self.relay, finish=self._finish))
        return JsonReply(body=await self._collect(self.relay))

    def joined(self, ctx: CtxResult, ids: AttemptIds) -> None:
        """generation_first: ctx answered after the first leg was posted, and gen decodes."""
        self.ctx, self.ids = ctx, ids
        if self.ctx_answered is not None:
            self.ctx_answered.set()
        if self.relay is not None:
            ledger = self.relay.ledger
            ledger.ctx_usage = ctx.usage
            ledger.heard_ctx(ctx.body)
            if ledger.prompt_token_ids is None and ctx.prompt_token_ids:
                ledger.prompt_token_ids = list(ctx.prompt_token_ids)
        self._lead()

    def _lead(self) -> None:
        """Begin the stream with ctx's first tokens (`split.ahead_tokens`) once ctx's answer
        and the relay are both here: under generation_first ctx may answer after gen's stream
        opened, but before the client's stream starts (the answer waits for ctx's), so before
        the relay reads anything from gen."""
        ctx, relay = self.ctx, self.relay
        if self._led or ctx is None or relay is None or relay.ledger.gen_tokens:
            return  # (a whole answer's relay reads gen at once: it has no lead)
        ahead = ahead_tokens(self.call.raw, self.call.ask, ctx)
        if ahead is not None:
            self._led = True
            relay.lead(relay.ledger.lead_with(ctx.body, ahead))
            self.service.metrics.streams_led.inc()

    def _first_token(self) -> None:
        """The answer's first token went out (ctx's, when the stream led with it)."""
        call = self.call
        if call.ask.stream:  # a whole answer's is observed when it is complete
            now = trio.current_time()
            self.service.metrics.time_to_first_token.observe(now - call.clock.arrival)

    def _gen_token(self) -> None:
        """gen's first token came, on whichever leg: the end of the hand-over phase
        (`perf.PhaseClock`), even when the client had ctx's token before."""
        self.call.clock.gen_first_token = trio.current_time()

    async def _finish(self, status: str) -> None:
        await trio.lowlevel.checkpoint()
        self.call.clock.gen_end = trio.current_time()
        self.call.outcome(status)

    async def _collect(self, relay: GenRelay) -> Json:
        try:
            while await relay.next_events() is not None:
                pass
        except AnswerFailed as failed:
            raise failed.cause from None
        finally:
            await relay.aclose()
        self.call.clock.gen_end = trio.current_time()
        return relay.ledger.whole()

    async def _open(self, lease: Lease, body: Json, timeout: float | None) -> Leg:
        """POST `body` to the leased gen and wait for its stream to open, at most `timeout`."""
        call = self.call
        posted = trio.current_time()
        due = math.inf if timeout is None else posted + timeout
        with trio.move_on_at(min(due, call.deadline)) as scope:
            response = await self._post(lease, body)
        if scope.cancelled_caught:
            if trio.current_time() >= call.deadline:
                raise RequestTimeout("request did not finish within request_timeout")
            raise DeadlineMissed(
                f"generation server {lease.server} did not answer within "
                f"gen_first_token_timeout={timeout:g}s",
                server=lease.server,
                phase=GEN_FIRST_TOKEN,
            )
        return Leg(response=response, lease=lease, posted=posted, first_token_timeout=timeout)

    async def _post(self, lease: Lease, body: Json) -> httpx.Response:
        call = self.call
        return await self.service.client.open_stream(
            lease.server, call.endpoint.path, body, role=GEN.value, headers=call.headers
        )

    # ---- the relay's Resumer ----

    def missed(self, failure: LegFailure) -> None:
        self.service.missed(failure)

    async def abandoned(self, relay: GenRelay) -> None:
        await self._ctx_answer()
        await self.release_ctx()

    async def release_ctx(self) -> None:
        """Tell ctx that no gen takes the KV it holds for this answer (once)."""
        if self.ctx is None or self.ids is None or self._ctx_released:
            return
        self._ctx_released = True
        await self.service.release_ctx(self.call, self.ctx.server, self.ids)

    async def _ctx_answer(self) -> None:
        if self.ctx_answered is not None:
            await self.ctx_answered.wait()

    async def resume(self, relay: GenRelay, failure: LegFailure) -> Leg:
        """A continuation of the relay's choice on another gen: an aggregated request for
        prompt + that choice's tokens sent."""
        await self._ctx_answer()
        call, service, ledger = self.call, self.service, relay.ledger
        if relay.choice is None and ledger.num_choices > 1:
            # Each choice continues from its own tokens, on a relay of its own (the stream's
            # `ChoiceRelays`). A whole answer has none: it has told the client nothing yet, so
            # it starts again on another pair (the service's retry), one prefill for all.
            if not call.ask.stream:
                raise AnswerFailed(failure, failure.client_event())
            raise CannotResume(f"an answer of {ledger.num_choices} choices has no relay each")
        index = relay.choice or 0
        choice = ledger.choices[index]
        service.metrics.migrations.labels(reason=failure.kind.value).inc()
        call.exclude[GEN] = failure.server
        prompt = ledger.prompt_token_ids or await self._prompt_ids()
        replay, splitter = choice.replay, choice.splitter
        if replay is None:
            replay, splitter = await self._replay(choice, prompt)
        lease = await service.lease(call, GEN, service.ids.next_id())
        info = service.placement.server_info(lease.server)
        body = continuation_request(
            call.raw,
            chat=call.endpoint.chat,
            prompt_token_ids=prompt,
            sent=choice.token_ids,
            stops_here=replay is not None,
            max_seq_len=info.max_seq_len if info is not None else None,
            choice=index,
        )
        try:
            leg = await self._open(lease, body, service.config.gen_first_token_timeout)
        except UpstreamRejected:
            await lease.release(success=False)
            raise
        except UpstreamError as exc:
            await lease.release(success=False)
            raise leg_failure(exc) from None
        except BaseException:
            await lease.release(success=False)
            raise
        ledger.start_continuation(replay, index, splitter)
        log.warning(
            "%s; resuming %s on %s after %d tokens (migration %d of %d)",
            failure,
            "the answer" if ledger.num_choices == 1 else f"choice {index}",
            lease.server,
            len(choice.token_ids),
            relay.migrations,
            relay.max_migrations,
        )
        return leg

    async def _prompt_ids(self) -> list[int]:
        call, service = self.call, self.service
        if call.route.prompt_token_ids is not None:
            return list(call.route.prompt_token_ids)
        info = service.placement.model_info()
        ids = await service.prompts.token_ids(call.req, info.model_path if info else None)
        if ids is None:
            raise CannotResume(
                "the prompt's token ids are not known here (no tokenizer at the coordinator)"
            )
        return ids

    async def _replay(
        self, choice: ChoiceLedger, prompt: Sequence[int]
    ) -> tuple[TextReplay | None, ReasoningSplitter | None]:
        """The dead leg's text state of `choice`, when the coordinator has the tokenizer; and
        for a reasoning model's chat answer, where its thinking stands (`api/reasoning.py`)."""
        info = self.service.placement.model_info()
        tokenizer = await self.service.prompts.tokenizer(info.model_path if info else None)
        if tokenizer is None:
            return None, None
        call = self.call
        stops = stop_strings(call.raw)
        sent, text, reasoning = list(choice.token_ids), choice.text, choice.reasoning
        # The worker's text rules for this request (`SamplingParams`), applied here from now on
        include = call.raw.get("include_stop_str_in_output") is True
        skip = call.raw.get("skip_special_tokens") is not False
        tags = tokenizer.think_tokens if choice.tells_reasoning else None
        splitter = None if tags is None else ReasoningSplitter(thinks_after(prompt, tags))

        def relayed(replayed: str) -> bool:  # told apart as the worker told it
            if splitter is None:
                return replayed == text
            split = splitter.feed(replayed)
            told = split.reasoning == reasoning or not call.ask.include_reasoning
            return split.content == text and told

        def rebuild() -> TextReplay | None:
            detokenizer = tokenizer.incremental_detokenizer(skip_special_tokens=skip)
            return TextReplay.rebuild(
                detokenizer, stops, sent, text, include_stop=include, relayed=relayed
            )

        if len(sent) > INLINE_REPLAY_TOKENS:
            replay = await trio.to_thread.run_sync(rebuild)
        else:
            replay = rebuild()
        if replay is None:
            log.warning("the text relayed is not what this tokenizer gives: gen's text is used")
            return None, None
        return replay, splitter
