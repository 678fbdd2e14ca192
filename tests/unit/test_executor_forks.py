"""A prompt's `n` choices in a real executor loop (tiny model, CPU, one rank): one prefill, then
forks that share its blocks (`forks.py`, `Scheduler.fork`).

Each choice samples what it would alone: greedy choices equal the request sent once, seeded ones
equal a request of their seed. The prompt is prefilled once (`trtdisagg_prefill_tokens_total`),
and every block comes back.
"""

from __future__ import annotations

import time

import pytest
import trio

from tests.tiny_model import TinyModel
from tests.unit.test_executor_step_failures import assert_idle, make_executor, outputs
from tests.unit.test_executor_step_failures import model as model  # the fixture
from trtdisagg.worker.engine.executor import Executor, RequestHandle, RequestOutput
from trtdisagg.worker.request import FinishReason, Request, SamplingParams

PROMPT = [10 + (7 * i) % 300 for i in range(45)]  # 3 blocks of 16, the last one partly filled


def choice(request_id: int, *, seed: int | None, temperature: float, max_tokens: int) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(PROMPT),
        sampling=SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True
        ),
        arrival_time=time.monotonic(),
    )


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    assert outs[-1].error is None and outs[-1].finish_reason is FinishReason.LENGTH, outs[-1]
    return [t for out in outs for t in out.token_ids]


def counter(executor: Executor, name: str) -> float:
    value = executor.metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


async def run_group(
    executor: Executor, seeds: list[int | None], *, temperature: float, max_tokens: int = 8
) -> list[list[int]]:
    group = [
        choice(100 + i, seed=seed, temperature=temperature, max_tokens=max_tokens)
        for i, seed in enumerate(seeds)
    ]
    handles: list[RequestHandle] = executor.submit_group(group)
    return [tokens_of(await outputs(handle)) for handle in handles]


@pytest.mark.parametrize(("temperature", "seeds"), [(0.0, [None] * 4), (1.0, [11, 22, 33])])
async def test_each_choice_samples_what_it_would_alone(
    model: TinyModel, nursery: trio.Nursery, temperature: float, seeds: list[int | None]
) -> None:
    executor = make_executor(model, max_batch_size=8)
    await nursery.start(executor.run)
    alone = [(await run_group(executor, [seed], temperature=temperature))[0] for seed in seeds]
    prefilled = counter(executor, "trtdisagg_prefill_tokens_total")
    together = await run_group(executor, seeds, temperature=temperature)
    assert together == alone
    if temperature > 0:
        assert len({tuple(t) for t in together}) > 1  # the choices really sample apart
    # Alone, each prefilled the prompt (all but its prefix-cached blocks); together, once.
    assert counter(executor, "trtdisagg_prefill_tokens_total") - prefilled <= len(PROMPT)
    await assert_idle(executor)


async def test_the_prompt_is_prefilled_once(model: TinyModel, nursery: trio.Nursery) -> None:
    executor = make_executor(model, max_batch_size=8)
    await nursery.start(executor.run)
    await run_group(executor, [1, 2, 3, 4], temperature=1.0, max_tokens=20)
    assert counter(executor, "trtdisagg_prefill_tokens_total") == len(PROMPT)
    assert counter(executor, "trtdisagg_prompt_tokens_total") == len(PROMPT)
    # Steps that computed prompt tokens are counted apart from decode-only ones, with their time.
    prefill_steps = counter(executor, "trtdisagg_prefill_steps_total")
    assert prefill_steps == 1  # the prompt fits one step (max_num_tokens 256)
    assert counter(executor, "trtdisagg_steps_total") - prefill_steps >= 19  # 20 tokens each
    busy = counter(executor, "trtdisagg_step_device_seconds_total")
    assert 0 < counter(executor, "trtdisagg_prefill_step_device_seconds_total") < busy
    await assert_idle(executor)


async def test_aborting_a_group_before_its_first_token_ends_every_choice(
    model: TinyModel, nursery: trio.Nursery
) -> None:
    executor = make_executor(model, max_batch_size=8)
    group = [choice(200 + i, seed=i, temperature=1.0, max_tokens=8) for i in range(3)]
    handles = executor.submit_group(group)
    for request in group:  # before the loop ever takes them
        executor.abort(request.request_id)
    await nursery.start(executor.run)
    for handle in handles:
        (last,) = await outputs(handle)
        assert last.finish_reason is FinishReason.ABORT
    await assert_idle(executor)


async def test_a_failed_prefill_fails_every_choice(model: TinyModel, nursery: trio.Nursery) -> None:
    executor = make_executor(model, max_batch_size=8)
    await nursery.start(executor.run)
    assert executor.test_hooks is not None
    executor.test_hooks.step_failures = 1
    group = [choice(300 + i, seed=i, temperature=1.0, max_tokens=8) for i in range(3)]
    for handle in executor.submit_group(group):
        (last,) = await outputs(handle)
        assert last.finish_reason is FinishReason.ERROR and last.internal
    await assert_idle(executor)
