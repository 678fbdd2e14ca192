"""GenRelay: one choice's gen stream read to the end of its answer, resumed on another gen when a
leg dies or stalls (stream migration; Dynamo calls it request migration).

A *leg* is one gen stream: the first is the request's gen leg, the next ones continuations
(`continuation.py`). Each read of a leg waits at most until its next deadline:

* before its first token: ``first_token_timeout`` after it was posted (`gen_first_token_timeout`;
  under generation_first the first leg's also covers ctx's prefill);
* after a token: ``inter_token_timeout`` after that token;
* never past the request's deadline (``request_timeout``): the answer then ends with a 504 and
  nothing is resumed.

A leg fails when its connection breaks or its stream ends early (`UNREACHABLE`), when gen sends
an error event (`FAILED`), or when one of its deadlines passes (`DEADLINE`). The failed leg is cut
at once: its response is closed, so its worker aborts the request and frees its blocks (a stalled
worker does so when it wakes up), and its reservation is released. The `Resumer` (the service)
counts and reports the failure (a worker that did not answer leaves rotation until its next good
health check) and opens a continuation, up to ``max_migrations`` per answer; when none is left the
answer ends with `AnswerFailed`. A leg that breaks after the answer's last token completes it.

A leg carries every choice of the answer (`n`), but a continuation carries one: when a streamed
answer of several choices loses its leg, each unfinished choice goes on in a relay of its own
(`GenRelay.choice`, sharing the answer's ledger), read by a task of its own in the stream's
nursery (`ChoiceRelays`), and their events go out in the order they come. Each has its own
``max_migrations``. A whole answer has told the client nothing: it is served again instead.
"""

from __future__ import annotations

import enum
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, Protocol

import attrs
import httpx
import trio

from trtdisagg.api.errors import ApiError
from trtdisagg.api.sse import DONE, SseSplitter, parse_event
from trtdisagg.coordinator.choice_relays import ChoiceRelays
from trtdisagg.coordinator.ledger import Ledger, StreamError
from trtdisagg.coordinator.placement import CoordinatorUnavailable, Lease
from trtdisagg.coordinator.routers import NoServerAvailable
from trtdisagg.coordinator.upstream import UpstreamError, UpstreamRejected, UpstreamUnreachable
from trtdisagg.errors import TrtDisaggError

Json = dict[str, Any]

CLOSE_TIMEOUT: Final = 2.0
GEN_FIRST_TOKEN: Final = "gen_first_token"
INTER_TOKEN: Final = "inter_token"
CTX_FIRST_TOKEN: Final = "ctx_first_token"
GENERATION: Final = "generation"


class RequestTimeout(TrtDisaggError):
    """The request did not finish within ``request_timeout`` (HTTP 504)."""


class FailureKind(enum.Enum):
    UNREACHABLE = "unreachable"  # the connection broke, or the stream ended before the answer
    FAILED = "failed"  # gen answered an error (5xx, or an error event mid-stream)
    DEADLINE = "deadline"  # a phase deadline passed


class LegFailure(UpstreamError):
    """A leg failed; another server may do better (retryable)."""

    status = 502

    def __init__(
        self,
        message: str,
        *,
        server: str,
        kind: FailureKind,
        role: str = GENERATION,
        event: Json | None = None,
    ) -> None:
        super().__init__(message, server=server, role=role)
        self.kind = kind
        self.event = event  # gen's own error event, passed on as it was

    def client_event(self) -> Json:
        """What a streaming client gets when the answer ends on this failure."""
        if self.event is not None:
            return self.event
        return ApiError(self.status, str(self)).to_json()


def leg_failure(exc: UpstreamError) -> LegFailure:
    """A leg's post that failed (refused, unreachable, 5xx), as a failure of that leg: another
    gen may answer."""
    if isinstance(exc, LegFailure):
        return exc
    kind = FailureKind.UNREACHABLE if isinstance(exc, UpstreamUnreachable) else FailureKind.FAILED
    return LegFailure(str(exc), server=exc.server, kind=kind)


