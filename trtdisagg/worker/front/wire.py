"""The messages between the engine process and its fronts, and their msgpack encoding.

Every message is one frame: a msgpack array whose first item is its `Kind`. The hot one is
`OUTPUTS`, one per front per engine loop round, with every output of that front's requests: each
output a flat array (`encode_output`), since a generic unstructure per token costs more than
the token's own processing. Requests (`SubmitGroup`) go through cattrs; what is not
serialisable on the front (a compiled grammar) travels as its source (`OutputGrammar`) and is
compiled again in the engine process.

Decoding trusts nothing: a frame of the wrong shape raises `WireError`, which the receiver
counts and drops.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Final

import attrs
import cattrs
import msgpack
from cattrs.preconf.msgpack import make_converter

from trtdisagg.api.grammars import OutputGrammar
from trtdisagg.api.protocol import PerfMetrics
from trtdisagg.errors import TrtDisaggError
from trtdisagg.worker.engine.live import GenerationSource
from trtdisagg.worker.engine.outputs import RequestOutput
from trtdisagg.worker.request import FinishReason, RequestType, SamplingParams
from trtdisagg.worker.token_logprobs import TokenLogprobs


class WireError(TrtDisaggError):
    """A frame that is not a well-formed message; it is dropped and counted."""


class Kind(enum.IntEnum):
    HELLO = 1  # front → engine: [HELLO, front index]; the engine answers STATE
    SUBMIT = 2  # front → engine: [SUBMIT, SubmitGroup]
    ABORT = 3  # front → engine: [ABORT, request id]
    CALL = 4  # front → engine: [CALL, call id, Call, argument]
    OUTPUTS = 5  # engine → front: [OUTPUTS, [output record, ...]]
    REPLY = 6  # engine → front: [REPLY, call id, result]
    STATE = 7  # engine → front: [STATE, why it stopped serving or None]
    SERVING = 8  # front → engine: [SERVING]: its HTTP port is open
    STOP = 9  # engine → front: [STOP]: the worker stops; finish the responses under way, exit


class Call(enum.IntEnum):
    """The engine questions a front may ask (`Engine`'s async methods)."""

    RELEASE_SEND = 1  # argument: transfer key → bool
    SENDING_KEY_IN_USE = 2  # argument: transfer key → bool
    RECEIVING_KEY_IN_USE = 3  # argument: transfer key → bool
    METRICS = 4  # argument: None → bytes
    KV_EVENTS = 5  # argument: None (a drain) or a cursor (an int ≥ -1) → list of event objects
    KV_DIGESTS = 6  # argument: None → {key: digest}
    FAIL_STEPS = 7  # argument: count → None


@attrs.frozen(kw_only=True)
class SubmitGroup:
    """One prompt's choices, as `Engine.submit_group` takes them."""

    request_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    samplings: tuple[SamplingParams, ...]  # one per choice (their seeds differ)
    request_type: RequestType
    arrival_time: float  # time.monotonic(): one clock for every process of the machine
    root: int | None = None  # `Request.root`
    source: GenerationSource | None = None
    transfer_key: int | None = None
    grammar: OutputGrammar | None = None

    def __attrs_post_init__(self) -> None:
        if not self.request_ids or len(self.samplings) != len(self.request_ids):
            raise ValueError("one sampling per choice, at least one choice")


# live.py names TokenLogprobs for type checkers only; cattrs reads the annotations at run time.
attrs.resolve_types(GenerationSource, localns={"TokenLogprobs": TokenLogprobs})
_converter = make_converter(forbid_extra_keys=True)
_FINISH: Final = {reason.value: reason for reason in FinishReason}
_PERF_FIELDS: Final = tuple(field.name for field in attrs.fields(PerfMetrics))
_packer = msgpack.Packer(use_bin_type=True)


def pack(message: Sequence[Any]) -> bytes:
    return _packer.pack(message)


def unpack(frame: bytes) -> list[Any]:
    """A message's items, its kind checked."""
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"not msgpack: {exc}") from None
    if not isinstance(message, list) or not message or message[0] not in Kind._value2member_map_:
        raise WireError("not a message: an array led by a known kind is expected")
    return message


