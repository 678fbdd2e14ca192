"""Prompt logprobs (completions' echo with logprobs, vLLM's `prompt_logprobs`) against Hugging
Face transformers.

A real executor loop (tiny model, CPU) computes them while it prefills, in chunks smaller than
the prompt, next to a request that does not ask; each prompt token's logprob, rank and top tokens
equal those of transformers' forward over the whole prompt, and a request with `n` choices gets
the same ones for every choice.
"""

from __future__ import annotations

import time

import pytest
import torch
import trio

from tests.tiny_model import TinyModel
from tests.unit.test_executor_step_failures import assert_idle, outputs
from tests.unit.test_executor_step_failures import model as model  # the fixture
from trtdisagg.config import KvCacheConfig, WorkerConfig
from trtdisagg.model.loader import resolve_model
from trtdisagg.worker.engine.executor import Executor
from trtdisagg.worker.request import Request, SamplingParams

PROMPT = [1, *(20 + (13 * i) % 400 for i in range(40))]
TOP = 3


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    """transformers' log-softmax at every prompt position: [len(PROMPT), vocab]."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        resolve_model("tiny"), dtype=torch.float32
    )
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def chunked_executor(model: TinyModel) -> Executor:
    """Prefill chunks of 16 tokens at most: the prompt takes three steps."""
    config = WorkerConfig(
        max_batch_size=8,
        max_num_tokens=16,
        max_seq_len=256,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=2048, enable_block_reuse=True),
    )
    return model.executor(config)


def request(request_id: int, *, prompt_logprobs: int | None, seed: int = 0) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(PROMPT),
        sampling=SamplingParams(
            max_tokens=3, temperature=1.0, seed=seed, prompt_logprobs=prompt_logprobs
        ),
        arrival_time=time.monotonic(),
    )


async def test_prompt_logprobs_match_transformers(
    model: TinyModel, reference: torch.Tensor, nursery: trio.Nursery
) -> None:
    executor = chunked_executor(model)
    await nursery.start(executor.run)
    plain = executor.submit(request(1, prompt_logprobs=None))  # shares its steps, asks nothing
    group = executor.submit_group([request(2 + i, prompt_logprobs=TOP, seed=i) for i in range(3)])
    assert (await outputs(plain))[0].prompt_logprobs is None
    firsts = [(await outputs(handle))[0] for handle in group]
    computed = firsts[0].prompt_logprobs
    assert computed is not None and len(computed) == len(PROMPT) - 1
    assert all(first.prompt_logprobs == computed for first in firsts)  # one prompt for all
    for position, entry in enumerate(computed, start=1):
        expected = reference[position - 1]  # the position before predicts this token
        assert entry.logprob == pytest.approx(float(expected[PROMPT[position]]), abs=1e-4)
        value = float(expected[PROMPT[position]])
        # vLLM's rank: the tokens at least as likely, itself counted (ties within rounding)
        assert entry.rank is not None
        assert int((expected > value + 1e-4).sum()) + 1 <= entry.rank
        assert entry.rank <= int((expected >= value - 1e-4).sum())
        values, ids = torch.topk(expected, TOP)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
    await assert_idle(executor)


async def test_a_request_asking_for_them_takes_nothing_from_the_prefix_cache(
    model: TinyModel, nursery: trio.Nursery
) -> None:
    executor = chunked_executor(model)
    await nursery.start(executor.run)
    await outputs(executor.submit(request(1, prompt_logprobs=None)))  # caches the prompt
    first = (await outputs(executor.submit(request(2, prompt_logprobs=0))))[0]
    assert first.num_cached_tokens == 0
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(PROMPT) - 1
    assert all(entry.top == () for entry in first.prompt_logprobs)  # 0: the token's alone
    again = (await outputs(executor.submit(request(3, prompt_logprobs=None))))[0]
    assert again.num_cached_tokens > 0
