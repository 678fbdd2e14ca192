"""What one answer has told the client so far, choice by choice, and gen's SSE events rewritten
for it. Pure.

The coordinator reads every gen leg as a stream (a whole answer too: it assembles the body itself,
`Ledger.whole`) with ``return_token_ids`` and ``include_usage`` asked for internally, so that it
knows at every moment the token ids, the text and the finish state it relayed. That is what a
continuation on another gen starts from when a leg dies or stalls (`continuation.py`,
`resume.py`), and what keeps the client's stream free of duplicates and gaps across legs.

Per event of gen's stream, `Ledger.gen_event` returns what the client gets:

* every chunk carries the first leg's ``id``, ``object``, ``created`` and ``model``;
* ``token_ids`` and ``prompt_token_ids`` are removed unless the client asked for them, and a chunk
  that then shows nothing (a token whose text is held back, and no ids or logprobs asked for) is
  dropped, as the worker itself would not have sent it;
* a continuation's role chunk is dropped (the client had it), its text is the one the dead leg's
  worker would have produced (`TextReplay`, when the coordinator has the tokenizer), its
  completion logprobs' ``text_offset`` continues the dead leg's, and its usage counts the
  original prompt once and every token relayed;
* the first leg's usage merges ctx's (prompt and cached tokens) with gen's (completion tokens),
  and the client gets a usage chunk only if it asked (a perf chunk of its own otherwise, when it
  asked for perf metrics).

A gen leg answers every choice of its prompt (`n`, forked from one prefill): each has its own
`ChoiceLedger`, and the answer is complete once each choice is. A continuation carries one
choice (its tokens so far are one sequence to continue from): its events, whose index is 0,
are that choice's (`gen_event(data, choice=i)`).

An error event raises `StreamError`: the caller decides between a continuation and the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

import attrs

from trtdisagg.api.reasoning import ReasoningSplitter
from trtdisagg.coordinator.split import ClientAsk, merge_usage
from trtdisagg.coordinator.whole_answer import whole_body
from trtdisagg.errors import TrtDisaggError

Json = dict[str, Any]

HEAD_FIELDS: Final = ("id", "object", "created", "model")


class StreamError(TrtDisaggError):
    """gen sent an OpenAI error event mid-stream; `body` is that event's JSON, unchanged."""

    def __init__(self, body: Json) -> None:
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        super().__init__(str(message) if message is not None else str(body))
        self.body = body
        code = error.get("code") if isinstance(error, dict) else None
        self.status = code if isinstance(code, int) and 400 <= code < 600 else 502


class TextSource(Protocol):
    """Text, finish reason and tokens kept for the tokens of one chunk (`TextReplay.step`)."""

    def step(self, ids: Sequence[int], finish: str | None) -> tuple[str, str | None, int]: ...


@attrs.define(eq=False, kw_only=True)
class ChoiceLedger:
    """What one choice told the client so far."""

    index: int
    token_ids: list[int] = attrs.Factory(list)
    """Every token relayed, in order (shown to the client or not)."""
    opening_text: str = ""  # completions with `echo`: the prompt, before any token
    finish_reason: str | None = None
    finished_here: bool = False
    """The coordinator found the stop string (a continuation): gen's leg is to be cut."""
    replay: TextSource | None = None
    texts: list[str] = attrs.Factory(list)  # the generated text relayed, in pieces
    logprobs: list[Json] = attrs.Factory(list)
    tool_calls: list[Json] = attrs.Factory(list)  # chat: the calls its deltas carried
    logprob_chars: int = 0  # completions: text_offset of the next logprobs entry
    leg_chars: int = 0  # logprob_chars when the current leg started
    opened: bool = False  # a chunk went out (chat: the role)
    # ctx's first token and its text, streamed ahead of the first leg (`Ledger.lead_with`),
    # which repeats them: what of them it has not repeated yet, to be cut from its events
    ahead_ids: list[int] = attrs.Factory(list)
    ahead_text: str = ""
    ahead_reasoning: str = ""
    # chat, a reasoning model (`api/reasoning.py`): its thinking was told apart (by the worker,
    # or here for a continuation whose text the coordinator rebuilds: `splitter`)
    tells_reasoning: bool = False
    reasonings: list[str] = attrs.Factory(list)  # the thinking relayed, in pieces
    splitter: ReasoningSplitter | None = None
    prompt_logprobs: list[Any] | None = None  # completions: vLLM's, from the first leg

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasonings)