class DeadlineMissed(LegFailure):
    """A leg (or ctx's) missed a phase deadline; the worker left rotation (HTTP 504)."""

    status = 504

    def __init__(self, message: str, *, server: str, phase: str, role: str = GENERATION) -> None:
        super().__init__(message, server=server, kind=FailureKind.DEADLINE, role=role)
        self.phase = phase


class AnswerFailed(TrtDisaggError):
    """The answer cannot be completed: `cause` is the typed error (what a whole answer raises),
    `event` the OpenAI error event a stream ends with."""

    def __init__(self, cause: Exception, event: Json) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.event = event


class CannotResume(CoordinatorUnavailable):
    """What a continuation needs is missing (the prompt's token ids): HTTP 503."""


def _describe(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


@attrs.define(eq=False, kw_only=True)
class Leg:
    """One gen stream: its open response and its reservation, both closed by `close`. A leg
    made with `opener` instead of a response is posted by its first read (within its first
    token's deadline), so that the client's stream may start before it (`GenRelay.lead`)."""

    response: httpx.Response | None
    lease: Lease
    posted: float
    first_token_timeout: float | None
    opener: Callable[[], Awaitable[httpx.Response]] | None = None
    splitter: SseSplitter = attrs.Factory(SseSplitter)
    last_token: float | None = None
    done: bool = False  # its [DONE] came
    _chunks: AsyncIterator[bytes] | None = None
    _closed: bool = False

    @property
    def server(self) -> str:
        return self.lease.server

    def due(self, inter_token_timeout: float | None) -> tuple[float, str]:
        """When the next token is due, and the phase that deadline belongs to."""
        if self.last_token is None:
            limit, start, phase = self.first_token_timeout, self.posted, GEN_FIRST_TOKEN
        else:
            limit, start, phase = inter_token_timeout, self.last_token, INTER_TOKEN
        return (math.inf if limit is None else start + limit), phase

    async def read(self) -> bytes:
        """The next bytes. Raises StopAsyncIteration at the end, httpx.HTTPError on a break,
        what `opener` raises (UpstreamError) when it is posted here."""
        if self._chunks is None:
            if self.response is None:
                assert self.opener is not None, "a leg without a response has an opener"
                self.response = await self.opener()
            self._chunks = self.response.aiter_raw()
        return await self._chunks.__anext__()

    async def close(self, *, success: bool) -> None:
        """Close the response (an unfinished request is aborted by its worker) and release the
        reservation; once, shielded and bounded."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
            if self._chunks is not None:
                await self._chunks.aclose()  # type: ignore[attr-defined]
            if self.response is not None:
                await self.response.aclose()
        await self.lease.release(success=success)


class Resumer(Protocol):
    def missed(self, failure: LegFailure) -> None:
        """Count `failure`; take its worker out of rotation when it did not answer."""
        ...

    async def abandoned(self, relay: GenRelay) -> None:
        """The first leg failed before any token: ctx's KV will not be taken by it."""
        ...

    async def resume(self, relay: GenRelay, failure: LegFailure) -> Leg:
        """Open the continuation of `relay`'s answer (of its `choice`) on another gen.

        Raises:
            LegFailure (try again, if the budget allows), or any other error: the answer fails.
        """
        ...


@attrs.define(eq=False, kw_only=True)
class GenRelay:
    ledger: Ledger
    leg: Leg
    deadline: float
    """The request's (``request_timeout``)."""
    inter_token_timeout: float | None
    max_migrations: int
    resumer: Resumer
    on_first_token: Callable[[], None]  # the client's first token went out
    on_gen_token: Callable[[], None] = lambda: None  # gen's first token came (on any leg)
    migrations: int = 0
    choice: int | None = None
    """The one choice its legs carry, once each choice has legs of its own; None: all."""
    nursery: trio.Nursery | None = None
    """Where each choice's relay is read once a leg of several choices failed (a stream's);
    without one, such an answer is resumed whole (`Resumer.resume`)."""
    _choices: ChoiceRelays | None = None
    _resuming: LegFailure | None = attrs.field(default=None, alias="resuming")
    """A choice's relay starts by resuming its choice after this failure of the shared leg."""
    _pending: list[Json] = attrs.Factory(list)
    _complete: bool = False
    _failed: AnswerFailed | None = None
    _seen_token: bool = False
    _gen_spoke: bool = False
    _abandoned: bool = False  # ctx was told no gen takes its KV

    @property
    def complete(self) -> bool:
        return self._complete

    @property
    def _finish_reason(self) -> str | None:
        """Its choice's (or, for a relay of every choice, the answer's) finish reason."""
        if self.choice is None:
            return self.ledger.finish_reason
        return self.ledger.choices[self.choice].finish_reason

    @property
    def _finished_here(self) -> bool:
        if self.choice is None:
            return self.ledger.finished_here
        return self.ledger.choices[self.choice].finished_here

    async def next_events(self) -> list[Json] | None:
        """The client's next events ([] when what came shows nothing yet), or None once the
        answer is complete.

        Raises:
            AnswerFailed: the answer cannot be completed (the leg is already cut).
        """
        if self._pending:  # what `lead` gave: out before the first leg is even posted
            out, self._pending = self._pending, []
            return out
        if self._choices is not None:
            events = await self._choices.next_events()
            if events is None:  # every choice is complete
                self._complete = True
                return self.ledger.closing() or None
            return events
        if not self._complete and self._failed is None:
            try:
                try:
                    if self._resuming is not None:
                        failure, self._resuming = self._resuming, None
                        await self._resume(failure)
                    else:
                        await self._step()
                except LegFailure as failure:
                    await self._recover(failure)
            except AnswerFailed as failed:
                self._failed = failed  # raised once the events that came before it are out
        out, self._pending = self._pending, []
        if out:
            return out
        if self._failed is not None:
            raise self._failed
        return None if self._complete else []

    def lead(self, events: list[Json]) -> None:
        """The client's first events, from ctx's answer (`Ledger.lead_with`): they are its
        first token, out before the first leg's."""
        self._pending += events
        self._seen_token = True
        self.on_first_token()

    async def aclose(self) -> None:
        await self.leg.close(success=self._complete)
        if self._choices is not None:
            await self._choices.aclose()
        if not self._complete:  # the client left: ctx's KV may be waiting for a gen that left too
            await self._abandon()

    async def _abandon(self) -> None:
        """While no token came on the first leg, gen may not have taken ctx's KV (it may still
        wait for blocks): ctx is told to free it now (a release after gen took it is a no-op)."""
        if not self._abandoned and self.ledger.leg == 0 and not self.ledger.gen_tokens:
            self._abandoned = True
            await self.resumer.abandoned(self)

    async def _step(self) -> None:
        leg = self.leg
        chunk = await self._read()
        if chunk is None:
            if self._finish_reason is None:
                raise LegFailure(
                    f"generation server {leg.server} stream failed: it ended before the answer",
                    server=leg.server,
                    kind=FailureKind.UNREACHABLE,
                )
            await self._finish()
            return
        self._accept(chunk)
        if self._finished_here:
            await self._finish()

    async def _read(self) -> bytes | None:
        leg = self.leg
        due, phase = leg.due(self.inter_token_timeout)
        try:
            with trio.CancelScope(deadline=min(due, self.deadline)) as scope:
                chunk = await leg.read()
        except StopAsyncIteration:
            return None
        except httpx.HTTPError as exc:
            raise LegFailure(
                f"generation server {leg.server} stream failed: {_describe(exc)}",
                server=leg.server,
                kind=FailureKind.UNREACHABLE,
            ) from None
        except UpstreamRejected as exc:  # a leg posted by its first read: gen's own 4xx
            await leg.close(success=False)
            raise AnswerFailed(exc, exc.json_body()) from None
        except UpstreamError as exc:  # (the same, refused or 5xx: another gen may answer)
            raise leg_failure(exc) from None
        if scope.cancelled_caught:
            if trio.current_time() >= self.deadline:
                await leg.close(success=False)
                raise AnswerFailed(
                    RequestTimeout("request did not finish within request_timeout"),
                    ApiError(504, "request timed out while streaming").to_json(),
                )
            first = phase == GEN_FIRST_TOKEN
            limit = leg.first_token_timeout if first else self.inter_token_timeout
            raise DeadlineMissed(
                f"generation server {leg.server} sent no token within {phase}_timeout={limit:g}s",
                server=leg.server,
                phase=phase,
            )
        return chunk

    def _accept(self, chunk: bytes) -> None:
        leg = self.leg
        for event in leg.splitter.feed(chunk):
            data = parse_event(event)
            if data is DONE:
                leg.done = True
                if self._finish_reason is None:
                    raise LegFailure(
                        f"generation server {leg.server} stream failed: [DONE] before the answer",
                        server=leg.server,
                        kind=FailureKind.FAILED,
                    )
                return
            before = self.ledger.gen_tokens
            try:
                self._pending += self.ledger.gen_event(data, self.choice)
            except StreamError as exc:
                raise LegFailure(
                    f"generation server {leg.server} failed mid-stream: {exc}",
                    server=leg.server,
                    kind=FailureKind.FAILED,
                    event=exc.body,
                ) from None
            if self.ledger.gen_tokens > before:
                leg.last_token = trio.current_time()
                if not self._gen_spoke:  # (ctx's token repeated, when the stream led with it)
                    self._gen_spoke = True
                    self.on_gen_token()
                if not self._seen_token:
                    self._seen_token = True
                    self.on_first_token()
            if self._finished_here:
                return

    async def _finish(self) -> None:
        if self.ledger.finish_reason is not None:  # (a choice's relay: every choice is done)
            self._pending += self.ledger.closing()
        self._complete = True
        await self.leg.close(success=True)

    async def _recover(self, failure: LegFailure) -> None:
        """Cut the failed leg; complete the answer, or resume it, or raise AnswerFailed."""
        self.resumer.missed(failure)
        await self.leg.close(success=False)
        await self._abandon()
        if self._finish_reason is not None:  # the answer was whole when the leg broke
            if self.ledger.finish_reason is not None:
                self._pending += self.ledger.closing()
            self._complete = True
            return
        if self.choice is None and self.ledger.num_choices > 1 and self.nursery is not None:
            self._choices = ChoiceRelays.start(self._choice_relays(failure), self.nursery)
            return
        await self._resume(failure)

    def _choice_relays(self, failure: LegFailure) -> list[GenRelay]:
        """A relay for each unfinished choice, to resume it after `failure` of this leg."""
        return [
            GenRelay(
                ledger=self.ledger,
                leg=self.leg,
                deadline=self.deadline,
                inter_token_timeout=self.inter_token_timeout,
                max_migrations=self.max_migrations,
                resumer=self.resumer,
                on_first_token=self._choice_first_token,
                on_gen_token=self._choice_gen_token,
                migrations=self.migrations,
                choice=state.index,
                resuming=failure,
            )
            for state in self.ledger.choices
            if state.finish_reason is None
        ]

    def _choice_first_token(self) -> None:  # the answer's first token, whichever choice's
        if not self._seen_token:
            self._seen_token = True
            self.on_first_token()

    def _choice_gen_token(self) -> None:
        if not self._gen_spoke:
            self._gen_spoke = True
            self.on_gen_token()

    async def _resume(self, failure: LegFailure) -> None:
        """Open a continuation in place of the failed leg, or raise AnswerFailed."""
        while True:
            if self.migrations >= self.max_migrations:
                raise AnswerFailed(failure, failure.client_event())
            if trio.current_time() >= self.deadline:
                raise AnswerFailed(
                    RequestTimeout("request did not finish within request_timeout"),
                    ApiError(504, "request timed out while streaming").to_json(),
                )
            self.migrations += 1
            try:
                self.leg = await self.resumer.resume(self, failure)
                return
            except LegFailure as again:
                self.resumer.missed(again)
                failure = again
            except UpstreamRejected as exc:  # the worker's own 4xx, as it gave it
                raise AnswerFailed(exc, exc.json_body()) from None
            except RequestTimeout as exc:
                event = ApiError(504, "request timed out while streaming").to_json()
                raise AnswerFailed(exc, event) from None
            except (NoServerAvailable, CoordinatorUnavailable, CannotResume) as exc:
                event = ApiError(503, f"the answer could not be resumed: {exc}").to_json()
                raise AnswerFailed(exc, event) from None
