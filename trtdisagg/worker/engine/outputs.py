"""The output processor: sampled tokens in, what each request's client sees out (pure).

For a whole step at once (`process`), it turns each request's new token into text
(incremental detokenizing), applies the stop rules (EOS, stop token ids, stop strings,
`max_tokens`, the context length), and keeps the request's timings (TTFT, ITL, the phases of
`PerfMetrics`). It decides when a request ends and says why (`Ending`); the loop carries the
ending out. A context_only request ends at its first token unless a stop rule ends it: its
answer goes to the coordinator and its KV to gen (`Ending.handed_over`).

Callers append each token to `request.output_token_ids` first (the scheduler's protocol), so the
lengths seen here include it; a token still in flight (`pending_tokens`) does not count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs

from trtdisagg.api.protocol import PerfMetrics
from trtdisagg.worker.engine.ending import Ending
from trtdisagg.worker.request import FinishReason, RequestType
from trtdisagg.worker.stopping import StopStrings

if TYPE_CHECKING:
    from trtdisagg.worker.engine.live import Live
    from trtdisagg.worker.token_logprobs import TokenLogprobs


class Detokenizer(Protocol):
    """One request's text as its tokens come (`tokenization.IncrementalDetokenizer`)."""

    def add(self, token_id: int) -> str:
        """The text this token completes (a partial character is held back)."""

    def flush(self) -> str:
        """The text held back, at the end."""


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
    # On the first output of a request that asks (`SamplingParams.prompt_logprobs`): prompt
    # tokens 1, 2, ...'s logprobs (token 0 has none: nothing precedes it).
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None

    @property
    def is_last(self) -> bool:
        """Nothing follows it: its request finished, failed, or (ctx) handed over."""
        return self.finish_reason is not None or self.context_done or self.error is not None

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the next one of the same request as one (a reader that fell behind
        sends them in one chunk): tokens, text and logprobs joined, the prompt's logprobs of
        whichever carries them (the first), the rest the later's."""
        prompt = self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
        return attrs.evolve(
            later,
            token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text,
            logprobs=self.logprobs + later.logprobs,
            prompt_logprobs=prompt,
        )


@attrs.define(eq=False, kw_only=True)
class OutputState:
    """One request's text and timings so far."""

    detokenizer: Detokenizer
    stops: StopStrings
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    transfer_bytes: int | None = None  # gen: what its KV transfer moved
    transfer_s: float | None = None
    # Prompt tokens 1, 2, ...'s logprobs as prefill computes them (or ctx sent them); shared by
    # a prompt's choices.
    prompt_logprobs: list[TokenLogprobs] = attrs.Factory(list)

    def add_prompt_logprobs(self, start: int, logprobs: Sequence[TokenLogprobs]) -> None:
        """One prefill chunk's prompt logprobs, of prompt tokens `start`, `start + 1`, ...;
        a chunk computed again (after a preemption) adds nothing."""
        if start == 1 + len(self.prompt_logprobs):
            self.prompt_logprobs.extend(logprobs)

    def scheduled(self, now: float) -> None:
        """The request is in a step (its first one sets the end of its queueing)."""
        if self.first_scheduled is None:
            self.first_scheduled = now

    def transferred(self, num_bytes: int, seconds: float) -> None:
        self.transfer_bytes, self.transfer_s = num_bytes, seconds


@attrs.frozen(kw_only=True)
class Token:
    """One token a request got: sampled by a step, or ctx's first one for a gen request."""

    live: Live
    token_id: int
    logprobs: TokenLogprobs | None = None


@attrs.frozen(kw_only=True)
class Processed:
    """What to send for one token, and how its request ends if it does."""

    live: Live
    output: RequestOutput
    ending: Ending | None


