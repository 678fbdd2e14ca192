"""OpenAI response bodies for completions and chat, whole and streamed. Pure functions.

A request has one or more choices (`api/fanout.py`). `whole_body` assembles the finished choices;
`StreamAssembler` turns each choice's outputs into chunks as they come, so choices interleave in
the order they produce tokens, each ending with its own `finish_reason` chunk, and the stream
ends with one usage chunk (`include_usage`). Usage counts each prompt's tokens once, however many
choices it has (as OpenAI does), and every choice's completion tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from trtdisagg.api.codec import sse_event
from trtdisagg.api.protocol import PerfMetrics, Usage, prune
from trtdisagg.api.reasoning import ReasoningSplitter
from trtdisagg.api.tool_calls import ToolCall, ToolCallParser, tool_call_deltas
from trtdisagg.worker.http.plain_chunk import PlainChunk
from trtdisagg.worker.http.prompt_scores import prompt_scores, with_top
from trtdisagg.worker.token_logprobs import TokenLogprobs

TokenText = Callable[[int], str]
Json = dict[str, Any]


@attrs.frozen(kw_only=True)
class ResponseMeta:
    response_id: str
    created: int
    model: str
    chat: bool
    return_token_ids: bool


@attrs.frozen(kw_only=True)
class ChoiceTokens:
    """How many tokens one choice counts toward usage."""

    prompt_index: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int | None = None  # of them, thinking (a reasoning model's; else None)


def total_usage(choices: Sequence[ChoiceTokens]) -> Usage:
    """Each prompt's tokens once (taken from its first choice), every choice's completion."""
    prompts: dict[int, ChoiceTokens] = {}
    for choice in choices:
        prompts.setdefault(choice.prompt_index, choice)
    thought = [c.reasoning_tokens for c in choices if c.reasoning_tokens is not None]
    return Usage.of(
        sum(c.prompt_tokens for c in prompts.values()),
        sum(c.completion_tokens for c in choices),
        sum(c.cached_tokens for c in prompts.values()),
        reasoning=sum(thought) if thought else None,
    )


def usage_json(usage: Usage) -> Json:
    out: Json = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
    }
    if usage.reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return out


def perf_json(perf: PerfMetrics | None) -> Json | None:
    return None if perf is None else prune(attrs.asdict(perf))


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs | None],
    text_of: TokenText,
    *,
    offset: int = 0,
) -> Json | None:
    """Legacy completions logprobs; `top_logprobs` always holds the sampled token too, as
    OpenAI's do (so `logprobs: 0` gives the sampled token alone). `offset`: where the first
    token starts in the choice's text (a stream's later chunks continue the count)."""
    if not logprobs or all(lp is None for lp in logprobs):
        return None
    tokens, values, tops, offsets = [], [], [], []
    for token, lp in zip(token_ids, logprobs, strict=True):
        text = text_of(token)
        tokens.append(text)
        values.append(lp.logprob if lp else None)
        top: dict[str, float] | None = None
        if lp is not None:
            top = {text_of(t): v for t, v in lp.top}
            top.setdefault(text, lp.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def echoed_logprobs(
    num_prompt_tokens: int, prompt: Sequence[TokenLogprobs] | None
) -> list[TokenLogprobs | None]:
    """The logprobs shown for an echoed prompt: none for its first token, then the computed
    ones (none at all when they are missing)."""
    if prompt is None or len(prompt) != num_prompt_tokens - 1:
        return [None] * num_prompt_tokens
    return [None, *prompt]


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None], text_of: TokenText
) -> Json | None:
    if not logprobs or all(lp is None for lp in logprobs):
        return None

    def entry(token: int, value: float) -> Json:
        text = text_of(token)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    content = []
    for token, lp in zip(token_ids, logprobs, strict=True):
        if lp is None:
            continue
        item = entry(token, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in lp.top]
        content.append(item)
    return {"content": content}


@attrs.frozen(kw_only=True)
class ChoiceResult:
    """One finished choice of a whole (non-streaming) answer."""

    index: int
    text: str
    token_ids: Sequence[int]
    logprobs: Json | None
    finish_reason: str | None
    prompt_token_ids: Sequence[int] | None = None  # per choice: a batch of prompts
    extra: Json | None = None
    tool_calls: Sequence[ToolCall] = ()  # chat: calls found in the text (then not in `text`)
    reasoning: str | None = None  # chat, a reasoning model: its thinking (then not in `text`)
    prompt_logprobs: list[Json | None] | None = None  # vLLM's (`prompt_scores.py`)


def _choice(meta: ResponseMeta, result: ChoiceResult) -> Json:
    choice: Json = {
        "index": result.index,
        "logprobs": result.logprobs,
        "finish_reason": result.finish_reason,
    }
    if meta.chat:
        message: Json = {"role": "assistant", "content": result.text}
        if result.tool_calls:
            message["content"] = result.text or None
            message["tool_calls"] = [call.as_json() for call in result.tool_calls]
        if result.reasoning is not None:
            message["reasoning_content"] = result.reasoning or None
        choice["message"] = message
    else:
        choice["text"] = result.text
        if result.prompt_logprobs is not None:  # (chat's are the answer's)
            choice["prompt_logprobs"] = result.prompt_logprobs
    if meta.return_token_ids:
        choice["token_ids"] = list(result.token_ids)
        if result.prompt_token_ids is not None:
            choice["prompt_token_ids"] = list(result.prompt_token_ids)
    if result.extra:
        choice.update(result.extra)
    return choice


def whole_body(
    meta: ResponseMeta,
    *,
    choices: Sequence[ChoiceResult],
    usage: Usage,
    prompt_token_ids: Sequence[int] | None,
    perf: PerfMetrics | None = None,
) -> Json:
    body: Json = {
        "id": meta.response_id,
        "object": "chat.completion" if meta.chat else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [_choice(meta, c) for c in sorted(choices, key=lambda c: c.index)],
        "usage": usage_json(usage),
    }
    if prompt_token_ids is not None:
        body["prompt_token_ids"] = list(prompt_token_ids)
    scored = next((c.prompt_logprobs for c in choices if c.prompt_logprobs is not None), None)
    if meta.chat and scored is not None:  # one prompt
        body["prompt_logprobs"] = scored
    if perf is not None:
        body["perf_metrics"] = perf_json(perf)
    return body


def _head(meta: ResponseMeta) -> Json:
    return {
        "id": meta.response_id,
        "object": "chat.completion.chunk" if meta.chat else "text_completion",
        "created": meta.created,
        "model": meta.model,
    }


def chunk_body(
    meta: ResponseMeta,
    *,
    index: int = 0,
    text: str | None,
    token_ids: Sequence[int],
    logprobs: Json | None,
    finish_reason: str | None,
    role: bool = False,
    extra: Json | None = None,
    calls: Sequence[Json] = (),
    reasoning: str = "",
) -> Json:
    choice: Json = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
    if meta.chat:
        delta: Json = {}
        if role:
            delta["role"] = "assistant"
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text is not None and (text or not (calls or reasoning)):
            delta["content"] = text
        if calls:
            delta["tool_calls"] = list(calls)
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    if meta.return_token_ids:
        choice["token_ids"] = list(token_ids)
    body = {**_head(meta), "choices": [choice]}
    if extra:
        body.update(extra)
    return body


def whole_as_chunks(meta: ResponseMeta, body: Json, *, include_usage: bool) -> list[Json]:
    """A whole answer (`whole_body`) as a stream's chunks: each choice whole in one, then the
    usage chunk when asked for (best_of, whose best choices are known only at the end)."""
    head = _head(meta)
    chunks: list[Json] = []
    for whole in body["choices"]:
        choice = {
            k: whole[k]
            for k in ("index", "logprobs", "finish_reason", "token_ids", "prompt_logprobs")
            if k in whole
        }
        if meta.chat:
            choice["delta"] = {"role": "assistant", **whole["message"]}
        else:
            choice["text"] = whole["text"]
        chunk: Json = {**head, "choices": [choice]}
        if not chunks and "prompt_token_ids" in body:
            chunk["prompt_token_ids"] = body["prompt_token_ids"]
        chunks.append(chunk)
    if include_usage:
        tail: Json = {**head, "choices": [], "usage": body["usage"]}
        if "perf_metrics" in body:
            tail["perf_metrics"] = body["perf_metrics"]
        chunks.append(tail)
    return chunks


def usage_chunk(meta: ResponseMeta, usage: Usage, perf: PerfMetrics | None) -> Json:
    body: Json = {**_head(meta), "choices": [], "usage": usage_json(usage)}
    if perf is not None:
        body["perf_metrics"] = perf_json(perf)
    return body


@attrs.define(eq=False, kw_only=True)
class ChoiceStream:
    """A streamed choice's progress."""

    index: int
    prompt_token_ids: Sequence[int]
    tokens: ChoiceTokens  # so far (the prompt's until the first output says more)
    echo: str | None = None  # completions with `echo`: the prompt text, sent first
    echoed: bool = False  # the echo went out (with the first output, when it has logprobs)
    tools: ToolCallParser | None = None  # chat with tools: finds the calls in the text
    reasoning: ReasoningSplitter | None = None  # a reasoning model: tells its thinking apart
    text_offset: int = 0  # characters of token text sent so far (logprobs' text_offset)
    started: bool = False  # its first chunk (role, prompt ids) is out
    scored: bool = False  # its prompt's `prompt_logprobs` went out
    finished: bool = False
    plain: PlainChunk | None = None  # its plain chunk's parts, once one is sent


