"""A batch of prompts: one ctx → gen pair per prompt, each carrying the client's `n`.

Each prompt is served as a request of its own (`DisaggService.serve_one`, with its retries),
concurrently, from the body `fanout.prompt_body` makes (that prompt, the client's `n` and `seed`):
its ctx leg prefills once and samples each choice's first token, its gen leg receives the KV once
and forks `n` ways. Whole answers are merged into one body, choice i of prompt p at index
`p × n + i`; streams are interleaved as their chunks arrive (`MergedBody` with `ChoiceSseMerger`),
each chunk's choice index renumbered so, the prompts' usage chunks summed into one at the end. The
answer starts once every prompt's ctx leg has answered, so a worker's 4xx is still the client's
HTTP status. A single prompt with `n` choices needs none of this: its body goes as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trtdisagg.api.codec import SSE_DONE, sse_event, structure_body
from trtdisagg.api.fanout import prompt_body
from trtdisagg.api.protocol import ChatCompletionRequest, CompletionRequest
from trtdisagg.api.sse import DONE, SseSplitter, parse_event
from trtdisagg.api.streaming import MergedBody
from trtdisagg.api.validation import prompts_of
from trtdisagg.coordinator.replies import Endpoint, JsonReply, Reply, StreamReply
from trtdisagg.coordinator.split import ClientAsk

if TYPE_CHECKING:
    from trtdisagg.coordinator.service import DisaggService

log = logging.getLogger(__name__)

Json = dict[str, Any]
HEAD_FIELDS = ("id", "object", "created", "model")


async def serve_prompts(
    service: DisaggService,
    endpoint: Endpoint,
    raw: Json,
    req: CompletionRequest | ChatCompletionRequest,
    headers: dict[str, str],
    outcome: Callable[[str], None],
) -> Reply:
    prompts = prompts_of(req)
    ask = ClientAsk.of(raw, chat=endpoint.chat)
    replies: list[Reply | None] = [None] * len(prompts)

    def counted_once(_status: str) -> None:
        """A prompt's own outcome: the request's is counted once, for all its prompts."""

    async def serve(p: int) -> None:
        body = prompt_body(raw, prompts[p], req)
        one = structure_body(body, endpoint.request_class)
        replies[p] = await service.serve_one(endpoint, body, one, headers, counted_once)

    try:
        async with trio.open_nursery() as nursery:
            for p in range(len(prompts)):
                nursery.start_soon(serve, p)
    except BaseException as exc:
        for reply in replies:
            if isinstance(reply, StreamReply):
                await reply.body.aclose()
        raise _one_error(exc) from None
    done = [r for r in replies if r is not None]
    if all(isinstance(r, JsonReply) for r in done):
        answers = [r.body for r in done if isinstance(r, JsonReply)]
        return JsonReply(body=merge_answers(answers, n=req.n))
    merger = ChoiceSseMerger(n=req.n, ask=ask)
    bodies = [r.body for r in done if isinstance(r, StreamReply)]
    return StreamReply(body=MergedBody(bodies, merger, finish=outcome))


def _one_error(exc: BaseException) -> BaseException:
    """The error to answer with when choices failed: the first that is not a cancellation (the
    others were cancelled because of it), unwrapped so that the routes' handlers see its type."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves: list[BaseException] = []
    stack: list[BaseException] = [exc]
    while stack:
        node = stack.pop(0)
        if isinstance(node, BaseExceptionGroup):
            stack[:0] = list(node.exceptions)
        else:
            leaves.append(node)
    real = [leaf for leaf in leaves if not isinstance(leaf, trio.Cancelled)]
    for other in real[1:]:
        log.info("another choice of the same request also failed: %s", other)
    return real[0] if real else exc


