"""The batched sampler against a slow per-row reference (`tests/sampling_reference.py`), each
control's effect, and seeds (batch-independent, continued across the split). CPU only; the host
syncs are test_sampling_syncs.py's, the device-side checks tests/gpu/test_gpu_sampler.py's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.sampling_reference import (
    CPU,
    Row,
    reference_logits,
    reference_probabilities,
    reference_sample,
)
from trtdisagg.worker.request import Request, SamplingParams
from trtdisagg.worker.sampling import (
    SampleSpec,
    make_generator,
    new_spec,
    sample,
)
from trtdisagg.worker.sampling_batch import argmax_in_parts
from trtdisagg.worker.token_logprobs import TokenLogprobs

EOS = 0


def references(logits: torch.Tensor, rows: Sequence[Row]) -> tuple[list[int], list[Any]]:
    width = logits.shape[1]
    out = [reference_sample(logits[i], r.spec(), r.noise(width)) for i, r in enumerate(rows)]
    return [t for t, _ in out], [lp for _, lp in out]


def batched(logits: torch.Tensor, cases: Sequence[Row], **kw: Any) -> tuple[list[int], list[Any]]:
    return sample(logits, [r.spec() for r in cases], generator=make_generator(0, CPU), **kw)


def assert_same(
    logits: torch.Tensor,
    rows: Sequence[Row],
    got: tuple[list[int], list[TokenLogprobs | None]],
    want: tuple[list[int], list[TokenLogprobs | None]],
) -> None:
    """Equal tokens and logprobs, except that tied top logprobs may come in any order (OpenAI
    orders them by value only): the values must be equal, and each id must have its value."""
    assert got[0] == want[0]
    for i, (a, b) in enumerate(zip(got[1], want[1], strict=True)):
        assert (a is None) == (b is None)
        if a is None or b is None:
            continue
        assert a.logprob == b.logprob
        assert [v for _, v in a.top] == [v for _, v in b.top]
        _, logp = reference_logits(logits[i], rows[i].spec())
        assert len({t for t, _ in a.top}) == len(a.top)
        assert all(float(logp[t]) == v for t, v in a.top)


# ---- hypothesis: random logits, random controls ----


def _int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


@st.composite
def rows_and_logits(
    draw: st.DrawFn, *, greedy_only: bool = False
) -> tuple[torch.Tensor, list[Row]]:
    width = draw(st.integers(2, 70))
    num_rows = draw(st.integers(1, 5))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(num_rows, width, generator=generator) * draw(st.sampled_from([0.5, 3.0]))
    if draw(st.booleans()):  # integer logits: ties everywhere
        logits = logits.round()
    tokens = st.integers(0, width - 1)
    rows = []
    for _ in range(num_rows):
        keep = draw(tokens)  # one token no mask nor suppression removes
        greedy = greedy_only or draw(st.booleans())
        params = SamplingParams(
            max_tokens=4,
            temperature=0.0 if greedy else draw(st.floats(0.05, 3.0)),
            top_k=draw(st.sampled_from([0, 0, 1, 2, 5, width, width + 3])),
            top_p=draw(st.sampled_from([1.0, 1.0, 0.9, 0.5, 0.05, 1e-45])),
            min_p=draw(st.sampled_from([0.0, 0.0, 0.05, 0.3, 1.0])),
            seed=draw(st.integers(0, 2**63 - 1)),
            presence_penalty=draw(st.sampled_from([0.0, 0.5, -1.5, 2.0])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.3, -2.0])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3, 0.7])),
            logit_bias=draw(st.dictionaries(tokens, st.floats(-100, 100), max_size=4)),
            logprobs=draw(st.sampled_from([None, 0, 1, 3, 100])),
        )
        allowed = None
        if draw(st.booleans()):
            words = draw(st.integers(keep // 32 + 1, (width + 31) // 32 + 1))
            values = [draw(st.integers(0, 2**32 - 1)) for _ in range(words)]
            values[keep // 32] |= 1 << (keep % 32)
            allowed = tuple(_int32(v) for v in values)
        rows.append(
            Row(
                params=params,
                suppress=frozenset(draw(st.sets(tokens, max_size=3))) - {keep},
                prompt=tuple(draw(st.lists(tokens, min_size=1, max_size=12))),
                output=tuple(draw(st.lists(tokens, max_size=12))),
                allowed=allowed,
            )
        )
    return logits, rows


FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(rows_and_logits(greedy_only=True))
def test_greedy_rows_equal_the_reference(case: tuple[torch.Tensor, list[Row]]) -> None:
    logits, rows = case
    assert_same(logits, rows, batched(logits, rows), references(logits, rows))


@FAST
@given(rows_and_logits())
def test_seeded_and_greedy_rows_equal_the_reference(case: tuple[torch.Tensor, list[Row]]) -> None:
    logits, rows = case
    assert_same(logits, rows, batched(logits, rows), references(logits, rows))


@FAST
@given(rows_and_logits(), st.data())
def test_a_seeded_row_is_the_same_alone_and_anywhere_in_a_batch(
    case: tuple[torch.Tensor, list[Row]], data: st.DataObject
) -> None:
    """Over several steps, so that a draw taking more (or fewer) values from the row's own
    generator than its own row's shows in the next step's tokens."""
    logits, rows = case
    steps = [logits, logits.flip(1), logits * 2]
    seeded = attrs.evolve(rows[0], params=attrs.evolve(rows[0].params, temperature=1.0))
    others = [attrs.evolve(r, params=attrs.evolve(r.params, seed=None)) for r in rows[1:]]
    others += [r for r in rows[1:] if r.params.seed is not None]  # seeded neighbours too
    at = data.draw(st.integers(0, len(others)))
    alone_spec = seeded.spec()
    mixed_specs = [r.spec() for r in [*others[:at], seeded, *others[at:]]]
    for step in steps:
        row = step[:1]
        neighbours = step[1:].repeat(2, 1)[: len(others)]
        batch = torch.cat([neighbours[:at], row, neighbours[at:]])
        alone = sample(row, [alone_spec], generator=make_generator(0, CPU))
        mixed = sample(batch, mixed_specs, generator=make_generator(1, CPU))
        assert_same(row, [seeded], ([mixed[0][at]], [mixed[1][at]]), alone)


# ---- the sampled distribution ----


DISTRIBUTIONS = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.5, top_k=3),
    "top_p": dict(temperature=1.0, top_p=0.6),
    "min_p": dict(temperature=1.0, min_p=0.2),
    "all": dict(temperature=1.2, top_k=5, top_p=0.8, min_p=0.05),
    "penalties": dict(
        temperature=1.0, presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.5
    ),
    "bias": dict(temperature=1.0, logit_bias={0: 2.0, 7: -1.0}),
}


@pytest.mark.parametrize("controls", list(DISTRIBUTIONS.values()), ids=list(DISTRIBUTIONS))
def test_draws_follow_the_reference_distribution(controls: dict[str, Any]) -> None:
    """Unseeded rows (one batched draw) pick token i with the reference's probability p_i:
    within 5 standard deviations, and never a token the controls removed. Neighbours with other
    controls (top_p, greedy) make every stage run for every row."""
    draws = 30_000
    logits = torch.tensor([1.0, 2.5, 0.3, 2.2, -1.0, 1.9, 0.0, 2.4])
    row = Row(params=SamplingParams(max_tokens=4, **controls), prompt=(2, 3), output=(1, 1, 5))
    neighbours = [
        Row(params=SamplingParams(max_tokens=4, top_p=0.3, temperature=2.0)),
        Row(params=_greedy(logit_bias={4: 5.0})),
    ]
    expected = reference_probabilities(logits, row.spec())
    tokens, _ = batched(logits.expand(3 * draws, -1), [row, *neighbours] * draws)
    counts = torch.bincount(torch.tensor(tokens[::3]), minlength=logits.numel()).double()
    for token, (count, p) in enumerate(zip(counts.tolist(), expected.tolist(), strict=True)):
        if p == 0.0:
            assert count == 0, token
        else:
            assert abs(count / draws - p) <= 5 * math.sqrt(p * (1 - p) / draws), (token, p)
    assert set(tokens[2::3]) == {4}


# ---- each control's effect ----


def _greedy(**controls: Any) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, **controls)


def test_a_logit_bias_of_100_makes_a_token_the_choice() -> None:
    logits = torch.tensor([[5.0, 1.0, -3.0, 0.5]])
    for params in (
        _greedy(logit_bias={2: 100}),
        SamplingParams(max_tokens=4, seed=3, logit_bias={2: 100}),
    ):
        assert batched(logits, [Row(params=params)])[0] == [2]
    assert batched(logits, [Row(params=_greedy(logit_bias={0: -100}))])[0] == [1]


def test_penalties_move_the_choice_away_from_repeats_or_towards_them() -> None:
    logits = torch.tensor([[3.0, 2.8, 1.0, -0.5]])

    def choice(
        params: SamplingParams, output: tuple[int, ...] = (), prompt: tuple[int, ...] = (2,)
    ) -> int:
        return batched(logits, [Row(params=params, prompt=prompt, output=output)])[0][0]

    assert choice(_greedy()) == 0
    assert choice(_greedy(repetition_penalty=1.2), prompt=(0,)) == 1  # 3.0 / 1.2 < 2.8
    assert choice(_greedy(repetition_penalty=0.8), prompt=(1,)) == 1  # 2.8 / 0.8 > 3.0
    assert choice(_greedy(frequency_penalty=0.1), output=(0,)) == 0  # 2.9 > 2.8
    assert choice(_greedy(frequency_penalty=0.1), output=(0, 0, 0)) == 1  # 2.7 < 2.8
    assert choice(_greedy(presence_penalty=0.3), output=(0, 0)) == 1  # once, whatever the count
    assert choice(_greedy(presence_penalty=-2.0), output=(2,)) == 0  # 1.0 + 2: a tie, the first
    assert choice(_greedy(presence_penalty=-2.0, frequency_penalty=-0.1), output=(2,)) == 2
    # repetition_penalty on a negative logit multiplies it: token 0 sinks below token 1
    assert batched(
        torch.tensor([[-0.4, -0.5]]), [Row(params=_greedy(repetition_penalty=2.0), prompt=(0,))]
    )[0] == [1]


def test_min_p_removes_the_unlikely_tokens() -> None:
    logits = torch.tensor([2.0, 1.9, -3.0, -4.0])  # p: 0.51 0.46 0.003 0.001
    rows = [Row(params=SamplingParams(max_tokens=4, min_p=0.1))] * 5000
    assert set(batched(logits.expand(5000, -1), rows)[0]) == {0, 1}
    without = [Row(params=SamplingParams(max_tokens=4))] * 5000
    assert {2, 3} & set(batched(logits.expand(5000, -1), without)[0])


def test_suppressed_and_disallowed_tokens_are_never_drawn() -> None:
    logits = torch.tensor([9.0, 0.0, 8.0, 7.0] + [0.0] * 36)  # 40 tokens: two mask words
    mask = (1 << 3) | 1, 1  # tokens 0, 3 and 32 allowed
    rows = [
        Row(
            params=SamplingParams(max_tokens=4, temperature=5.0),
            suppress=frozenset({0}),
            allowed=mask,
        )
    ] * 3000
    assert set(batched(logits.expand(3000, -1), rows)[0]) == {3, 32}
    short = Row(params=_greedy(), allowed=(0,))  # past its one word: nothing else allowed
    wide = torch.zeros(1, 40)
    wide[0, 35] = 1.0
    assert batched(wide, [attrs.evolve(short, allowed=(1 << 4,))])[0] == [4]


def test_logprobs_are_the_model_s_whatever_the_controls() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    raw = torch.log_softmax(logits[0], dim=-1)
    controlled = SamplingParams(
        max_tokens=4,
        temperature=0.3,
        seed=1,
        logprobs=2,
        logit_bias={3: 100},
        presence_penalty=1.0,
        repetition_penalty=1.5,
        min_p=0.5,
        top_k=2,
    )
    [token], [logprobs] = batched(logits, [Row(params=controlled, output=(0,))])
    assert token == 3 and logprobs is not None
    assert logprobs.logprob == pytest.approx(float(raw[3]), abs=0)
    assert logprobs.top == ((0, float(raw[0])), (1, float(raw[1])))
    masked = Row(params=_greedy(logprobs=4), allowed=(0b0101,))  # tokens 0 and 2
    [_], [logprobs] = batched(logits, [masked])
    assert logprobs is not None and [t for t, _ in logprobs.top] == [0, 2]  # no -inf entries
    assert logprobs.logprob == pytest.approx(float(torch.log_softmax(logits[0, [0, 2]], 0)[0]))


def test_named_logprob_ids_replace_a_row_s_most_likely_alternatives() -> None:
    """vLLM's `logprob_token_ids`: a row that names tokens gets their logprobs, in its order,
    beside rows of the same step that ask for the most likely ones, or for none."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    raw = torch.log_softmax(logits, dim=-1)
    named = Row(params=_greedy(logprobs=0, logprob_token_ids=(7, 3, 41)))
    tops = Row(params=_greedy(logprobs=5))
    tokens, (mine, theirs, none) = batched(logits, [named, tops, Row(params=_greedy())])
    assert mine is not None and theirs is not None and none is None
    assert [t for t, _ in mine.top] == [7, 3, 41]
    assert [v for _, v in mine.top] == pytest.approx(raw[0, [7, 3, 41]].tolist(), abs=1e-6)
    assert mine.logprob == pytest.approx(float(raw[0, tokens[0]]), abs=1e-6)
    values, ids = raw[1].topk(5)  # the neighbour's are its own most likely
    assert theirs.top == tuple(zip(ids.tolist(), values.tolist(), strict=True))
    with pytest.raises(ValueError, match="logprob_token_ids"):
        _greedy(logprob_token_ids=(1,))  # without logprobs


