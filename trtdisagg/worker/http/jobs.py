"""A request's choices on the worker: each an executor request, read whole or as one stream.

`ChoiceRun` reads one choice's outputs and aborts its executor request when it is dropped
unfinished (a client that leaves, a sibling choice that failed), so its blocks free at the next
step. `Job` assembles the answer: `collect()` for a whole body (ctx's context_only answer among
them), `stream_body()` for SSE, the choices interleaved as they produce tokens (`MergedBody`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from trtdisagg.api.codec import SSE_DONE, sse_event
from trtdisagg.api.errors import ApiError
from trtdisagg.api.fanout import ChoicePlan
from trtdisagg.api.protocol import ChatCompletionRequest, CompletionRequest, PerfMetrics
from trtdisagg.api.reasoning import ReasoningSplitter, ThinkTokens, count_thinking, thinks_after
from trtdisagg.api.streaming import MergedBody
from trtdisagg.api.tool_calls import ToolCall, ToolCallFormat, ToolCallParser, parse_tool_calls
from trtdisagg.worker.engine.live import RequestHandle
from trtdisagg.worker.engine.outputs import RequestOutput
from trtdisagg.worker.http import responses
from trtdisagg.worker.http.engine import Engine
from trtdisagg.worker.http.handoff import ctx_state, first_token_logprobs
from trtdisagg.worker.http.prompt_scores import prompt_scores, with_top
from trtdisagg.worker.request import RequestType
from trtdisagg.worker.token_logprobs import TokenLogprobs

AnyRequest = CompletionRequest | ChatCompletionRequest
Json = dict[str, Any]


@attrs.define(eq=False, kw_only=True)
class ChoiceRun:
    """One choice's executor request; an async iterator of its outputs."""

    plan: ChoicePlan
    handle: RequestHandle
    engine: Engine
    echo: str | None = None  # completions with `echo`: the prompt text
    # After the first, read outputs of at least this many tokens (config `stream_interval`).
    interval: int = 1
    # Completions' echo with max_tokens 0: the prompt is scored, and the one token its prefill
    # samples is not answered (its outputs come without it)
    scoring: bool = False
    done: bool = False  # its last output (or ctx's context_done) arrived
    # A reasoning model's (api/reasoning.py): whether its output is in the thinking now, and
    # how many of its tokens were thinking (usage's `reasoning_tokens`); set by its Job.
    think_tags: ThinkTokens | None = None
    thinking: bool = False
    thought_tokens: int = 0
    _started: bool = attrs.field(default=False, alias="started")  # the first output was read
    _closed: bool = attrs.field(default=False, alias="closed")
    _held: RequestOutput | None = attrs.field(default=None, alias="held")  # read, not sent yet

    @property
    def request_id(self) -> int:
        return self.handle.request.request_id

    def __aiter__(self) -> ChoiceRun:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done or self._closed:
            raise StopAsyncIteration
        output, self._held = self._held, None
        if output is None:
            try:
                output = await self.handle.outputs.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                raise StopAsyncIteration from None
        output = self._coalesce(output)
        if self._started:
            output = await self._fill(output)
        self._started = True
        if output.finish_reason is not None or output.context_done:
            self.done = True
        if self.scoring:
            output = attrs.evolve(output, token_ids=(), text="", logprobs=(), num_output_tokens=0)
        if self.think_tags is not None:
            thought, self.thinking = count_thinking(
                output.token_ids, self.thinking, self.think_tags
            )
            self.thought_tokens += thought
        return output

    async def _fill(self, output: RequestOutput) -> RequestOutput:
        """Wait for outputs until `interval` tokens are in hand (or the last one came)."""
        while len(output.token_ids) < self.interval and not output.is_last:
            try:
                later = await self.handle.outputs.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                break
            if later.error is not None:
                self._held = later
                break
            output = self._coalesce(output.then(later))
        return output

    def _coalesce(self, output: RequestOutput) -> RequestOutput:
        """The outputs already queued behind `output` (its reader fell behind the engine),
        joined to it: one chunk and one write for several tokens. An error output is kept for
        the next read, so the text before it still goes out first."""
        while not output.is_last:
            try:
                later = self.handle.outputs.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if later.error is not None:
                self._held = later
                break
            output = output.then(later)
        return output

    async def aclose(self) -> None:
        self.drop()

    def drop(self) -> None:
        """Stop reading; an unfinished request is aborted (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.handle.outputs.close()
        if not self.done:
            self.engine.abort(self.request_id)

    def tokens(self, output: RequestOutput) -> responses.ChoiceTokens:
        return responses.ChoiceTokens(
            prompt_index=self.plan.prompt_index,
            prompt_tokens=output.num_prompt_tokens,
            cached_tokens=output.num_cached_tokens,
            completion_tokens=output.num_output_tokens,
            reasoning_tokens=self.thought_tokens if self.think_tags is not None else None,
        )


@attrs.frozen(kw_only=True)
class CtxEndpoint:
    """What ctx's context_only answer tells gen about where the KV is (handoff.py)."""

    info_endpoint: str | None
    instance: str | None