def encode_submit(group: SubmitGroup) -> bytes:
    return pack([Kind.SUBMIT, _converter.unstructure(group)])


def decode_submit(payload: object) -> SubmitGroup:
    try:
        return _converter.structure(payload, SubmitGroup)
    except (cattrs.BaseValidationError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise WireError(f"bad SUBMIT: {exc}") from None


# ---- outputs: the hot path ----


def _logprobs_out(lp: TokenLogprobs | None) -> list[Any] | None:
    if lp is None:
        return None
    return [lp.logprob, lp.top] if lp.rank is None else [lp.logprob, lp.top, lp.rank]


def _logprobs_in(item: Any) -> TokenLogprobs | None:
    if item is None:
        return None
    logprob, top, *rank = item
    return TokenLogprobs(
        logprob=float(logprob),
        top=tuple((int(t), float(v)) for t, v in top),
        rank=int(rank[0]) if rank else None,
    )


def encode_output(request_id: int, output: RequestOutput) -> list[Any]:
    """One output as a flat array: 7 items, and 6 more only when a rare field is set."""
    reason = output.finish_reason
    record: list[Any] = [
        request_id,
        output.token_ids,
        output.text,
        None if reason is None else reason.value,
        output.num_prompt_tokens,
        output.num_cached_tokens,
        output.num_output_tokens,
    ]
    rare = (
        any(lp is not None for lp in output.logprobs)
        or output.error is not None
        or output.perf is not None
        or output.context_done
        or output.prompt_logprobs is not None
    )
    if rare:
        perf = output.perf
        prompt = output.prompt_logprobs
        record += [
            [_logprobs_out(lp) for lp in output.logprobs],
            output.error,
            output.internal,
            None if perf is None else [getattr(perf, name) for name in _PERF_FIELDS],
            output.context_done,
            None if prompt is None else [_logprobs_out(lp) for lp in prompt],
        ]
    return record


def encode_closed(request_id: int) -> list[Any]:
    """The record saying request `request_id` has no more outputs."""
    return [request_id]


def decode_output(record: Any) -> tuple[int, RequestOutput | None]:
    """A record's request id and output (None: its outputs ended)."""
    try:
        request_id = record[0]
        if not isinstance(request_id, int):
            raise WireError("an output record starts with its request id")
        if len(record) == 1:
            return request_id, None
        _, tokens, text, reason, prompt, cached, num_out, *rare = record
        if not isinstance(text, str) or not all(isinstance(t, int) for t in tokens):
            raise WireError("an output's tokens are ints and its text a string")
        logprobs: tuple[TokenLogprobs | None, ...] = (None,) * len(tokens)
        error, internal, perf, done, prompt_logprobs = None, False, None, False, None
        if rare:
            lps, error, internal, perf_items, done, prompt_items = rare
            logprobs = tuple(_logprobs_in(lp) for lp in lps)
            if perf_items is not None:
                perf = PerfMetrics(**dict(zip(_PERF_FIELDS, perf_items, strict=True)))
            if prompt_items is not None:
                prompt_logprobs = tuple(lp for lp in map(_logprobs_in, prompt_items) if lp)
        output = RequestOutput(
            token_ids=tuple(tokens),
            text=text,
            logprobs=logprobs,
            finish_reason=None if reason is None else _FINISH[reason],
            num_prompt_tokens=int(prompt),
            num_cached_tokens=int(cached),
            num_output_tokens=int(num_out),
            error=error,
            internal=bool(internal),
            perf=perf,
            context_done=bool(done),
            prompt_logprobs=prompt_logprobs,
        )
    except WireError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise WireError(f"bad output record: {exc!r}") from None
    return request_id, output


def encode_outputs(records: list[list[Any]]) -> bytes:
    return pack([Kind.OUTPUTS, records])


def decode_outputs(message: list[Any]) -> list[tuple[int, RequestOutput | None]]:
    """An OUTPUTS message's outputs, in order. Raises WireError for any bad record: a batch is
    taken whole or not at all."""
    if len(message) != 2 or not isinstance(message[1], list):
        raise WireError("OUTPUTS carries one array of records")
    return [decode_output(record) for record in message[1]]