def test_rows_pick_which_logits_each_spec_samples() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    rows = [Row(params=SamplingParams(max_tokens=4, seed=s, logprobs=2)) for s in (5, 6)]
    assert batched(logits, rows, rows=[3, 1]) == batched(logits[[3, 1]], rows)


def test_an_empty_step_and_mismatched_rows() -> None:
    logits = torch.randn(3, 10)
    assert sample(logits, [], rows=[]) == ([], [])
    with pytest.raises(ValueError, match="rows"):
        batched(logits, [Row(params=_greedy())])
    with pytest.raises(ValueError, match="rows"):
        batched(logits, [Row(params=_greedy())], rows=[0, 1])


@pytest.mark.parametrize("top_p", [5e-324, 1e-50, 1e-46])
def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token(top_p: float) -> None:
    # In float32 these top_p compare as 0 (or a denormal), which once dropped every token.
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0]])
    params = SamplingParams(max_tokens=1, temperature=0.7, top_p=top_p, seed=7)
    assert batched(logits, [Row(params=params)])[0] == [1]


@pytest.mark.parametrize(
    "controls",
    [
        dict(min_p=1.5),
        dict(min_p=-0.1),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-2.01),
        dict(repetition_penalty=0.0),
        dict(repetition_penalty=math.inf),
        dict(logit_bias={1: 100.5}),
        dict(logit_bias={-1: 1.0}),
        dict(logit_bias=[(1, 1.0), (1, 2.0)]),
        dict(min_p=math.nan),
    ],
)
def test_sampling_params_refuse_controls_out_of_range(controls: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=4, **controls)


