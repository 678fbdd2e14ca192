"""What a generation_only request carries from ctx's answer (`worker/http/gen_source.py`),
checked as any peer's input is: every choice's first token, their logprobs, the prompt's
logprobs."""

from __future__ import annotations

from typing import Any

import pytest

from trtdisagg.api.codec import structure_body
from trtdisagg.api.errors import ApiError
from trtdisagg.api.protocol import DisaggregatedParams
from trtdisagg.worker.http.gen_source import generation_source

VOCAB = 100
PROMPT = [1, 5, 6, 7]


def params(**fields: Any) -> DisaggregatedParams:
    base = {"request_type": "generation_only", "disagg_request_id": 9,
            "ctx_info_endpoint": "tcp://127.0.0.1:5"}  # fmt: skip
    return structure_body({**base, **fields}, DisaggregatedParams)


def entry(token: int, logprob: float = -1.0, top: int = 0) -> dict[str, Any]:
    tops = [{"token_id": t, "logprob": -2.0} for t in range(top)]
    return {"token_id": token, "logprob": logprob, "top_logprobs": tops}


def test_each_choice_s_first_token_and_logprobs() -> None:
    source = generation_source(
        params(first_gen_tokens=[3], first_gen_tokens_by_choice=[3, 4, 5],
               first_gen_logprobs=[entry(3), entry(4, top=2), entry(5)]),
        VOCAB, 3, PROMPT,
    )  # fmt: skip
    assert source.first_tokens == (3, 4, 5) and source.num_choices == 3
    assert [lp.logprob for lp in source.first_logprobs if lp] == [-1.0] * 3
    assert source.first_logprobs[1] is not None and len(source.first_logprobs[1].top) == 2
    one = generation_source(params(first_gen_tokens=[8]), VOCAB, 1, PROMPT)
    assert one.first_tokens == (8,) and one.first_logprobs == ()
    later = generation_source(params(schedule_style="generation_first"), VOCAB, 3, PROMPT)
    assert later.first_tokens == ()  # they come with the KV


def test_the_prompt_s_logprobs_one_for_each_token_but_the_first() -> None:
    carried = [entry(5), entry(6, -0.5, top=3), entry(7)]
    source = generation_source(
        params(first_gen_tokens=[3], prompt_logprobs=carried), VOCAB, 1, PROMPT
    )
    assert [lp.logprob for lp in source.prompt_logprobs] == [-1.0, -0.5, -1.0]


@pytest.mark.parametrize(
    ("fields", "n", "says"),
    [
        ({"first_gen_tokens": [3]}, 2, "first_gen_tokens_by_choice: required for n = 2"),
        ({"first_gen_tokens_by_choice": [3, 4]}, 3, "2 tokens for n = 3"),
        ({"first_gen_tokens": [4], "first_gen_tokens_by_choice": [3, 4]}, 2, "not choice 0's"),
        ({"first_gen_tokens_by_choice": [3, VOCAB]}, 2, "outside the vocabulary"),
        ({"first_gen_tokens": [3], "first_gen_logprobs": [entry(3), entry(3)]}, 1,
         "2 entries for 1 first tokens"),
        ({"first_gen_tokens_by_choice": [3, 4], "first_gen_logprobs": [entry(3), entry(9)]}, 2,
         "first_gen_logprobs[1].token_id: 9 is not its token (4)"),
        ({"first_gen_tokens": [3], "first_gen_logprobs": [entry(3, 0.5)]}, 1, "logprob <= 0"),
        ({"first_gen_tokens": [3], "prompt_logprobs": [entry(5), entry(6)]}, 1,
         "2 entries for a prompt of 4 tokens"),
        ({"first_gen_tokens": [3], "prompt_logprobs": [entry(5), entry(7), entry(7)]}, 1,
         "prompt_logprobs[1].token_id: 7 is not its token (6)"),
        ({"first_gen_tokens": [3], "prompt_logprobs": [entry(5), entry(6), entry(7, top=21)]}, 1,
         "at most 20 entries"),
        ({}, 1, "first_gen_tokens: required"),
    ],
)  # fmt: skip
def test_what_does_not_fit_is_a_400(fields: dict[str, Any], n: int, says: str) -> None:
    with pytest.raises(ApiError) as info:
        generation_source(params(**fields), VOCAB, n, PROMPT)
    assert info.value.status == 400 and says in info.value.message
    assert info.value.param == "disaggregated_params"
