"""The front link's codec: outputs and requests round trip; malformed frames are refused."""

from __future__ import annotations

import msgpack
import pytest

from trtdisagg.api.grammars import OutputGrammar
from trtdisagg.api.protocol import PerfMetrics
from trtdisagg.worker.engine.live import GenerationSource
from trtdisagg.worker.engine.outputs import RequestOutput
from trtdisagg.worker.front.wire import (
    Kind,
    SubmitGroup,
    WireError,
    decode_outputs,
    decode_submit,
    encode_closed,
    encode_output,
    encode_outputs,
    encode_submit,
    pack,
    unpack,
)
from trtdisagg.worker.request import FinishReason, RequestType, SamplingParams
from trtdisagg.worker.token_logprobs import TokenLogprobs


def plain(token: int, **fields: object) -> RequestOutput:
    base: dict[str, object] = {
        "token_ids": (token,),
        "text": f"<{token}>",
        "logprobs": (None,),
        "finish_reason": None,
        "num_prompt_tokens": 5,
        "num_cached_tokens": 2,
        "num_output_tokens": 3,
    }
    return RequestOutput(**{**base, **fields})  # type: ignore[arg-type]


def round_trip(records: list[tuple[int, RequestOutput | None]]) -> list[tuple[int, object]]:
    encoded = [
        encode_closed(rid) if out is None else encode_output(rid, out) for rid, out in records
    ]
    return list(decode_outputs(unpack(encode_outputs(encoded))))


def test_a_batch_of_outputs_round_trips_in_order() -> None:
    lp = TokenLogprobs(logprob=-0.5, top=((7, -0.5), (9, -1.25)))
    rare = plain(
        7,
        logprobs=(lp,),
        finish_reason=FinishReason.STOP,
        error=None,
        perf=PerfMetrics(queue_s=0.1, prefill_s=0.2, kv_transfer_bytes=4096),
        context_done=True,
        prompt_logprobs=(lp, TokenLogprobs(logprob=-2.0, top=())),
    )
    failed = plain(8, finish_reason=FinishReason.ERROR, error="boom", internal=True)
    batch: list[tuple[int, RequestOutput | None]] = [
        (1, plain(42)),
        (2, rare),
        (1, None),
        (3, failed),
        (4, plain(0, token_ids=(), text="", logprobs=())),
    ]
    assert round_trip(batch) == batch


def test_a_plain_output_is_a_short_record() -> None:
    """The hot path: no logprobs, perf or error, so the 6 rare items are not sent."""
    assert len(encode_output(1, plain(42))) == 7
    assert len(encode_output(1, plain(42, finish_reason=FinishReason.LENGTH))) == 7


def test_a_submit_group_round_trips() -> None:
    group = SubmitGroup(
        request_ids=(4, 6),
        prompt_token_ids=(1, 2, 3),
        samplings=(
            SamplingParams(
                max_tokens=5,
                temperature=0.0,
                stop=("\n", "END"),
                stop_token_ids=frozenset({2, 9}),
                logit_bias={5: -100.0, 3: 2.5},
                seed=11,
                logprobs=2,
            ),
            SamplingParams(max_tokens=5, seed=12),
        ),
        request_type=RequestType.GENERATION_ONLY,
        arrival_time=123.25,
        source=GenerationSource(
            key=2**41 + 5,
            ctx_info_endpoint="tcp://127.0.0.1:5555",
            first_tokens=(17, 18),
            first_logprobs=(TokenLogprobs(logprob=-1.0, top=((17, -1.0),)), None),
            num_choices=2,
        ),
        transfer_key=None,
        grammar=OutputGrammar(field="response_format", grammar='{"grammars": []}'),
    )
    [kind, payload] = unpack(encode_submit(group))
    assert kind == Kind.SUBMIT
    assert decode_submit(payload) == group


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb({"kind": 5}), "not a message"),
        (msgpack.packb([99, []]), "not a message"),
        (msgpack.packb([]), "not a message"),
    ],
)
def test_a_frame_that_is_no_message_is_refused(frame: bytes, why: str) -> None:
    with pytest.raises(WireError, match=why):
        unpack(frame)


@pytest.mark.parametrize(
    "records",
    [
        [["x"]],  # the request id is not an int
        [[1, [1, "two"], "t", None, 1, 0, 1]],  # a token that is not an int
        [[1, [1], b"bytes", None, 1, 0, 1]],  # text that is not a string
        [[1, [1], "t", "bogus", 1, 0, 1]],  # an unknown finish reason
        [[1, [1], "t", None, 1]],  # too short
        [[1, [1], "t", None, 1, 0, 1, [None], None]],  # rare items cut short
        [[1, [1], "t", None, 1, 0, 1], 7],  # a record that is not an array
    ],
)
def test_a_malformed_output_batch_is_refused_whole(records: list[object]) -> None:
    with pytest.raises(WireError):
        decode_outputs(unpack(pack([Kind.OUTPUTS, records])))


@pytest.mark.parametrize(
    "payload",
    [
        {"request_ids": [1]},  # fields missing
        {  # a sampling the engine would refuse
            "request_ids": [1], "prompt_token_ids": [1], "request_type": "context_only",
            "arrival_time": 0.0, "samplings": [{"max_tokens": 0}],
        },
        {  # choices without their samplings
            "request_ids": [1, 3], "prompt_token_ids": [1], "request_type": "context_only",
            "arrival_time": 0.0, "samplings": [{"max_tokens": 3}],
        },
        {  # an extra key
            "request_ids": [1], "prompt_token_ids": [1], "request_type": "context_only",
            "arrival_time": 0.0, "samplings": [{"max_tokens": 3}], "priority": 1,
        },
        [1, 2, 3],
    ],
)  # fmt: skip
def test_a_malformed_submit_is_refused(payload: object) -> None:
    with pytest.raises(WireError, match="bad SUBMIT"):
        decode_submit(payload)
