from __future__ import annotations

import itertools

import pytest

from trtdisagg.errors import InvalidTransition, TrtDisaggError
from trtdisagg.worker.request import (
    FinishReason,
    Request,
    RequestState,
    RequestType,
    SamplingParams,
)

S = RequestState
ALLOWED = {
    (S.WAITING, S.RUNNING),
    (S.WAITING, S.GEN_WAITING_KV),
    (S.WAITING, S.FINISHED),
    (S.RUNNING, S.WAITING),
    (S.RUNNING, S.CTX_SENDING),
    (S.RUNNING, S.FINISHED),
    (S.GEN_WAITING_KV, S.RUNNING),
    (S.GEN_WAITING_KV, S.FINISHED),
    (S.CTX_SENDING, S.FINISHED),
}
ONLY_FOR = {
    (S.WAITING, S.GEN_WAITING_KV): RequestType.GENERATION_ONLY,
    (S.RUNNING, S.CTX_SENDING): RequestType.CONTEXT_ONLY,
}


def make_request(
    request_type: RequestType = RequestType.CONTEXT_AND_GENERATION, state: S = S.WAITING
) -> Request:
    return Request(
        request_id=7,
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=4),
        request_type=request_type,
        arrival_time=0.0,
        state=state,
    )


def test_defaults_and_properties() -> None:
    request = make_request()
    assert request.state is S.WAITING
    assert request.request_type is RequestType.CONTEXT_AND_GENERATION
    assert (request.num_computed_tokens, request.num_cached_tokens, request.num_preemptions) == (
        0,
        0,
        0,
    )
    assert request.block_table is None
    assert request.finish_reason is None
    request.output_token_ids += [9, 8]
    assert request.all_token_ids == [1, 2, 3, 9, 8]
    assert request.all_token_ids is not request.all_token_ids  # a copy
    assert (request.num_tokens, request.num_prompt_tokens, request.num_output_tokens) == (5, 3, 2)
    assert request.is_prefilling
    request.num_computed_tokens = 4
    assert not request.is_prefilling
    assert not request.is_finished
    request.to(S.FINISHED)
    assert request.is_finished


def test_output_lists_are_not_shared() -> None:
    a, b = make_request(), make_request()
    a.output_token_ids.append(1)
    assert b.output_token_ids == []


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request(
            request_id=1,
            prompt_token_ids=[],
            sampling=SamplingParams(max_tokens=1),
            arrival_time=0.0,
        )


@pytest.mark.parametrize(
    ("source", "target", "request_type"),
    list(itertools.product(RequestState, RequestState, RequestType)),
)
def test_transition_table(source: S, target: S, request_type: RequestType) -> None:
    request = make_request(request_type, source)
    allowed = (source, target) in ALLOWED and ONLY_FOR.get((source, target), request_type) is (
        request_type
    )
    if allowed:
        request.to(target)
        assert request.state is target
    else:
        with pytest.raises(InvalidTransition) as info:
            request.to(target)
        assert request.state is source
        error = info.value
        assert isinstance(error, TrtDisaggError)
        assert (error.request_id, error.from_state, error.to_state) == (7, source, target)
        assert f"request 7: invalid transition {source.name} -> {target.name}" in str(error)


def test_wrong_type_names_both_types() -> None:
    request = make_request(RequestType.CONTEXT_ONLY)
    with pytest.raises(InvalidTransition, match="only generation_only requests, this is context"):
        request.to(S.GEN_WAITING_KV)


def test_enum_values_are_wire_names() -> None:
    assert [t.value for t in RequestType] == [
        "context_and_generation",
        "context_only",
        "generation_only",
    ]
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error"]


def test_sampling_defaults_and_conversions() -> None:
    params = SamplingParams(max_tokens=3)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (1.0, 1.0, 0, None)
    assert (params.stop, params.stop_token_ids, params.ignore_eos) == ((), frozenset(), False)
    assert (params.logprobs, params.min_tokens) == (None, 0)
    converted = SamplingParams(max_tokens=3, stop=["a", "b"], stop_token_ids=[1, 1, 2])
    assert converted.stop == ("a", "b")
    assert converted.stop_token_ids == frozenset({1, 2})
    assert SamplingParams(max_tokens=3, stop="ab").stop == ("ab",)
    assert hash(converted) == hash(
        SamplingParams(max_tokens=3, stop=("a", "b"), stop_token_ids=frozenset({2, 1}))
    )


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("max_tokens", {"max_tokens": 0}),
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": float("nan")}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": -1}),
        ("logprobs", {"logprobs": -1}),
        ("min_tokens", {"min_tokens": -1}),
        ("min_tokens", {"min_tokens": 5}),
        ("stop", {"stop": ("",)}),
        ("stop_token_ids", {"stop_token_ids": frozenset({-3})}),
    ],
)
def test_sampling_validation_names_the_field(field: str, kwargs: dict[str, object]) -> None:
    arguments: dict[str, object] = {"max_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=field):
        SamplingParams(**arguments)  # type: ignore[arg-type]


def test_sampling_accepts_edges() -> None:
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=50, logprobs=0, min_tokens=1)
