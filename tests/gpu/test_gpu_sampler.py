"""The sampler on CUDA (run on the device machine): no host sync before the result is asked for
(named logprob alternatives included), seeded rows independent of the batch at Llama-3's
vocabulary, gen continuing ctx's random stream, greedy rows equal to the argmax, and draws that
follow the reference distribution.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.sampling_reference import reference_probabilities
from trtdisagg.worker.request import Request, SamplingParams
from trtdisagg.worker.sampling import (
    SampleSpec,
    TokenHistory,
    launch,
    make_generator,
    new_spec,
    sample,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 128256
NAMED = (5, 3000, 17)  # `logprob_token_ids`, inside every row's mask


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _mixed_specs(n: int, device: torch.device) -> list[SampleSpec]:
    """Every control, in rows of every kind: greedy, seeded and unseeded, with and without
    logprobs, penalties, bias, suppression and masks."""
    words = (VOCAB + 31) // 32
    mask = torch.full((words,), -1, dtype=torch.int32)
    mask[100:] = 0  # only the first 3200 tokens
    specs = []
    for i in range(n):
        params = SamplingParams(
            max_tokens=16,
            temperature=(0.0, 0.7, 1.0, 1.3)[i % 4],
            top_k=(0, 50, 0, 5)[i % 4],
            top_p=(1.0, 0.9, 0.95, 1.0)[i % 4],
            min_p=(0.0, 0.05)[i % 2],
            seed=i if i % 3 else None,
            presence_penalty=(0.0, 0.5)[i % 2],
            frequency_penalty=(0.0, 0.3, 0.0)[i % 3],
            repetition_penalty=(1.0, 1.1)[i % 2],
            logit_bias={7: 5.0, 99: -100.0} if i % 5 == 0 else {},
            logprobs=(None, 0, 5)[i % 3],
            logprob_token_ids=NAMED if i % 6 == 1 else None,  # (rows with logprobs 0)
        )
        prompt, output = list(range(i, i + 300)), [3, 3, 9, i]
        specs.append(
            SampleSpec(
                params=params,
                generator=make_generator(params.seed, device) if params.seed is not None else None,
                suppress=frozenset({128001, 128009}) if i % 2 else frozenset(),
                history=TokenHistory(prompt=prompt, output=output) if params.penalized else None,
                allowed=mask if i % 7 == 3 else None,
            )
        )
    return specs


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_launch_never_syncs_and_result_syncs_once(batch: int) -> None:
    device = _device()
    logits = torch.randn(batch + 3, VOCAB, device=device, dtype=torch.bfloat16)
    specs = _mixed_specs(batch, device)
    rows = list(range(3, batch + 3))
    noise = make_generator(0, device)
    sample(logits, specs, rows=rows, generator=noise)  # warm-up: allocator, kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = launch(logits, _mixed_specs(batch, device), rows=rows, generator=noise)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens, logprobs = pending.result()
    assert len(tokens) == batch and all(0 <= t < VOCAB for t in tokens)
    for spec, lp in zip(specs, logprobs, strict=True):
        assert (lp is None) == (spec.params.logprobs is None)
        if spec.params.logprob_token_ids is not None:
            assert lp is not None and [t for t, _ in lp.top] == list(NAMED)


def test_a_seeded_row_samples_the_same_alone_and_in_a_batch_of_64() -> None:
    device = _device()
    steps = [torch.randn(64, VOCAB, device=device) * 3 for _ in range(4)]
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=100, seed=123)

    def run(position: int, batch: int) -> list[int]:
        specs = _mixed_specs(batch, device)
        specs[position] = SampleSpec(params=params, generator=make_generator(123, device))
        out = []
        for logits in steps:
            rows = [(r + 1) % 64 for r in range(batch)]
            rows[position] = 0
            tokens, _ = sample(logits, specs, rows=rows, generator=make_generator(9, device))
            out.append(tokens[position])
        return out

    alone = run(0, 1)
    assert run(0, 64) == run(37, 64) == run(15, 16) == alone


def test_gen_continues_ctx_s_stream_on_the_device() -> None:
    device = _device()
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=2024)
    steps = torch.randn(6, VOCAB, device=device) * 4

    def run(output: list[int], first: int) -> list[int]:
        request = Request(
            request_id=0,
            prompt_token_ids=[1, 2, 3],
            sampling=params,
            arrival_time=0.0,
            output_token_ids=output,
        )
        spec = new_spec(
            request, device=device, width=VOCAB, eos_token_ids=frozenset(),
            after_first_token=first > 0,
        )  # fmt: skip
        for step in range(first, len(steps)):
            [token], _ = sample(steps[step : step + 1], [spec])
            request.output_token_ids.append(token)
        return request.output_token_ids

    aggregated = run([], 0)
    assert run(aggregated[:1], 1) == aggregated


def test_greedy_rows_are_the_argmax_of_bf16_logits() -> None:
    device = _device()
    logits = torch.randn(64, VOCAB, device=device, dtype=torch.bfloat16)
    specs = [SampleSpec(params=SamplingParams(max_tokens=4, temperature=0.0), generator=None)] * 64
    tokens, _ = sample(logits, specs)
    assert tokens == logits.float().argmax(dim=-1).tolist()


def test_draws_follow_the_reference_distribution_on_the_device() -> None:
    device = _device()
    draws = 50_000
    logits = torch.tensor([1.0, 2.5, 0.3, 2.2, -1.0, 1.9, 0.0, 2.4])
    params = SamplingParams(max_tokens=4, temperature=0.9, top_k=6, top_p=0.9, min_p=0.05)
    spec = SampleSpec(params=params, generator=None)
    expected = reference_probabilities(logits, spec)
    tokens, _ = sample(logits.to(device).expand(draws, -1), [spec] * draws)
    counts = torch.bincount(torch.tensor(tokens), minlength=8).double() / draws
    for p, freq in zip(expected.tolist(), counts.tolist(), strict=True):
        assert freq == 0.0 if p == 0.0 else abs(freq - p) <= 5 * math.sqrt(p * (1 - p) / draws)