def test_a_spec_needs_its_history_and_a_host_int32_mask() -> None:
    with pytest.raises(ValueError, match="history"):
        SampleSpec(params=_greedy(presence_penalty=1.0), generator=None)
    with pytest.raises(ValueError, match="int32"):
        SampleSpec(params=_greedy(), generator=None, allowed=torch.zeros(2, dtype=torch.int64))


# ---- seeds across the split ----


def _request(params: SamplingParams, output: list[int] | None = None) -> Request:
    return Request(
        request_id=1,
        prompt_token_ids=[1, 2],
        sampling=params,
        arrival_time=0.0,
        output_token_ids=output or [],
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=8, seed=11),
        SamplingParams(max_tokens=8, seed=11, top_k=3, top_p=0.8, presence_penalty=0.5),
        SamplingParams(max_tokens=8, seed=11, temperature=0.0),
        SamplingParams(max_tokens=8, seed=11, top_k=1),
    ],
)
def test_gen_continues_the_random_stream_ctx_drew_the_first_token_from(
    params: SamplingParams,
) -> None:
    steps = torch.randn(6, 64, generator=torch.Generator().manual_seed(4))

    def run(request: Request, first: int, *, after_first_token: bool) -> list[int]:
        spec = new_spec(
            request,
            device=CPU,
            width=64,
            eos_token_ids=frozenset({EOS}),
            after_first_token=after_first_token,
        )
        for step in range(first, len(steps)):
            [token], _ = sample(steps[step : step + 1], [spec])
            request.output_token_ids.append(token)
        return request.output_token_ids

    aggregated = run(_request(params), 0, after_first_token=False)
    ctx_first = aggregated[:1]
    gen = run(_request(params, output=list(ctx_first)), 1, after_first_token=True)
    assert gen == aggregated
    assert len(set(aggregated)) > 1  # the logits do not pick one token anyway


def test_new_spec_suppresses_eos_only_with_min_tokens_and_without_ignore_eos() -> None:
    def suppress(**controls: Any) -> frozenset[int]:
        request = _request(SamplingParams(max_tokens=8, **controls))
        return new_spec(request, device=CPU, width=8, eos_token_ids=frozenset({EOS})).suppress

    assert suppress(min_tokens=2) == {EOS}
    assert suppress() == suppress(min_tokens=2, ignore_eos=True) == frozenset()


@FAST
@given(
    st.integers(1, 5),
    st.sampled_from([1, 2, 8, 64]),
    st.integers(1, 9),
    st.lists(st.integers(-3, 3), min_size=1, max_size=4),
)
def test_argmax_in_parts_is_the_first_maximum(
    rows: int, parts: int, size: int, values: list[int]
) -> None:
    """Logits drawn from a few integers tie often, within a part and across parts."""
    width = parts * size
    generator = torch.Generator().manual_seed(rows * 1000 + width)
    pick = torch.randint(len(values), (rows, width), generator=generator)
    x = torch.tensor(values, dtype=torch.float32)[pick]
    assert argmax_in_parts(x, parts).tolist() == x.argmax(dim=-1).tolist()