def _usage(usages: Sequence[Json]) -> Json:
    """The prompts' usages summed (each counts its prompt once, and its choices' completions)."""
    prompt = sum(int(u.get("prompt_tokens") or 0) for u in usages)
    completion = sum(int(u.get("completion_tokens") or 0) for u in usages)
    cached = sum(
        int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for u in usages
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def merge_answers(answers: Sequence[Json], *, n: int) -> Json:
    """The client's whole answer from its prompts' answers (prompt p's: its n choices, indices
    0..n-1, its `prompt_token_ids` at the top when asked for)."""
    first = answers[0]
    out: Json = {k: first[k] for k in HEAD_FIELDS if k in first}
    choices: list[Json] = []
    usages: list[Json] = []
    for p, answer in enumerate(answers):
        for choice in answer["choices"]:
            renumbered = {**choice, "index": p * n + int(choice["index"])}
            if "prompt_token_ids" in answer:
                renumbered["prompt_token_ids"] = answer["prompt_token_ids"]
            choices.append(renumbered)
        if isinstance(answer.get("usage"), dict):
            usages.append(answer["usage"])
    out["choices"] = sorted(choices, key=lambda c: int(c["index"]))
    out["usage"] = _usage(usages)
    if "perf_metrics" in first:
        out["perf_metrics"] = first["perf_metrics"]
    return out


@attrs.define(eq=False, kw_only=True)
class ChoiceSseMerger:
    """The prompts' SSE streams (each a whole answer's stream, choices 0..n-1) → one stream."""

    n: int
    ask: ClientAsk
    stopped: bool = False
    _splitters: dict[int, SseSplitter] = attrs.Factory(dict)
    _usage: dict[int, Json] = attrs.Factory(dict)
    _perf: Json | None = None
    _head: Json | None = None

    def opening(self) -> list[bytes]:
        return []

    def item(self, index: int, chunk: bytes) -> list[bytes]:
        splitter = self._splitters.setdefault(index, SseSplitter())
        out: list[bytes] = []
        for event in splitter.feed(chunk):
            data = parse_event(event)
            if data is DONE or not isinstance(data, dict):
                continue  # one [DONE] ends the merged stream
            if "error" in data:
                self.stopped = True
                out.append(sse_event(data))
                return out
            rewritten = self._rewrite(index, data)
            if rewritten is not None:
                out.append(sse_event(rewritten))
        return out

    def _rewrite(self, prompt: int, data: Json) -> Json | None:
        """A prompt's chunk as the merged stream's, or None for what is summed at the end."""
        if self._head is None:
            self._head = {k: data[k] for k in HEAD_FIELDS if k in data}
        perf = data.pop("perf_metrics", None)
        if isinstance(perf, dict) and self._perf is None:
            self._perf = perf
        choices = data.get("choices")
        if not choices:  # the prompt's usage (or perf) chunk
            if isinstance(data.get("usage"), dict):
                self._usage[prompt] = data["usage"]
            return None
        renumbered = [{**c, "index": prompt * self.n + int(c.get("index", 0))} for c in choices]
        out = {**data, **self._head, "choices": renumbered}
        if "prompt_token_ids" in out:  # each choice carries its prompt's in a batch
            ids = out.pop("prompt_token_ids")
            out["choices"] = [{**c, "prompt_token_ids": ids} for c in out["choices"]]
        return out

    def failed(self, index: int, error: Exception) -> list[bytes]:
        self.stopped = True
        message = f"prompt {index} failed: {error}"
        body = {"error": {"message": message, "type": "upstream_error", "code": 502}}
        return [sse_event(body)]

    def closing(self) -> list[bytes]:
        if self.stopped:
            return [SSE_DONE]
        head = {**(self._head or {}), "choices": []}
        extra = {"perf_metrics": self._perf} if self._perf is not None else {}
        usages = [u for _, u in sorted(self._usage.items())]
        events: list[bytes] = []
        if self.ask.include_usage:
            events.append(sse_event({**head, "usage": _usage(usages), **extra}))
        elif extra:
            events.append(sse_event({**head, **extra}))
        return [*events, SSE_DONE]
