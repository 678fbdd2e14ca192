"""DisaggService: one client request → ctx leg → gen leg (DESIGN.md §2), with retries.

Per request (a batch of prompts runs this per prompt, concurrently, and merges the answers:
`choices.py`; a prompt's `n` choices share its legs: one prefill on ctx, one KV transfer, gen
forks them):

1. validate the body (400 naming the field), check readiness (503), start the request deadline
   (``request_timeout``, 504 when it passes);
2. tokenize the prompt when a router or conditional disaggregation needs its token ids;
3. attempt, up to ``1 + max_retries`` times, each attempt with a new ``disagg_request_id`` and
   a new transfer key (random: what addresses the KV)
   (the client's positive one is used for the first) and excluding the servers that failed;
   the second server of an attempt is chosen among those that can exchange KV with the first
   (503 naming the first server and why when none is left):
   * conditional disaggregation: reserve gen first; if the prompt's uncached part is at most
     ``max_local_prefill_length`` tokens, gen serves it alone (plain aggregated request);
   * ``context_first``: ctx leg (non-streaming, ``context_only``, within
     ``ctx_first_token_timeout``); if ctx finished the request, answer with it; else gen leg
     (``generation_only``) with ctx's params and prompt token ids;
   * ``generation_first``: both legs posted concurrently (gen waits for the KV); a request that
     asks for logprobs is served context-first (the KV does not carry the first token's);
4. the gen leg is read as a stream whatever the client asked (`gen_legs.py`): streaming, a
   `RelayBody` goes to the HTTP layer; non-streaming, the whole answer is assembled here.

Worker 4xx answers go back to the client unchanged and are never retried. Unreachable servers,
5xx answers, unusable bodies and legs silent past their first-token deadline are retried on
another server (a worker that missed a deadline also leaves rotation at once); the last failure
becomes a 502 (504 for a deadline). Once the gen leg's stream is open, a failure is no longer
retried from scratch: the answer is resumed on another gen from what was relayed
(``max_migrations``, `resume.py`). Every reservation is a `Lease`, released in a ``finally``;
the gen leg's relay takes over the gen lease and releases it when the answer ends.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any, Final

import attrs
import trio

from trtdisagg.api.codec import parse_request
from trtdisagg.api.protocol import ChatCompletionRequest, CompletionRequest
from trtdisagg.api.validation import num_prompts
from trtdisagg.coordinator.choices import serve_prompts
from trtdisagg.coordinator.cluster import ServerRole
from trtdisagg.coordinator.config import CoordinatorConfig, ScheduleStyle
from trtdisagg.coordinator.gen_legs import GenLegs
from trtdisagg.coordinator.metrics import CoordinatorMetrics
from trtdisagg.coordinator.perf import PhaseClock
from trtdisagg.coordinator.placement import CoordinatorUnavailable, Lease, Placement
from trtdisagg.coordinator.prompts import PromptTokenizer, prompt_text
from trtdisagg.coordinator.relay import StaticBody
from trtdisagg.coordinator.replies import (
    Endpoint,
    JsonReply,
    Reply,
    StreamReply,
)
from trtdisagg.coordinator.resume import (
    CTX_FIRST_TOKEN,
    DeadlineMissed,
    FailureKind,
    LegFailure,
    RequestTimeout,
)
from trtdisagg.coordinator.routers import NoServerAvailable, RouteRequest
from trtdisagg.coordinator.split import (
    AttemptIds,
    ClientAsk,
    CtxResult,
    UpstreamProtocolError,
    answer_as_sse,
    client_disagg_request_id,
    ctx_answer,
    ctx_request,
    gen_first_request,
    gen_request,
    local_request,
    merge_usage,
    parse_ctx_response,
)
from trtdisagg.coordinator.upstream import (
    UpstreamError,
    UpstreamFailed,
    UpstreamRejected,
    UpstreamUnreachable,
    WorkerClient,
)
from trtdisagg.ids import SnowflakeGenerator, new_transfer_key

log = logging.getLogger(__name__)

Json = dict[str, Any]

CTX: Final = ServerRole.CONTEXT
RELEASE_TIMEOUT_S: Final = 2.0  # `release_ctx`, which runs even while the request is cancelled
GEN: Final = ServerRole.GENERATION


class NotReady(CoordinatorUnavailable):
    """The cluster is not ready (HTTP 503)."""


@attrs.define(eq=False, kw_only=True)
class _Call:
    """Everything one client request carries through its attempts."""

    endpoint: Endpoint
    raw: Json
    req: CompletionRequest | ChatCompletionRequest
    ask: ClientAsk
    route: RouteRequest
    clock: PhaseClock
    deadline: float
    headers: dict[str, str]
    outcome: Callable[[str], None]
    exclude: dict[ServerRole, str] = attrs.Factory(dict)


@attrs.define(eq=False, kw_only=True)
class DisaggService:
    config: CoordinatorConfig
    placement: Placement
    client: WorkerClient
    ids: SnowflakeGenerator
    metrics: CoordinatorMetrics
    prompts: PromptTokenizer = attrs.Factory(PromptTokenizer)

    async def handle(self, endpoint: Endpoint, raw: object, headers: dict[str, str]) -> Reply:
        """Serve one client request.

        Raises:
            ApiError (400), NotReady / NoServerAvailable / CoordinatorUnavailable (503),
            UpstreamRejected (the worker's 4xx), UpstreamError (502), RequestTimeout (504).
        """
        arrival = trio.current_time()
        req = parse_request(raw, endpoint.request_class)
        assert isinstance(raw, dict)
        if not self.placement.is_ready():
            raise NotReady(self.placement.not_ready_reason())
        self.metrics.requests_running.inc()
        done = False

        def outcome(status: str) -> None:
            nonlocal done
            if done:
                return
            done = True
            self.metrics.requests_running.dec()
            self.metrics.finished(status)
            if status == "ok":
                self.metrics.e2e_latency.observe(trio.current_time() - arrival)

        try:
            with trio.CancelScope(deadline=arrival + self.config.request_timeout) as scope:
                if num_prompts(req) > 1:
                    reply = await serve_prompts(self, endpoint, raw, req, headers, outcome)
                else:
                    reply = await self.serve_one(endpoint, raw, req, headers, outcome)
            if scope.cancelled_caught:
                limit = self.config.request_timeout
                raise RequestTimeout(f"request did not finish within request_timeout={limit:g}s")
        except BaseException as exc:
            outcome("aborted" if _is_cancellation(exc) else "error")
            raise
        if isinstance(reply, JsonReply):
            self.metrics.time_to_first_token.observe(trio.current_time() - arrival)
            outcome("ok")
        return reply

    async def serve_one(
        self,
        endpoint: Endpoint,
        raw: Json,
        req: CompletionRequest | ChatCompletionRequest,
        headers: dict[str, str],
        outcome: Callable[[str], None],
    ) -> Reply:
        """One choice: a ctx → gen pair (or a local or ctx-finished answer), with retries."""
        arrival = trio.current_time()
        call = _Call(
            endpoint=endpoint,
            raw=raw,
            req=req,
            ask=ClientAsk.of(raw, chat=endpoint.chat),
            route=await self._route_request(req),
            clock=PhaseClock(arrival=arrival),
            deadline=arrival + self.config.request_timeout,
            headers=headers,
            outcome=outcome,
        )
        return await self._with_retries(call)

    async def _route_request(self, req: CompletionRequest | ChatCompletionRequest) -> RouteRequest:
        conditional = self.config.conditional_disagg_config is not None
        need_tokens = conditional or any(self.placement.uses_prompt_tokens(r) for r in ServerRole)
        tokens = None
        if need_tokens:
            info = self.placement.model_info()
            tokens = await self.prompts.token_ids(req, info.model_path if info else None)
        return RouteRequest(
            key=0,
            prompt_token_ids=tuple(tokens) if tokens is not None else None,
            prompt_text=prompt_text(req),
            conversation_id=req.conversation_id or req.session_id,
            cache_salt=req.cache_salt,
        )

    async def _with_retries(self, call: _Call) -> Reply:
        client_id = client_disagg_request_id(call.raw)
        attempts = self.config.max_retries + 1
        for attempt in range(attempts):
            disagg_id = client_id if attempt == 0 and client_id else self.ids.next_id()
            try:
                return await self._attempt(call, AttemptIds(disagg_id, new_transfer_key()))
            except UpstreamError as exc:
                kind = type(exc).__name__
                self.metrics.upstream_errors.labels(role=exc.role, kind=kind).inc()
                if isinstance(exc, UpstreamUnreachable):
                    self.placement.report_unreachable(ServerRole(exc.role), exc.server, str(exc))
                if not exc.retryable or attempt == attempts - 1:
                    raise
                log.warning("attempt %d of %d failed, retrying: %s", attempt + 1, attempts, exc)
                self.metrics.retries.inc()
                call.exclude[ServerRole(exc.role)] = exc.server
        raise AssertionError("unreachable")

    async def lease(
        self, call: _Call, role: ServerRole, key: int, *, pair_with: str | None = None
    ) -> Lease:
        """Reserve a server of `role` that can exchange KV with `pair_with` (the server of the
        attempt's other leg, when already chosen). A server that failed the last attempt is
        avoided, unless it is the only one left; one that cannot pair never is."""
        route = attrs.evolve(call.route, key=key)
        exclude = call.exclude.get(role)
        select = functools.partial(self.placement.select, role, route, pair_with=pair_with)
        try:
            selection = await select(exclude=exclude)
        except NoServerAvailable:
            if exclude is None:
                raise
            selection = await select(exclude=None)
        router = self.placement.router_type(role).value
        self.metrics.router_decisions.labels(router=router, server=selection.server).inc()
        tokens = call.route.prompt_token_ids
        if tokens is not None and self.placement.uses_prompt_tokens(role):
            labels = {"role": role.value, "router": router}
            self.metrics.router_prompt_tokens.labels(**labels).inc(len(tokens))
            self.metrics.router_matched_tokens.labels(**labels).inc(selection.matched_tokens)
        return Lease(placement=self.placement, role=role, key=key, selection=selection)

    async def _attempt(self, call: _Call, ids: AttemptIds) -> Reply:
        gen: Lease | None = None
        disagg_id = ids.request_id
        try:
            conditional = self.config.conditional_disagg_config
            if conditional is not None:
                gen = await self.lease(call, GEN, disagg_id)
                tokens = call.route.prompt_token_ids
                if tokens is not None and (
                    len(tokens) - gen.selection.matched_tokens
                    <= conditional.max_local_prefill_length
                ):
                    self.metrics.local_prefill.inc()
                    return await self._gen_leg(call, local_request(call.raw), gen, ctx=None)
            # generation_first: ctx's first token comes with the KV, without its logprobs or
            # the prompt's, so a request that asks for either is served context-first (ctx's
            # answer has them).
            if self.config.schedule_style is ScheduleStyle.GENERATION_FIRST and not (
                call.ask.logprobs or call.ask.prompt_logprobs
            ):
                gen = gen or await self.lease(call, GEN, disagg_id)
                return await self._generation_first(call, ids, gen)
            pair_with = gen.server if gen is not None else None
            ctx_lease = await self.lease(call, CTX, disagg_id, pair_with=pair_with)
            ctx = await self._ctx_leg(call, ids, ctx_lease)
            if ctx.finished:
                return self._ctx_reply(call, ctx)
            taken = False
            try:
                # No gen that can pair with ctx left (NoServerAvailable) also releases ctx's KV.
                gen = gen or await self.lease(call, GEN, disagg_id, pair_with=ctx.server)
                reply = await self._gen_leg(call, gen_request(call.raw, ctx), gen, ctx=ctx, ids=ids)
                taken = True
                return reply
            finally:
                if not taken:
                    await self.release_ctx(call, ctx.server, ids)
        finally:
            if gen is not None:
                await gen.release_unless_handed_off(success=False)

    async def _ctx_leg(self, call: _Call, ids: AttemptIds, lease: Lease) -> CtxResult:
        call.clock.ctx_start = trio.current_time()
        success = False
        # Whether ctx may hold KV under `ids` that no gen will take. It may unless it said
        # otherwise (an error status) or never got the request: a leg cancelled while ctx
        # answers (the client left, `request_timeout`) or whose answer broke or did not parse
        # would otherwise strand the prompt's blocks for ctx's whole `kv_transfer_timeout_ms`.
        may_hold = True
        try:
            limit = self.config.ctx_first_token_timeout
            due = call.clock.ctx_start + limit if limit is not None else math.inf
            with trio.move_on_at(min(due, call.deadline)) as scope:
                data = await self.client.post_json(
                    lease.server,
                    call.endpoint.path,
                    ctx_request(call.raw, ids),
                    role=CTX.value,
                    headers=call.headers,
                )
            if scope.cancelled_caught:
                if trio.current_time() >= call.deadline:
                    raise RequestTimeout("request did not finish within request_timeout")
                missed = DeadlineMissed(
                    f"context server {lease.server} did not answer within "
                    f"ctx_first_token_timeout={limit:g}s",
                    server=lease.server,
                    phase=CTX_FIRST_TOKEN,
                    role=CTX.value,
                )
                self.missed(missed)
                raise missed
            try:
                ctx = parse_ctx_response(data, server=lease.server)
            except UpstreamProtocolError as exc:
                raise UpstreamError(str(exc), server=lease.server, role=CTX.value) from None
            success = True
            return ctx
        except UpstreamUnreachable as exc:
            may_hold = exc.sent
            raise
        except (UpstreamFailed, UpstreamRejected):
            may_hold = False
            raise
        finally:
            call.clock.ctx_end = trio.current_time()
            if not success and may_hold:
                await self.release_ctx(call, lease.server, ids)
            await lease.release(success=success)

    async def release_ctx(self, call: _Call, server: str, ids: AttemptIds) -> None:
        """No gen leg took ctx's KV (no gen, refused, unreachable, or the client left): ask ctx
        to stop holding it now rather than for its whole `kv_transfer_timeout_ms` (peers.md,
        pain point 16). Best effort, bounded, and done even when the request is cancelled; a
        gen that did reach ctx cancels on its own, and a release after that changes nothing."""
        outcome = "failed"
        with trio.CancelScope(deadline=trio.current_time() + RELEASE_TIMEOUT_S, shield=True):
            try:
                answer = await self.client.post_json(
                    server, "/disagg/release", {"transfer_key": ids.transfer_key},
                    role=CTX.value, headers=call.headers,
                )  # fmt: skip
                outcome = "released" if answer.get("released") is True else "not_held"
            except UpstreamError as exc:
                log.warning("could not release ctx's KV of request %d: %s", ids.request_id, exc)
        self.metrics.ctx_releases.labels(outcome=outcome).inc()

    def perf_of(self, call: _Call, ctx: CtxResult | None) -> Callable[[Json | None], Json] | None:
        if not call.ask.return_perf_metrics:
            return None
        ctx_metrics = ctx.perf_metrics if ctx is not None else None

        def merged(gen_metrics: Json | None) -> Json:
            now = trio.current_time()
            return call.clock.merged(ctx=ctx_metrics, gen=gen_metrics, now=now)

        return merged

    def _ctx_reply(self, call: _Call, ctx: CtxResult) -> Reply:
        perf = self.perf_of(call, ctx)
        answer = ctx_answer(ctx, ask=call.ask, perf_metrics=perf(None) if perf else None)
        if not call.ask.stream:
            return JsonReply(body=answer)

        async def finish(status: str) -> None:
            await trio.lowlevel.checkpoint()
            call.outcome(status)

        return StreamReply(body=StaticBody(events=answer_as_sse(answer, call.ask), finish=finish))

    async def _gen_leg(
        self,
        call: _Call,
        body: Json,
        lease: Lease,
        *,
        ctx: CtxResult | None,
        ids: AttemptIds | None = None,
        legs: GenLegs | None = None,
    ) -> Reply:
        legs = legs or GenLegs(service=self, call=call, ctx=ctx, ids=ids)
        timeout = self.config.gen_first_token_timeout
        if self.config.schedule_style is ScheduleStyle.GENERATION_FIRST and ctx is None:
            # Posted with the ctx leg (or alone, conditional): its first token may wait for a
            # whole prefill, on ctx or on gen itself.
            ctx_limit = self.config.ctx_first_token_timeout
            timeout = None if timeout is None or ctx_limit is None else timeout + ctx_limit
        return await legs.first(body, lease, first_token_timeout=timeout)

    def missed(self, failure: LegFailure) -> None:
        """A leg failed: count a missed deadline; a worker that did not answer (a broken
        connection, a missed deadline) leaves rotation at once, until its next good health
        check. One that answered with an error stays: its own /health says how it is."""
        if isinstance(failure, DeadlineMissed):
            self.metrics.deadline_misses.labels(phase=failure.phase, server=failure.server).inc()
        if failure.kind is not FailureKind.FAILED:
            role = ServerRole(failure.role)
            self.placement.report_unreachable(role, failure.server, str(failure))

    async def _generation_first(self, call: _Call, ids: AttemptIds, gen: Lease) -> Reply:
        """Post gen before ctx answers, so gen allocates while ctx prefills and the KV moves as
        soon as both sides are ready. gen learns where the KV comes from (ctx's
        ``ctx_info_endpoint`` from its /server_info) and under which id, but not ctx's first
        token: ctx sends that with the KV (TRANSFER_RESULT.first_tokens)."""
        ctx_lease = await self.lease(call, CTX, ids.request_id, pair_with=gen.server)
        info = self.placement.server_info(ctx_lease.server)
        tokens = call.route.prompt_token_ids
        body = gen_first_request(
            call.raw,
            ids,
            ctx_info_endpoint=info.ctx_info_endpoint if info else None,
            prompt_token_ids=list(tokens) if tokens is not None else None,
        )
        gen_result: list[Reply] = []
        gen_error: list[Exception] = []
        ctx_result: list[CtxResult] = []
        ctx_error: list[Exception] = []
        legs = GenLegs(service=self, call=call, ctx_answered=trio.Event())

        async def run_gen() -> None:
            try:
                gen_result.append(await self._gen_leg(call, body, gen, ctx=None, legs=legs))
            except Exception as exc:
                gen_error.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_gen)
            try:
                ctx_result.append(await self._ctx_leg(call, ids, ctx_lease))
            except Exception as exc:
                ctx_error.append(exc)
            if ctx_error or ctx_result[0].finished:
                nursery.cancel_scope.cancel()
            else:
                legs.joined(ctx_result[0], ids)
        if ctx_error or ctx_result[0].finished:
            for reply in gen_result:
                if isinstance(reply, StreamReply):
                    await reply.body.aclose()
            if ctx_error:
                raise ctx_error[0]
            return self._ctx_reply(call, ctx_result[0])
        if gen_error:
            await legs.release_ctx()
            raise gen_error[0]
        reply, ctx = gen_result[0], ctx_result[0]
        if isinstance(reply, StreamReply):
            return reply
        body_out = dict(reply.body)
        body_out["usage"] = merge_usage(ctx.usage, body_out.get("usage"))
        if call.ask.return_token_ids and "prompt_token_ids" not in body_out:
            body_out["prompt_token_ids"] = ctx.prompt_token_ids
        return JsonReply(body=body_out)


def _is_cancellation(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_cancellation(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)
