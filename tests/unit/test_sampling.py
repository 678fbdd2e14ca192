"""Sampling never fails on valid parameters, whatever their size."""

from __future__ import annotations

import pytest
import torch

from trtdisagg.worker.request import SamplingParams
from trtdisagg.worker.sampling import SampleSpec, make_generator, sample


@pytest.mark.parametrize("top_p", [5e-324, 1e-50, 1e-46])
def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token(top_p: float) -> None:
    # In float32 these top_p compare as 0 (or a denormal), which once dropped every token and
    # made torch.multinomial raise: a request body could stop the worker.
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0]])
    params = SamplingParams(max_tokens=1, temperature=0.7, top_p=top_p)
    spec = SampleSpec(params=params, generator=make_generator(7, torch.device("cpu")))
    tokens, _ = sample(logits, [spec])
    assert tokens == [1]