@attrs.define(eq=False, kw_only=True)
class Ledger:
    ask: ClientAsk
    ctx_usage: Json | None = None
    """ctx's usage (prompt and cached tokens) when the request was split."""
    perf: Callable[[Json | None], Json] | None = None
    """Merges gen's perf_metrics with the coordinator's phases (`return_perf_metrics`)."""
    prompt_token_ids: list[int] | None = None
    """The prompt as the workers tokenized it: ctx's, or the first chunk's, or the coordinator's."""
    num_choices: int = 1  # the choices of the answer (the prompt's `n`)
    head: Json | None = None
    leg: int = 0  # 0: the first leg; k: the k-th continuation
    gen_perf: Json | None = None
    gen_tokens: int = 0  # tokens gen's legs sent (the ones cut as already relayed too)
    usage: Json | None = None  # the client's usage, once gen's usage chunk came
    prompt_logprobs: list[Any] | None = None  # chat: vLLM's, from the first leg
    choices: list[ChoiceLedger] = attrs.field(
        default=attrs.Factory(
            lambda self: [ChoiceLedger(index=i) for i in range(self.num_choices)], takes_self=True
        )
    )
    _first_usage: Json | None = None  # the first leg's first usage, for migrated counts
    _prompt_ids_sent: bool = False
    _tail_sent: bool = False

    # ---- the answer, and (an answer of one choice) its choice ----

    @property
    def token_ids(self) -> list[int]:
        """Every token relayed: the choice's, or all choices' one after another."""
        if self.num_choices == 1:
            return self.choices[0].token_ids
        return [t for choice in self.choices for t in choice.token_ids]

    @property
    def finish_reason(self) -> str | None:
        """None until every choice finished."""
        if any(choice.finish_reason is None for choice in self.choices):
            return None
        return self.choices[-1].finish_reason

    @property
    def finished_here(self) -> bool:
        return any(choice.finished_here for choice in self.choices)

    @property
    def text(self) -> str:
        """The generated text relayed so far (without `opening_text`), of choice 0."""
        return self.choices[0].text

    @property
    def opening_text(self) -> str:
        return self.choices[0].opening_text

    @property
    def replay(self) -> TextSource | None:
        return self.choices[0].replay

    # ---- legs ----

    def start_continuation(
        self,
        replay: TextSource | None,
        choice_index: int = 0,
        splitter: ReasoningSplitter | None = None,
    ) -> None:
        """Choice `choice_index`'s next events come from a continuation leg of its own
        (`continuation.continuation_request`); with `replay`, their text is rebuilt here, and
        `splitter` tells its thinking apart from where the relayed text left it."""
        self.leg += 1
        choice = self.choices[choice_index]
        choice.leg_chars = choice.logprob_chars
        choice.replay, choice.splitter = replay, splitter
        choice.ahead_ids, choice.ahead_text, choice.ahead_reasoning = [], "", ""

    def lead_with(self, answer: Json, tokens: Sequence[int]) -> list[Json]:
        """ctx's first tokens (one per choice) as the answer's first events, streamed before
        gen's leg sends anything: that leg repeats them (with their text and logprobs), and
        that is cut from its events (`_cut_ahead`). `answer` is ctx's whole answer, checked by
        `split.ahead_tokens`."""
        chat = self.ask.chat
        chunk = "chat.completion.chunk" if chat else "text_completion"
        fields = {**answer, "object": chunk}
        self.head = {k: fields[k] for k in HEAD_FIELDS if k in fields}  # a worker's chunk's order
        events: list[Json] = []
        for state, whole, token in zip(self.choices, answer["choices"], tokens, strict=True):
            text = whole["message"]["content"] if chat else whole["text"]
            reasoning = whole["message"].get("reasoning_content") if chat else None
            state.tells_reasoning = chat and "reasoning_content" in whole["message"]
            reasoning = reasoning if isinstance(reasoning, str) else ""
            state.ahead_ids, state.ahead_text, state.ahead_reasoning = [token], text, reasoning
            state.token_ids.append(token)
            if text:
                state.texts.append(text)
            if reasoning:
                state.reasonings.append(reasoning)
            state.opened = True
            logprobs = self._logprobs_of(whole.get("logprobs"), 1, state)
            choice: Json = {"index": state.index, "logprobs": logprobs, "finish_reason": None}
            choices = [choice]
            if chat:  # the role in a chunk of its own, as a worker sends it
                role = {"index": state.index, "logprobs": None, "finish_reason": None,
                        "delta": {"role": "assistant", "content": ""}}  # fmt: skip
                choices.insert(0, role)
                choice["delta"] = {"content": text}
                if reasoning:
                    choice["delta"]["reasoning_content"] = reasoning
            else:
                choice["text"] = text
            if self.ask.return_token_ids:
                for one in choices:
                    one["token_ids"] = [token] if one is choice else []
            events += [{**self.head, "choices": [one]} for one in choices]
        if self.ask.return_token_ids and self.prompt_token_ids is not None:
            events[0]["prompt_token_ids"] = self.prompt_token_ids  # in the first, as a worker's
            self._prompt_ids_sent = True
        return events

    def heard_ctx(self, answer: Json) -> None:
        """ctx's whole answer: a reasoning model's tells its thinking apart (its messages
        carry `reasoning_content`), and so does the client's answer, thinking or not."""
        choices = answer.get("choices")
        if not self.ask.chat or not isinstance(choices, list):
            return
        for state, whole in zip(self.choices, choices, strict=False):
            message = whole.get("message") if isinstance(whole, dict) else None
            state.tells_reasoning |= isinstance(message, dict) and "reasoning_content" in message

    # ---- events ----

    def gen_event(self, data: object, choice: int | None = None) -> list[Json]:
        """The client's events for one event of gen's stream: of a leg of every choice, or
        (`choice`) of that choice's continuation.

        Raises:
            StreamError: the event is an error.
        """
        if not isinstance(data, dict):
            return []
        if "error" in data:
            raise StreamError(data)
        choices = data.get("choices")
        if not choices:
            return self._tail_event(data)
        one = choices[0]
        if not isinstance(one, dict):
            return []
        index = one.get("index", 0) if choice is None else choice
        if not isinstance(index, int) or not 0 <= index < self.num_choices:
            return []
        state = self.choices[index]
        if state.finish_reason is not None:
            return []
        return self._choice_event(data, {**one, "index": index}, state)

    def _head_of(self, data: Json) -> Json:
        if self.head is None:
            self.head = {k: data[k] for k in HEAD_FIELDS if k in data}
        return self.head

    def _choice_event(self, data: Json, choice: Json, state: ChoiceLedger) -> list[Json]:
        out = {**data, **self._head_of(data)}
        out.pop("perf_metrics", None)
        choice = dict(choice)
        if not self.ask.sent_disaggregated_params:
            out.pop("disaggregated_params", None)
            choice.pop("disaggregated_params", None)
        self._prompt_ids(out)
        scored = self._prompt_scores(out, choice, state)
        raw_ids = choice.pop("token_ids", None) or []
        ids = [t for t in raw_ids if isinstance(t, int)]
        self.gen_tokens += len(ids)
        worker_finish = choice.get("finish_reason")
        delta = dict(choice.get("delta") or {}) if self.ask.chat else None
        worker_text = (delta or {}).get("content") if self.ask.chat else choice.get("text")
        told = (delta or {}).pop("reasoning_content", None)
        reasoning = told if isinstance(told, str) else ""
        state.tells_reasoning |= bool(reasoning)
        skip = 0
        if state.ahead_ids or state.ahead_text or state.ahead_reasoning:
            ids, worker_text, reasoning, skip = _cut_ahead(state, ids, worker_text or "", reasoning)
        if state.replay is None:
            text, finish, kept = worker_text or "", worker_finish, len(ids)
        else:
            text, finish, kept = state.replay.step(ids, worker_finish)
            state.finished_here = kept < len(ids) or (finish is not None and worker_finish is None)
            text, reasoning = self._told_apart(state, text, finish)
        ids = ids[:kept]
        if not state.token_ids and not ids:
            state.opening_text += text
        elif text:
            state.texts.append(text)
        if reasoning:
            state.reasonings.append(reasoning)
        state.token_ids += ids
        logprobs = self._logprobs_of(choice.get("logprobs"), kept, state, skip=skip)
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        if self.ask.return_token_ids:
            choice["token_ids"] = ids
        calls = (delta or {}).get("tool_calls")
        if delta is not None:
            if state.opened:
                delta.pop("role", None)  # a continuation's role chunk: the client has it
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text or not (calls or reasoning):
                delta["content"] = text
            else:
                delta.pop("content", None)  # calls or thinking alone, as the worker sends them
            choice["delta"] = delta
            if isinstance(calls, list):
                state.tool_calls += [c for c in calls if isinstance(c, dict)]
        else:
            choice["text"] = text
        if finish is not None:
            state.finish_reason = finish
        if isinstance(out.get("usage"), dict):
            out["usage"] = self._running_usage(out["usage"])
        out["choices"] = [choice]
        shows = (
            bool(text)
            or bool(reasoning)
            or bool(calls)
            or (bool(ids) and (self.ask.return_token_ids or self.ask.logprobs))
            or finish is not None
            or (delta is not None and "role" in delta)
            or "prompt_token_ids" in out
            or scored
        )
        if not shows:
            return []
        state.opened = True
        return [out]

    def _told_apart(self, state: ChoiceLedger, text: str, finish: str | None) -> tuple[str, str]:
        """A rebuilt continuation text's answer and thinking parts (the thinking dropped when
        the client asked for none); without a splitter, all of it is answer."""
        if state.splitter is None:
            return text, ""
        split = state.splitter.feed(text)
        if finish is not None:
            split = split + state.splitter.finish()
        return split.content, split.reasoning if self.ask.include_reasoning else ""

    def _prompt_ids(self, out: Json) -> None:
        """Keep the first leg's prompt ids; show them once, where the client asked for them."""
        given = out.pop("prompt_token_ids", None)
        if given is None:
            return
        if self.prompt_token_ids is None and self.leg == 0 and isinstance(given, list):
            self.prompt_token_ids = list(given)
        if self.ask.return_token_ids and not self._prompt_ids_sent:
            self._prompt_ids_sent = True
            out["prompt_token_ids"] = self.prompt_token_ids if self.leg else given

    def _prompt_scores(self, out: Json, choice: Json, state: ChoiceLedger) -> bool:
        """Keep vLLM's `prompt_logprobs` for the whole answer (completions: the choice's; chat:
        the answer's); whether this event carries them. A continuation's are not the prompt's."""
        where = out if self.ask.chat else choice
        scores = where.get("prompt_logprobs")
        if not isinstance(scores, list):
            return False
        if self.leg:
            del where["prompt_logprobs"]
            return False
        if self.ask.chat:
            self.prompt_logprobs = scores
        else:
            state.prompt_logprobs = scores
        return True

    def _logprobs_of(
        self, logprobs: object, kept: int, state: ChoiceLedger, *, skip: int = 0
    ) -> Json | None:
        """A chunk's logprobs, without the entries of its first `skip` tokens (ctx's, already
        relayed); cut to its first `kept` tokens when the coordinator ended the text inside the
        chunk (a continuation's stop string). Uncut, they may lead with an echoed prompt's
        entries."""
        if not isinstance(logprobs, dict):
            return None
        cut = skip + kept if state.replay is not None else None
        if self.ask.chat:
            content = logprobs.get("content")
            kept_entries = list(content)[skip:cut] if isinstance(content, list) else []
            out = {**logprobs, "content": kept_entries}
        else:
            out = {k: list(v)[skip:cut] if isinstance(v, list) else v for k, v in logprobs.items()}
            offsets = out.get("text_offset")
            if isinstance(offsets, list):
                out["text_offset"] = [o + state.leg_chars for o in offsets if isinstance(o, int)]
            tokens = out.get("tokens")
            if isinstance(tokens, list):
                state.logprob_chars += sum(len(t) for t in tokens if isinstance(t, str))
        state.logprobs.append(out)
        return out

    def _running_usage(self, usage: Json) -> Json:
        """A chunk's usage so far (`continuous_usage_stats`)."""
        if self.leg == 0:
            if self._first_usage is None:
                self._first_usage = usage
            merged = merge_usage(self.ctx_usage, usage)
            return merged if merged is not None else usage
        return self.counted_usage()

    def _tail_event(self, data: Json) -> list[Json]:
        """gen's usage (and perf) chunk: its leg's last before [DONE]."""
        self._head_of(data)
        perf = data.get("perf_metrics")
        if isinstance(perf, dict):
            self.gen_perf = perf
        usage = data.get("usage")
        if isinstance(usage, dict) and self.finish_reason is not None:
            if self.leg == 0:
                self.usage = merge_usage(self.ctx_usage, usage)
            else:
                self.usage = self.counted_usage()
            return self.closing()
        return []

    def counted_usage(self) -> Json:
        """Usage from what was relayed: the prompt once (ctx's count, or the first leg's), every
        token relayed as completion, ctx's cached tokens."""
        base = self.ctx_usage or self._first_usage or {}
        prompt = base.get("prompt_tokens")
        if not isinstance(prompt, int):
            prompt = len(self.prompt_token_ids or ())
        details = base.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        completion = len(self.token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached if isinstance(cached, int) else 0},
        }

    def closing(self) -> list[Json]:
        """The usage chunk the client asked for, or a perf chunk of its own; once."""
        if self._tail_sent:
            return []
        self._tail_sent = True
        head = {**(self.head or {}), "choices": []}
        extra = {"perf_metrics": self.perf(self.gen_perf)} if self.perf is not None else {}
        if self.ask.include_usage:
            return [{**head, "usage": self.usage or self.counted_usage(), **extra}]
        return [{**head, **extra}] if extra else []

    # ---- whole answers ----

    def whole(self) -> Json:
        """The client's non-streaming answer, in the shape of a worker's whole answer."""
        return whole_body(self)