@attrs.define(eq=False, kw_only=True)
class Job:
    req: AnyRequest
    runs: list[ChoiceRun]
    meta: responses.ResponseMeta
    text_of: Callable[[int], str]
    ctx: CtxEndpoint
    transfer_key: int | None = None
    disagg_request_id: int | None = None  # context_only: the request's id, for logs
    single_prompt: bool = True  # else each choice carries its own prompt ids
    # chat with tools (not `none`): the text is searched for calls in this format
    tools: ToolCallFormat | None = None
    # chat, a reasoning model: its thinking goes apart from its answer (api/reasoning.py)
    reasoning: ThinkTokens | None = None
    keep: int | None = None  # best_of > n: the n best candidates of each prompt are answered

    def __attrs_post_init__(self) -> None:
        tags = self.reasoning
        if tags is None:
            return
        for run in self.runs:
            run.think_tags = tags
            run.thinking = thinks_after(run.handle.request.prompt_token_ids, tags)

    @property
    def request_id(self) -> int:
        return self.runs[0].request_id

    @property
    def wants_logprobs(self) -> bool:
        return self.runs[0].handle.request.sampling.logprobs is not None

    @property
    def _include_reasoning(self) -> bool:
        return not isinstance(self.req, ChatCompletionRequest) or self.req.include_reasoning

    @property
    def _echo_logprobs(self) -> int | None:
        """Completions' echo with logprobs: the echoed prompt's alternatives; else None."""
        req = self.req
        return req.logprobs if isinstance(req, CompletionRequest) and req.echo else None

    def _splitter(self, run: ChoiceRun) -> ReasoningSplitter | None:
        if self.reasoning is None:
            return None
        return ReasoningSplitter(thinks_after(run.handle.request.prompt_token_ids, self.reasoning))

    def drop(self) -> None:
        for run in self.runs:
            run.drop()

    async def aclose(self) -> None:
        """The HTTP exchange ended (`api.http.close_with_exchange`): unfinished requests end."""
        self.drop()

    # ---- whole answers ----

    async def collect(self) -> Json:
        # Each choice's channel is unbounded, so reading them one after another loses nothing.
        results: list[responses.ChoiceResult] = []
        tokens: list[responses.ChoiceTokens] = []
        handed_over: list[tuple[ChoiceRun, list[RequestOutput]]] = []
        scores: list[float] = []  # each result's cumulative logprob
        perf: PerfMetrics | None = None
        try:
            for run in self.runs:
                outputs = [output async for output in run]
                last = outputs[-1] if outputs else None
                if last is None:
                    raise ApiError(500, f"request {run.request_id} ended without an output")
                self._raise_error(last)
                if last.context_done:  # ctx: every choice of the prompt hands over together
                    handed_over.append((run, outputs))
                    continue
                results.append(self._result(run, outputs))
                scores.append(sum(lp.logprob for o in outputs for lp in o.logprobs if lp))
                tokens.append(run.tokens(last))
                perf = perf or last.perf
        finally:
            self.drop()
        if handed_over:
            if results:
                raise ApiError(500, "some choices of a context_only request handed over, not all")
            return self._context_body(handed_over)
        if self.keep is not None:
            results = self._best(results, scores, self.keep)
        first = self.runs[0].handle.request.prompt_token_ids
        return responses.whole_body(
            self.meta,
            choices=results,
            usage=responses.total_usage(tokens),
            prompt_token_ids=first if self.req.return_token_ids and self.single_prompt else None,
            perf=perf if self.req.return_perf_metrics else None,
        )

    def _best(
        self, results: list[responses.ChoiceResult], scores: list[float], keep: int
    ) -> list[responses.ChoiceResult]:
        """best_of: each prompt's `keep` candidates of highest cumulative logprob, best first,
        numbered p × keep + rank; their logprobs only if the client asked for them."""
        asked = isinstance(self.req, CompletionRequest) and self.req.logprobs is not None
        per_prompt = len(results) // len({run.plan.prompt_index for run in self.runs})
        best: list[responses.ChoiceResult] = []
        for first in range(0, len(results), per_prompt):
            ranked = sorted(
                range(first, first + per_prompt), key=lambda i: (-scores[i], results[i].index)
            )
            for rank, i in enumerate(ranked[:keep]):
                index = first // per_prompt * keep + rank
                chosen = attrs.evolve(results[i], index=index)
                best.append(chosen if asked else attrs.evolve(chosen, logprobs=None))
        return best

    def _raise_error(self, last: RequestOutput) -> None:
        if last.error is None:
            return
        # A generation_only request fails when its KV cannot come from ctx: upstream's fault,
        # unless this worker failed it itself (a model step raised).
        gen = self.runs[0].handle.request.request_type is RequestType.GENERATION_ONLY
        raise ApiError(502 if gen and not last.internal else 500, last.error)

    def _result(self, run: ChoiceRun, outputs: Sequence[RequestOutput]) -> responses.ChoiceResult:
        last = outputs[-1]
        token_ids = [t for o in outputs for t in o.token_ids]
        logprobs = [lp for o in outputs for lp in o.logprobs]
        text = "".join(o.text for o in outputs)
        reasoning = None
        if (splitter := self._splitter(run)) is not None:
            split = splitter.feed(text) + splitter.finish()
            text, reasoning = split.content, split.reasoning if self._include_reasoning else ""
        text = (run.echo or "") + text
        # echo with logprobs: the echoed prompt's tokens come first, the first one without
        # a logprob (nothing precedes it), as OpenAI answers.
        computed = outputs[0].prompt_logprobs
        echo_top = self._echo_logprobs
        prompt = (
            with_top(computed, echo_top) if run.echo is not None and echo_top is not None else None
        )
        shown_ids: list[int] = token_ids
        shown: list[TokenLogprobs | None] = logprobs
        if prompt is not None:
            shown_ids = [*run.handle.request.prompt_token_ids, *token_ids]
            shown = [*responses.echoed_logprobs(len(shown_ids) - len(token_ids), prompt), *logprobs]
        scores = None
        if self.req.prompt_logprobs is not None:  # vLLM's
            ids = run.handle.request.prompt_token_ids
            scores = prompt_scores(ids, computed, self.req.prompt_logprobs, self.text_of)
        finish = last.finish_reason.value if last.finish_reason else None
        calls: tuple[ToolCall, ...] = ()
        if self.tools is not None:
            parsed = parse_tool_calls(text, self.tools)
            text, calls = parsed.content, parsed.calls
            if calls and finish == "stop":
                finish = "tool_calls"
        return responses.ChoiceResult(
            index=run.plan.index,
            text=text,
            token_ids=token_ids,
            tool_calls=calls,
            reasoning=reasoning,
            logprobs=self._logprobs(shown_ids, shown),
            finish_reason=finish,
            prompt_token_ids=None if self.single_prompt else run.handle.request.prompt_token_ids,
            prompt_logprobs=scores,
        )

    def _context_body(self, choices: Sequence[tuple[ChoiceRun, list[RequestOutput]]]) -> Json:
        """ctx's answer to context_only: each choice's first token, plus what gen needs to go
        on (on choice 0: one KV transfer serves every choice)."""
        request = choices[0][0].handle.request
        firsts = [next(t for o in outputs for t in o.token_ids) for _, outputs in choices]
        params: Json = {
            "request_type": "context_only",
            "first_gen_tokens": firsts[:1],
            "ctx_request_id": request.request_id,
            "disagg_request_id": self.disagg_request_id,
            "transfer_key": self.transfer_key,
            "ctx_dp_rank": 0,
            "ctx_info_endpoint": self.ctx.info_endpoint,
            "opaque_state": ctx_state(self.ctx.instance) if self.ctx.instance else None,
        }
        if len(choices) > 1:
            params["first_gen_tokens_by_choice"] = firsts
        prompt = choices[0][1][0].prompt_logprobs
        if prompt is not None:  # echo with logprobs, or prompt_logprobs: gen answers with them
            params["prompt_logprobs"] = [
                first_token_logprobs(token, lp)
                for token, lp in zip(request.prompt_token_ids[1:], prompt, strict=True)
            ]
        logprobs = [next(lp for o in outputs for lp in o.logprobs) for _, outputs in choices]
        if all(lp is not None for lp in logprobs):
            params["first_gen_logprobs"] = [
                first_token_logprobs(token, lp)
                for token, lp in zip(firsts, logprobs, strict=True)
                if lp is not None
            ]
        results = [
            attrs.evolve(self._result(run, outputs), finish_reason=None) for run, outputs in choices
        ]
        extra = {**(results[0].extra or {}), "disaggregated_params": params}
        results[0] = attrs.evolve(results[0], extra=extra)
        last = choices[0][1][-1]
        return responses.whole_body(
            self.meta,
            choices=results,
            usage=responses.total_usage([run.tokens(outputs[-1]) for run, outputs in choices]),
            prompt_token_ids=request.prompt_token_ids,
            perf=last.perf if self.req.return_perf_metrics else None,
        )

    def _logprobs(
        self, tokens: Sequence[int], logprobs: Sequence[TokenLogprobs | None]
    ) -> Json | None:
        if self.meta.chat:
            return responses.chat_logprobs(tokens, logprobs, self.text_of)
        return responses.completion_logprobs(tokens, logprobs, self.text_of)

    # ---- streams ----

    def stream_body(self) -> MergedBody[Any]:
        options = self.req.stream_options
        if self.keep is not None:  # best_of: the best are known at the end, then sent whole
            include_usage = options is not None and options.include_usage
            return MergedBody([WholeAnswer(job=self)], WholeAsChunks(job=self, usage=include_usage))
        assembler = responses.StreamAssembler(
            meta=self.meta,
            choices=[
                responses.ChoiceStream(
                    index=run.plan.index,
                    prompt_token_ids=run.handle.request.prompt_token_ids,
                    tokens=responses.ChoiceTokens(
                        prompt_index=run.plan.prompt_index,
                        prompt_tokens=run.handle.request.num_prompt_tokens,
                        cached_tokens=0,
                        completion_tokens=0,
                    ),
                    echo=run.echo,
                    tools=ToolCallParser(format=self.tools) if self.tools is not None else None,
                    reasoning=self._splitter(run),
                )
                for run in self.runs
            ],
            text_of=self.text_of,
            include_usage=options is not None and options.include_usage,
            continuous_usage=options is not None and options.continuous_usage_stats,
            logprobs=self.wants_logprobs,
            prompt_ids_in_first_chunk=self.req.return_token_ids,
            echo_logprobs=self._echo_logprobs is not None,
            echo_top=self._echo_logprobs or 0,
            prompt_scores=self.req.prompt_logprobs,
            include_reasoning=self._include_reasoning,
        )
        merger = OutputMerger(
            assembler=assembler,
            runs=self.runs,
            with_perf=self.req.return_perf_metrics,
        )
        return MergedBody(list(self.runs), merger)


