"""The request that resumes a choice's answer on another gen after its leg died or stalled. Pure.

A continuation is a plain aggregated request to a generation server: its prompt is the original
prompt's token ids followed by every token already relayed, and it asks for what was left of the
answer with the same sampling parameters. That gen prefills prompt + sent tokens itself. A fresh
ctx → gen split would add a ctx leg and a KV transfer (the very step that may have failed) for
no gain in correctness; the price of the aggregated path is one prefill on a gen, once per
migration.

What carries over, and how (`continuation_request`):

* ``max_tokens`` / ``max_completion_tokens`` and ``min_tokens`` lose the tokens already sent
  (completions without ``max_tokens`` get the worker's default of 16, less what was sent), so
  the answer ends where an undisturbed run would (``length`` included: prompt + tokens is the
  same total against the model's context);
* ``echo``, ``n`` and ``best_of`` are gone (each choice is resumed on a request of its own),
  and so are ``truncate_prompt_tokens`` (the prompt sent is the one ctx kept) and
  ``prompt_logprobs`` (the first leg sent the prompt's), ``stream`` and ``return_token_ids``
  are on, ``stream_options`` asks for the usage chunk only (the ledger
  counts usage itself);
* stop strings: text already relayed may end in the first part of a stop string, which the dead
  leg's worker held back. When the coordinator has the tokenizer it rebuilds that worker's
  detokenizer and stop-string state from the tokens sent (`TextReplay.rebuild`, checked against
  the text relayed), drives it with the continuation's tokens exactly as the worker does, and
  ends the answer at the first stop string itself; the continuation is then sent without
  ``stop``. Without the tokenizer the continuation keeps ``stop`` and its worker's text is
  relayed as is: text held back at the cut (a stop string's start, a character whose bytes span
  two tokens) is then lost, and a stop string across the cut is not found;
* seeds: a worker starts a request's random stream at its first draw and skips nothing but
  the one draw of ctx's first token, so no request can start at draw k. A seeded sampling
  continuation therefore draws with `continuation_seed(seed, k)`: each token is still a sample
  from the right distribution and the same failure point gives the same answer, but it is not
  the token sequence the undisturbed run would have drawn. Greedy sampling draws nothing and
  is exact. Choice i of an answer of several samples with `fanout.choice_seed(seed, i)`, its
  continuation from that seed likewise (one that resumes before the choice's first token draws
  it as the undisturbed run did).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

import attrs

from trtdisagg.api.fanout import choice_seed
from trtdisagg.worker.stopping import StopStrings

Json = dict[str, Any]

DEFAULT_COMPLETION_MAX_TOKENS: Final = 16
"""The worker's (and OpenAI's) default ``max_tokens`` for /v1/completions."""


def continuation_seed(seed: int, sent: int) -> int:
    """The seed of a continuation after `sent` tokens: the first 8 bytes of BLAKE2b over
    ``trtdisagg-continuation:{seed}:{sent}``, as a big-endian signed int64."""
    digest = hashlib.blake2b(
        f"trtdisagg-continuation:{seed}:{sent}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "big", signed=True)


def stop_strings(body: Json) -> tuple[str, ...]:
    """The request's stop strings, as the worker reads them (empty ones dropped)."""
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return tuple(s for s in stops if isinstance(s, str) and s)


def continuation_request(
    body: Json,
    *,
    chat: bool,
    prompt_token_ids: Sequence[int],
    sent: Sequence[int],
    stops_here: bool,
    max_seq_len: int | None,
    choice: int = 0,
) -> Json:
    """The aggregated request that continues choice `choice` of `body`'s answer after the
    tokens `sent`.

    `stops_here`: the coordinator finds stop strings itself (`TextReplay`), so gen gets none.
    """
    out = copy.copy(body)
    dropped = (
        "disaggregated_params",
        "best_of",
        "echo",
        "truncate_prompt_tokens",
        "prompt_logprobs",
    )
    for key in (*dropped, *(("stop",) if stops_here else ())):
        out.pop(key, None)
    count = len(sent)
    out["prompt_token_ids"] = [*prompt_token_ids, *sent]
    out["n"] = 1
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}
    out["return_token_ids"] = True
    if chat:
        for field in ("max_completion_tokens", "max_tokens"):
            asked = out.get(field)
            if isinstance(asked, int) and asked > 0:
                out[field] = asked - count
    else:
        asked = out.get("max_tokens")
        if not isinstance(asked, int):
            asked = DEFAULT_COMPLETION_MAX_TOKENS
            if max_seq_len is not None:
                asked = min(asked, max_seq_len - len(prompt_token_ids))
        out["max_tokens"] = asked - count
    min_tokens = out.get("min_tokens")
    if isinstance(min_tokens, int):
        out["min_tokens"] = max(0, min_tokens - count)
    seed = out.get("seed")
    if isinstance(seed, int):
        seed = choice_seed(seed, choice)
        out["seed"] = continuation_seed(seed, count) if count else seed
    return out


class Detokenizer(Protocol):
    """`trtdisagg.worker.tokenization.IncrementalDetokenizer`: token ids in, text deltas out."""

    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@attrs.define(eq=False, kw_only=True)
class TextReplay:
    """The dead leg's text state, rebuilt from the tokens it sent and driven by the
    continuation's tokens, following the worker's rules for each token (`Executor._after_token`):
    an end-of-sequence or stop token adds no text; any other token's text goes through the stop
    strings, and a match ends the answer with the text before it; at the end the detokenizer's
    held-back bytes, then the held-back text, are released."""

    detokenizer: Detokenizer
    stops: StopStrings

    @classmethod
    def rebuild(
        cls,
        detokenizer: Detokenizer,
        stops: tuple[str, ...],
        sent: Sequence[int],
        sent_text: str,
        *,
        include_stop: bool = False,
        relayed: Callable[[str], bool] | None = None,
    ) -> TextReplay | None:
        """Replay `sent` as the dead leg's worker did; None when the text it gives is not the
        text relayed (another tokenizer): the continuation then cannot be vouched for here.
        `include_stop`: the request's `include_stop_str_in_output`. `relayed`: whether the
        text replayed is what was relayed, when that is not plain equality with `sent_text`
        (a reasoning model's answer, relayed apart from its thinking)."""
        replay = cls(detokenizer=detokenizer, stops=StopStrings(stops=stops, include=include_stop))
        text = "".join(replay.stops.feed(replay.detokenizer.add(t)) for t in sent)
        same = relayed(text) if relayed is not None else text == sent_text
        return replay if same and not replay.stops.stopped else None

    def step(self, ids: Sequence[int], finish: str | None) -> tuple[str, str | None, int]:
        """One chunk of the continuation: its tokens `ids` and the worker's `finish` reason →
        the text to relay, the finish reason, and how many of `ids` the answer keeps (fewer
        when a stop string ends it inside the chunk)."""
        text = ""
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            if last and finish == "stop":
                # The worker had no stop strings: its "stop" is an end-of-sequence or stop token.
                return text + self._release(), "stop", i + 1
            text += self.stops.feed(self.detokenizer.add(token))
            if self.stops.stopped:
                return text, "stop", i + 1
            if last and finish is not None:
                return text + self._release(), finish, i + 1
        if not ids and finish is not None:  # ended with no token (the scheduler's LENGTH)
            return text + self.stops.flush(), finish, 0
        return text, None, len(ids)

    def _release(self) -> str:
        text = self.stops.feed(self.detokenizer.flush())
        return text if self.stops.stopped else text + self.stops.flush()
