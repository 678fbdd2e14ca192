"""A request with several choices (`n`, a batch of prompts): one ctx → gen pair per choice.

Each choice is served as a request of its own (`DisaggService.serve_one`, with its retries),
concurrently, from the body `fanout.choice_body` makes (one prompt, `n` 1, the choice's seed).
Whole answers are merged into one body; streams are interleaved as their chunks arrive
(`MergedBody` with `ChoiceSseMerger`), each chunk's choice index set to the choice's own, the
choices' usage chunks summed into one at the end. The answer starts once every choice's ctx leg
has answered, so a worker's 4xx is still the client's HTTP status.

When a prompt's choices share one prefill and one KV transfer, this module's fan-out is what
changes: one ctx leg per prompt, its gen leg forking `n` ways.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trtdisagg.api.codec import SSE_DONE, sse_event, structure_body
from trtdisagg.api.fanout import ChoicePlan, choice_body, plan_choices
from trtdisagg.api.protocol import ChatCompletionRequest, CompletionRequest
from trtdisagg.api.sse import DONE, SseSplitter, parse_event
from trtdisagg.api.streaming import MergedBody
from trtdisagg.coordinator.replies import Endpoint, JsonReply, Reply, StreamReply
from trtdisagg.coordinator.split import ClientAsk

if TYPE_CHECKING:
    from trtdisagg.coordinator.service import DisaggService

log = logging.getLogger(__name__)

Json = dict[str, Any]
HEAD_FIELDS = ("id", "object", "created", "model")


async def serve_choices(
    service: DisaggService,
    endpoint: Endpoint,
    raw: Json,
    req: CompletionRequest | ChatCompletionRequest,
    headers: dict[str, str],
    outcome: Callable[[str], None],
) -> Reply:
    plans = plan_choices(req)
    ask = ClientAsk.of(raw, chat=endpoint.chat)
    replies: list[Reply | None] = [None] * len(plans)

    def counted_once(_status: str) -> None:
        """A choice's own outcome: the request's is counted once, for all its choices."""

    async def serve(i: int, plan: ChoicePlan) -> None:
        body = choice_body(raw, plan, req)
        one = structure_body(body, endpoint.request_class)
        replies[i] = await service.serve_one(endpoint, body, one, headers, counted_once)

    try:
        async with trio.open_nursery() as nursery:
            for i, plan in enumerate(plans):
                nursery.start_soon(serve, i, plan)
    except BaseException as exc:
        for reply in replies:
            if isinstance(reply, StreamReply):
                await reply.body.aclose()
        raise _one_error(exc) from None
    done = [r for r in replies if r is not None]
    single_prompt = len({plan.prompt_index for plan in plans}) == 1
    if all(isinstance(r, JsonReply) for r in done):
        answers = [r.body for r in done if isinstance(r, JsonReply)]
        return JsonReply(body=merge_answers(answers, plans, single_prompt=single_prompt))
    merger = ChoiceSseMerger(plans=plans, ask=ask, single_prompt=single_prompt)
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


def _usage(usages: Sequence[tuple[int, Json]]) -> Json:
    """Each prompt's tokens once (its first choice's), every choice's completion tokens."""
    prompts: dict[int, Json] = {}
    completion = 0
    for prompt_index, usage in usages:
        prompts.setdefault(prompt_index, usage)
        completion += int(usage.get("completion_tokens") or 0)
    prompt = sum(int(u.get("prompt_tokens") or 0) for u in prompts.values())
    cached = sum(
        int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        for u in prompts.values()
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def merge_answers(
    answers: Sequence[Json], plans: Sequence[ChoicePlan], *, single_prompt: bool
) -> Json:
    """The client's whole answer from its choices' answers (each one choice, index 0)."""
    first = answers[0]
    out: Json = {k: first[k] for k in HEAD_FIELDS if k in first}
    choices: list[Json] = []
    usages: list[tuple[int, Json]] = []
    for plan, answer in zip(plans, answers, strict=True):
        choice = dict(answer["choices"][0])
        choice["index"] = plan.index
        if not single_prompt and "prompt_token_ids" in answer:
            choice["prompt_token_ids"] = answer["prompt_token_ids"]
        choices.append(choice)
        if isinstance(answer.get("usage"), dict):
            usages.append((plan.prompt_index, answer["usage"]))
    out["choices"] = choices
    out["usage"] = _usage(usages)
    if single_prompt and "prompt_token_ids" in first:
        out["prompt_token_ids"] = first["prompt_token_ids"]
    if "perf_metrics" in first:
        out["perf_metrics"] = first["perf_metrics"]
    return out


@attrs.define(eq=False, kw_only=True)
class ChoiceSseMerger:
    """The choices' SSE streams (each a whole answer's stream, index 0) → one stream."""

    plans: Sequence[ChoicePlan]
    ask: ClientAsk
    single_prompt: bool
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

    def _rewrite(self, index: int, data: Json) -> Json | None:
        """A choice's chunk as the merged stream's, or None for what is summed at the end."""
        if self._head is None:
            self._head = {k: data[k] for k in HEAD_FIELDS if k in data}
        perf = data.pop("perf_metrics", None)
        if isinstance(perf, dict) and self._perf is None:
            self._perf = perf
        choices = data.get("choices")
        if not choices:  # the choice's usage (or perf) chunk
            if isinstance(data.get("usage"), dict):
                self._usage[index] = data["usage"]
            return None
        plan = self.plans[index]
        out = {**data, **self._head, "choices": [{**c, "index": plan.index} for c in choices]}
        if not self.single_prompt and "prompt_token_ids" in out:
            ids = out.pop("prompt_token_ids")
            out["choices"] = [{**c, "prompt_token_ids": ids} for c in out["choices"]]
        return out

    def failed(self, index: int, error: Exception) -> list[bytes]:
        self.stopped = True
        message = f"choice {self.plans[index].index} failed: {error}"
        body = {"error": {"message": message, "type": "upstream_error", "code": 502}}
        return [sse_event(body)]

    def closing(self) -> list[bytes]:
        if self.stopped:
            return [SSE_DONE]
        head = {**(self._head or {}), "choices": []}
        extra = {"perf_metrics": self._perf} if self._perf is not None else {}
        usages = [(self.plans[i].prompt_index, u) for i, u in sorted(self._usage.items())]
        events: list[bytes] = []
        if self.ask.include_usage:
            events.append(sse_event({**head, "usage": _usage(usages), **extra}))
        elif extra:
            events.append(sse_event({**head, **extra}))
        return [*events, SSE_DONE]