@attrs.define(eq=False, kw_only=True)
class OutputProcessor:
    eos_token_ids: frozenset[int]
    max_seq_len: int
    observe_first_token: Callable[[float], None] = lambda seconds: None  # TTFT
    observe_inter_token: Callable[[float], None] = lambda seconds: None  # ITL

    def process(self, tokens: Sequence[Token], now: float) -> list[Processed]:
        """Every request's new token of one step (or one token ctx sent), in order."""
        return [self._token(token, now) for token in tokens]

    def closing(self, live: Live, ending: Ending, now: float) -> RequestOutput:
        """The last output of a request that ends without a token of its own (aborted, failed,
        dropped): its held-back text if it ends well, its error if not."""
        text = ""
        if ending.reason in (FinishReason.STOP, FinishReason.LENGTH):
            text = _flush(live.state)
        return self._output(
            live,
            (),
            text,
            (),
            reason=ending.reason,
            now=now,
            error=ending.error,
            internal=ending.internal,
        )

    def _token(self, token: Token, now: float) -> Processed:
        live, token_id = token.live, token.token_id
        request, state = live.request, live.state
        if state.first_token is None:
            state.first_token = now
            self.observe_first_token(now - request.arrival_time)
        elif state.last_token is not None:
            self.observe_inter_token(now - state.last_token)
        state.last_token = now

        params = request.sampling
        reason: FinishReason | None = None
        text = ""
        is_eos = token_id in self.eos_token_ids and not params.ignore_eos
        grammar = live.grammar
        if grammar is not None and not is_eos and not grammar.advance(token_id):
            # A token its grammar refused: ctx's first token under another grammar, or a bug.
            error = f"token {token_id} breaks the request's output grammar: {grammar.error}"
            output = self._output(live, (), "", (), reason=FinishReason.ERROR, now=now, error=error)
            return Processed(live=live, output=output, ending=Ending.failed(error))
        if is_eos or token_id in params.stop_token_ids:
            reason = FinishReason.STOP
        else:
            text = state.stops.feed(state.detokenizer.add(token_id))
            if state.stops.stopped or (grammar is not None and grammar.is_stopped):
                reason = FinishReason.STOP  # a grammar that admits nothing more ends it too
        if reason is None and (
            len(request.output_token_ids) >= params.max_tokens
            or request.num_known_tokens >= self.max_seq_len
        ):
            reason = FinishReason.LENGTH
        if reason is not None:
            text += _flush(state)
        tokens, logprobs = (token_id,), (token.logprobs,)
        if reason is None and request.request_type is RequestType.CONTEXT_ONLY:
            output = self._output(live, tokens, text, logprobs, reason=None, now=now, done=True)
            return Processed(live=live, output=output, ending=Ending.handed_over())
        output = self._output(live, tokens, text, logprobs, reason=reason, now=now)
        ending = Ending.finished(reason) if reason is not None else None
        return Processed(live=live, output=output, ending=ending)

    def _output(
        self,
        live: Live,
        tokens: tuple[int, ...],
        text: str,
        logprobs: tuple[TokenLogprobs | None, ...],
        *,
        reason: FinishReason | None,
        now: float,
        error: str | None = None,
        internal: bool = False,
        done: bool = False,
    ) -> RequestOutput:
        request = live.request
        final = reason is not None or done
        prompt_logprobs = None
        if request.sampling.prompt_logprobs is not None and len(request.output_token_ids) <= 1:
            prompt_logprobs = tuple(live.state.prompt_logprobs)
        return RequestOutput(
            token_ids=tokens,
            text=text,
            logprobs=logprobs,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_token_ids),
            perf=perf(live, now) if final else None,
            error=error,
            internal=internal,
            context_done=done,
            prompt_logprobs=prompt_logprobs,
        )


def _flush(state: OutputState) -> str:
    """The text held back at the end: the detokenizer's partial character, then whatever the
    stop strings held (unless one matched, which ends the text where it starts)."""
    if state.stops.stopped:
        return ""
    text = state.stops.feed(state.detokenizer.flush())
    if not state.stops.stopped:
        text += state.stops.flush()
    return text


def perf(live: Live, now: float) -> PerfMetrics:
    """The request's phases, from its arrival to `now`."""
    state = live.state
    arrival = live.request.arrival_time
    first = state.first_token or now
    # A generation_only request's first token (ctx's) precedes its first scheduled step.
    scheduled = min(state.first_scheduled or first, first)
    return PerfMetrics(
        queue_s=scheduled - arrival,
        prefill_s=first - scheduled,
        first_token_s=first - arrival,
        decode_s=now - first,
        kv_transfer_bytes=state.transfer_bytes,
        kv_transfer_s=state.transfer_s,
    )