@attrs.define(eq=False, kw_only=True)
class WholeAnswer:
    """A job's whole answer as a stream's one source (`stream_body` of best_of)."""

    job: Job
    _given: bool = False

    def __aiter__(self) -> WholeAnswer:
        return self

    async def __anext__(self) -> Json:
        if self._given:
            raise StopAsyncIteration
        self._given = True
        return await self.job.collect()

    async def aclose(self) -> None:
        self.job.drop()


@attrs.define(eq=False, kw_only=True)
class WholeAsChunks:
    """A whole answer → a stream's chunks: each choice in one, then the usage chunk."""

    job: Job
    usage: bool
    stopped: bool = False

    def opening(self) -> list[bytes]:
        return []

    def item(self, index: int, body: Json) -> list[bytes]:
        chunks = responses.whole_as_chunks(self.job.meta, body, include_usage=self.usage)
        return [sse_event(chunk) for chunk in chunks]

    def failed(self, index: int, error: Exception) -> list[bytes]:
        self.stopped = True
        failure = error if isinstance(error, ApiError) else ApiError(500, str(error))
        return [sse_event(failure.to_json())]

    def closing(self) -> list[bytes]:
        return [SSE_DONE]


@attrs.define(eq=False, kw_only=True)
class OutputMerger:
    """The choices' executor outputs → SSE chunks (`MergedBody`'s merger)."""

    assembler: responses.StreamAssembler
    runs: list[ChoiceRun]
    with_perf: bool
    stopped: bool = False
    _perf: PerfMetrics | None = None

    def opening(self) -> list[bytes]:
        return [sse_event(chunk) for chunk in self.assembler.opening()]

    def item(self, index: int, output: RequestOutput) -> list[bytes]:
        if output.error is not None:
            self.stopped = True
            return [sse_event(ApiError(500, output.error).to_json())]
        if output.perf is not None and self._perf is None:
            self._perf = output.perf
        event = self.assembler.output_event(
            index,
            text=output.text,
            token_ids=output.token_ids,
            logprobs=output.logprobs,
            finish_reason=output.finish_reason.value if output.finish_reason else None,
            tokens=self.runs[index].tokens(output),
            prompt_logprobs=output.prompt_logprobs,
        )
        return [] if event is None else [event]

    def failed(self, index: int, error: Exception) -> list[bytes]:
        self.stopped = True
        return [sse_event(ApiError(500, f"choice {index} failed: {error}").to_json())]

    def closing(self) -> list[bytes]:
        if self.stopped:
            return [SSE_DONE]
        perf = self._perf if self.with_perf else None
        return [sse_event(chunk) for chunk in self.assembler.closing(perf)] + [SSE_DONE]