@attrs.define(eq=False, kw_only=True)
class StreamAssembler:
    """Chunks of a streamed answer, choice by choice as outputs arrive (module docstring)."""

    meta: ResponseMeta
    choices: list[ChoiceStream]
    text_of: TokenText
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: bool = False
    prompt_ids_in_first_chunk: bool = False  # completions with `return_token_ids`
    # completions with `echo` and `logprobs`: each choice's echo waits for its first output,
    # which brings the prompt's logprobs, and goes out in one chunk with it
    echo_logprobs: bool = False
    echo_top: int = 0  # the echoed prompt's alternatives (`logprobs`)
    prompt_scores: int | None = None  # vLLM's `prompt_logprobs`: this many alternatives
    include_reasoning: bool = True  # (vLLM's) false: thinking is told apart, and dropped

    def opening(self) -> list[Json]:
        """Chat: each choice's role chunk; completions with `echo`: each prompt's text."""
        out: list[Json] = []
        for choice in self.choices:
            echo_now = choice.echo is not None and not self.echo_logprobs
            if self.meta.chat or echo_now:
                choice.echoed = echo_now
                out.append(self._chunk(choice, text=choice.echo or "", token_ids=(), lp=None))
        return out

    def output(
        self,
        index: int,
        *,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs | None],
        finish_reason: str | None,
        tokens: ChoiceTokens,
        prompt_logprobs: Sequence[TokenLogprobs] | None = None,
    ) -> Json | None:
        """The chunk for one output of choice `index`, or None when it shows nothing (a token
        that completes no character, and nobody asked for ids or logprobs)."""
        choice = self.choices[index]
        choice.tokens = tokens
        carries_tokens = bool(token_ids) and (self.meta.return_token_ids or self.logprobs)
        shown_ids, shown = list(token_ids), list(logprobs)
        scores = self._scores(choice, prompt_logprobs)
        if choice.echo is not None and not choice.echoed:  # with the prompt's logprobs
            choice.echoed = True
            text = choice.echo + text
            prompt_ids = list(choice.prompt_token_ids)
            shown_ids = prompt_ids + shown_ids
            echoed = with_top(prompt_logprobs, self.echo_top)
            shown = [*echoed_logprobs(len(prompt_ids), echoed), *shown]
        reasoning = ""
        if choice.reasoning is not None:  # its thinking apart; calls are read in the rest
            split = choice.reasoning.feed(text)
            if finish_reason is not None:
                split = split + choice.reasoning.finish()
            text, reasoning = split.content, split.reasoning if self.include_reasoning else ""
        calls: list[Json] = []
        if choice.tools is not None:  # the text outside calls, and the calls it completed
            done_before = choice.tools.num_calls
            parsed = choice.tools.feed(text)
            if finish_reason is not None:
                rest = choice.tools.finish()
                parsed = attrs.evolve(parsed, content=parsed.content + rest.content)
                if choice.tools.num_calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
            text = parsed.content
            calls = tool_call_deltas(parsed.calls, done_before)
        shows = text or reasoning or carries_tokens or calls or finish_reason is not None
        if not shows and scores is None:
            return None
        lp = self._logprobs(choice, shown_ids, shown)
        if finish_reason is not None:
            choice.finished = True
        chunk = self._chunk(
            choice, text=text, token_ids=token_ids, lp=lp, finish_reason=finish_reason,
            calls=calls, reasoning=reasoning,
        )  # fmt: skip
        if scores is not None:
            (chunk if self.meta.chat else chunk["choices"][0])["prompt_logprobs"] = scores
        return chunk

    def _scores(
        self, choice: ChoiceStream, prompt_logprobs: Sequence[TokenLogprobs] | None
    ) -> list[Json | None] | None:
        """`prompt_logprobs` when this output brings them and they are still to go out: each
        choice's (completions: a prompt each), or the answer's once (chat)."""
        if self.prompt_scores is None or prompt_logprobs is None or choice.scored:
            return None
        for other in self.choices if self.meta.chat else (choice,):
            other.scored = True
        ids = choice.prompt_token_ids
        return prompt_scores(ids, prompt_logprobs, self.prompt_scores, self.text_of)

    def output_event(
        self,
        index: int,
        *,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs | None],
        finish_reason: str | None,
        tokens: ChoiceTokens,
        prompt_logprobs: Sequence[TokenLogprobs] | None = None,
    ) -> bytes | None:
        """`output`'s chunk as its SSE event; a plain chunk (`PlainChunk`) is formatted from
        its parts."""
        choice = self.choices[index]
        plain = (
            choice.started
            and choice.tools is None
            and choice.reasoning is None
            and (choice.echo is None or choice.echoed)
            and not self.continuous_usage
            and all(lp is None for lp in logprobs)
            and prompt_logprobs is None
        )
        if not plain:
            chunk = self.output(
                index,
                text=text,
                token_ids=token_ids,
                logprobs=logprobs,
                finish_reason=finish_reason,
                tokens=tokens,
                prompt_logprobs=prompt_logprobs,
            )
            return None if chunk is None else sse_event(chunk)
        choice.tokens = tokens
        carries_tokens = bool(token_ids) and (self.meta.return_token_ids or self.logprobs)
        if not text and not carries_tokens and finish_reason is None:
            return None
        if finish_reason is not None:
            choice.finished = True
        if choice.plain is None:
            choice.plain = PlainChunk.of(self.meta, choice.index)
        return choice.plain.event(text, token_ids, finish_reason)

    def closing(self, perf: PerfMetrics | None) -> list[Json]:
        if not self.include_usage:
            return []
        return [usage_chunk(self.meta, self.usage(), perf)]

    def usage(self) -> Usage:
        return total_usage([c.tokens for c in self.choices])

    def _logprobs(
        self,
        choice: ChoiceStream,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs | None],
    ) -> Json | None:
        if self.meta.chat:
            return chat_logprobs(token_ids, logprobs, self.text_of)
        built = completion_logprobs(token_ids, logprobs, self.text_of, offset=choice.text_offset)
        if built is not None:
            choice.text_offset += sum(len(t) for t in built["tokens"])
        return built

    def _chunk(
        self,
        choice: ChoiceStream,
        *,
        text: str,
        token_ids: Sequence[int],
        lp: Json | None,
        finish_reason: str | None = None,
        calls: Sequence[Json] = (),
        reasoning: str = "",
    ) -> Json:
        first = not choice.started
        choice.started = True
        extra: Json = {}
        if first and self.prompt_ids_in_first_chunk and not self.meta.chat:
            extra["prompt_token_ids"] = list(choice.prompt_token_ids)
        if self.continuous_usage:
            extra["usage"] = usage_json(total_usage([choice.tokens]))
        return chunk_body(
            self.meta,
            index=choice.index,
            text=text,
            token_ids=token_ids,
            logprobs=lp,
            finish_reason=finish_reason,
            role=first and self.meta.chat,
            extra=extra,
            calls=calls,
            reasoning=reasoning,
        )