def _cut_ahead(
    state: ChoiceLedger, ids: list[int], text: str, reasoning: str
) -> tuple[list[int], str, str, int]:
    """A first-leg event without what the client already has from ctx's answer (its first
    token, that token's text and thinking): the ids, text and thinking left, and how many ids
    were cut. gen repeats ctx's token first, with the same text (the same detokenizer, stop
    strings and reasoning parser run on both), possibly joined with later tokens in one event.

    Raises:
        StreamError: gen's first token, text or thinking is not ctx's.
    """
    cut = min(len(ids), len(state.ahead_ids))
    if ids[:cut] != state.ahead_ids[:cut]:
        message = f"gen's first token {ids[:cut]} is not ctx's {state.ahead_ids[:cut]}"
        raise StreamError({"error": {"message": message, "code": 502}})
    del state.ahead_ids[:cut]
    text, state.ahead_text = _cut_text(text, state.ahead_text, "text")
    reasoning, state.ahead_reasoning = _cut_text(reasoning, state.ahead_reasoning, "thinking")
    return ids[cut:], text, reasoning, cut


def _cut_text(text: str, ahead: str, what: str) -> tuple[str, str]:
    """`text` without the part of `ahead` it repeats, and what of `ahead` is left to come."""
    if text.startswith(ahead):
        return text[len(ahead) :], ""
    if ahead.startswith(text):
        return "", ahead[len(text) :]
    message = f"gen's first {what} {text!r} is not ctx's {ahead!r}"
    raise StreamError({"error": {"message": message, "code": 502}})
