"""Asynchronous steps in a real executor loop (tiny model, CPU, one rank): step N+1 is launched
before step N's tokens are processed.

* Greedy tokens equal the synchronous loop's, and each request's tokens generated alone (near-tie
  rule), through chunked prefills next to decodes (mixed steps), requests that end on a token
  nobody could foresee (stop token ids: still in the next step, dropped), min_tokens and
  logprobs (the host sampler, whose tokens go back to the device for the next step), and
  preemption in a pool too small for every request.
* A request that surely ends with its token in flight (its max_tokens-th) is not scheduled
  again; one that ends on a stop token is scheduled once more and its result dropped.
* Every block comes back once the loop is idle (the blocks of a request that ended while the
  next step computed it are freed after that step); aborts mid-stream free them too.
"""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from tests.oracle import PagedGreedy, assert_greedy_match
from trtdisagg.config import KvCacheConfig, WorkerConfig
from trtdisagg.metrics import WorkerMetrics
from trtdisagg.model.loader import resolve_model
from trtdisagg.model.parallel import Parallel
from trtdisagg.worker.engine.build import assemble_executor
from trtdisagg.worker.engine.executor import Executor, RequestHandle, RequestOutput
from trtdisagg.worker.engine.local import LocalDriver
from trtdisagg.worker.engine.wakeup import Wakeup
from trtdisagg.worker.request import FinishReason, Request, SamplingParams
from trtdisagg.worker.runner import ModelRunner, build_runner
from trtdisagg.worker.tokenization import Tokenizer

TOKENS_PER_BLOCK = 16
MAX_NUM_TOKENS = 48  # prompts longer than this prefill in chunks, next to decodes
TIMEOUT_S = 120.0


@attrs.frozen
class Model:
    runner: ModelRunner
    small: ModelRunner  # a pool of 12 blocks: too small for every request at once
    tokenizer: Tokenizer


@pytest.fixture(scope="module")
def model() -> Model:
    model_dir: Path = resolve_model("tiny")

    def runner(max_tokens: int) -> ModelRunner:
        config = WorkerConfig(
            max_num_tokens=MAX_NUM_TOKENS,
            kv_cache_config=KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK, max_tokens=max_tokens),
        )
        return build_runner(config, model_dir, Parallel())

    return Model(
        runner=runner(4096),
        small=runner(12 * TOKENS_PER_BLOCK),
        tokenizer=Tokenizer.from_dir(model_dir),
    )


def make_executor(runner: ModelRunner, tokenizer: Tokenizer, *, overlap: bool) -> Executor:
    config = WorkerConfig(
        max_batch_size=8,
        max_num_tokens=MAX_NUM_TOKENS,
        max_seq_len=512,
        async_scheduling=overlap,
        kv_cache_config=KvCacheConfig(
            tokens_per_block=TOKENS_PER_BLOCK,
            max_tokens=runner.cache.num_blocks * TOKENS_PER_BLOCK,
            enable_block_reuse=True,
        ),
    )
    executor = assemble_executor(
        config,
        runner=runner,
        tokenizer=tokenizer,
        metrics=WorkerMetrics.create(),
        wakeup=Wakeup(),
    )
    driver = executor.loop.driver
    assert isinstance(driver, LocalDriver) and driver.overlaps is overlap
    return executor


def prompt(seed: int, length: int) -> list[int]:
    """Prompts that share no leading block, so none is served from another's prefix cache."""
    return [10 + (seed * 37 + 5 * i) % 400 for i in range(length)]


@attrs.frozen(kw_only=True)
class Ask:
    prompt: list[int]
    sampling: SamplingParams


ASKS = [
    Ask(prompt=prompt(1, 20), sampling=SamplingParams(max_tokens=12, temperature=0.0)),
    Ask(prompt=prompt(2, 70), sampling=SamplingParams(max_tokens=9, temperature=0.0)),
    Ask(prompt=prompt(3, 33), sampling=SamplingParams(max_tokens=10, temperature=0.0)),
    Ask(prompt=prompt(4, 5), sampling=SamplingParams(max_tokens=1, temperature=0.0)),
    Ask(
        prompt=prompt(5, 40),
        sampling=SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3, logprobs=2),
    ),
    Ask(prompt=prompt(6, 52), sampling=SamplingParams(max_tokens=14, temperature=0.0)),
]


def submit(executor: Executor, request_id: int, ask: Ask) -> RequestHandle:
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(ask.prompt),
        sampling=attrs.evolve(ask.sampling, ignore_eos=True),
        arrival_time=time.monotonic(),
    )
    return executor.submit(request)


def drain(handle: RequestHandle) -> list[RequestOutput]:
    outs = []
    while True:
        try:
            outs.append(handle.outputs.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    assert outs and outs[-1].finish_reason is not None, outs[-1:]
    assert outs[-1].error is None, outs[-1].error
    return [t for out in outs for t in out.token_ids]


def assert_idle(executor: Executor) -> None:
    assert executor.num_active() == 0
    stats = executor.scheduler.statistics()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    pool = stats.pool
    assert pool.free_blocks + pool.reusable_blocks == pool.total_blocks, pool


class PlanSpy:
    """The runner, recording which requests each step computes."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.steps: list[list[int]] = []
        self.late_rows_by_step: list[int] = []  # decode rows whose token came from the device

    @property
    def late_rows(self) -> int:
        return sum(self.late_rows_by_step)

    def prepare(self, plan: Any) -> Any:
        self.steps.append([item.request.request_id for item in plan.items])
        inputs = self.runner.prepare(plan)
        self.late_rows_by_step.append(len(inputs.late))
        return inputs

    def launch(self, *args: Any) -> Any:
        return self.runner.launch(*args)

    def finish(self, *args: Any) -> Any:
        return self.runner.finish(*args)

    def kv_ready(self) -> None:
        self.runner.kv_ready()

    def lost(self) -> None:
        self.runner.lost()


async def generate(
    runner: ModelRunner, tokenizer: Tokenizer, asks: list[Ask], *, overlap: bool
) -> tuple[list[list[RequestOutput]], PlanSpy, Executor]:
    """Every ask's outputs, run to completion together; and what each step computed."""
    executor = make_executor(runner, tokenizer, overlap=overlap)
    spy = PlanSpy(runner)
    driver = executor.loop.driver
    assert isinstance(driver, LocalDriver)
    driver.runner = spy
    handles = [submit(executor, i, ask) for i, ask in enumerate(asks)]
    with trio.fail_after(TIMEOUT_S):
        await executor.loop.run_until_idle()
    return [drain(h) for h in handles], spy, executor


@pytest.fixture(scope="module")
def alone(model: Model) -> list[tuple[list[int], list[float]]]:
    """Each ask's greedy tokens and top-2 margins, generated alone on the oracle's path."""
    reference = []
    for ask in ASKS:
        margins: list[float] = []
        greedy = PagedGreedy.single(model.runner.model, tokens_per_block=4, num_blocks=64)
        got = greedy.generate(ask.prompt, ask.sampling.max_tokens, margins=margins)
        reference.append((got, margins))
    return reference


@pytest.mark.parametrize("small_pool", [False, True], ids=["pool", "preempting"])
async def test_async_tokens_equal_the_synchronous_loop(
    model: Model, alone: list[tuple[list[int], list[float]]], small_pool: bool
) -> None:
    runner = model.small if small_pool else model.runner
    ours, spy, executor = await generate(runner, model.tokenizer, ASKS, overlap=True)
    sync, sync_spy, sync_executor = await generate(runner, model.tokenizer, ASKS, overlap=False)
    assert spy.late_rows > 0 and sync_spy.late_rows == 0
    steps = spy.steps
    for i, (ref, margins) in enumerate(alone):
        assert_greedy_match(tokens(ours[i]), ref, margins)
        assert_greedy_match(tokens(sync[i]), ref, margins)
        assert tokens(ours[i]) == tokens(sync[i])
        assert ours[i][-1].finish_reason is FinishReason.LENGTH
    logprobs = [lp for out in ours[4] for lp in out.logprobs]
    sync_logprobs = [lp for out in sync[4] for lp in out.logprobs]
    assert all(lp is not None and len(lp.top) == 2 for lp in logprobs)
    for got, want in zip(logprobs, sync_logprobs, strict=True):
        assert got is not None and want is not None
        assert math.isclose(got.logprob, want.logprob, rel_tol=1e-4, abs_tol=1e-5)
    # A request is computed once per prefill chunk and once per later token: its last token,
    # in flight, is known to end it, so no step computes past it.
    for i, ask in enumerate(ASKS):
        chunks = sum(1 for step in steps if i in step) - (ask.sampling.max_tokens - 1)
        assert chunks >= math.ceil(len(ask.prompt) / MAX_NUM_TOKENS), (i, steps)
    preempted = executor.scheduler.statistics().num_preemptions
    assert (preempted > 0) == small_pool
    assert_idle(executor)
    assert_idle(sync_executor)


async def test_a_stop_token_ends_a_request_that_the_next_step_computes(
    model: Model, alone: list[tuple[list[int], list[float]]]
) -> None:
    """The stop token is only known once its step's tokens are back: the request is in the
    step launched meanwhile, whose token for it is dropped; its blocks wait for that step."""
    ref, margins = alone[0]
    stop_at = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i] and margins[i] > 1e-3)
    ask = Ask(
        prompt=ASKS[0].prompt,
        sampling=SamplingParams(
            max_tokens=ASKS[0].sampling.max_tokens,
            temperature=0.0,
            stop_token_ids=frozenset({ref[stop_at]}),
        ),
    )
    other = ASKS[5]
    ours, spy, executor = await generate(model.runner, model.tokenizer, [ask, other], overlap=True)
    steps = spy.steps
    assert tokens(ours[0]) == ref[: stop_at + 1]
    assert ours[0][-1].finish_reason is FinishReason.STOP
    # Prefill, the decodes of tokens 1..stop_at, and one more step whose result was dropped.
    assert sum(1 for step in steps if 0 in step) == 1 + stop_at + 1, steps
    assert_idle(executor)


async def test_an_abort_mid_stream_frees_every_block(model: Model) -> None:
    executor = make_executor(model.runner, model.tokenizer, overlap=True)
    long_ask = Ask(prompt=prompt(9, 30), sampling=SamplingParams(max_tokens=60, temperature=0.0))
    doomed = submit(executor, 1, long_ask)
    kept = submit(executor, 2, ASKS[0])
    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            # Until no request is left and no step in flight: the blocks of the aborted
            # request, which the step launched meanwhile computes, are freed after that step.
            nursery.start_soon(executor.loop.run_until_idle)
            seen = 0
            async for out in doomed.outputs:
                seen += len(out.token_ids)
                if seen >= 3:
                    executor.abort(1)
                    break
            rest = [out async for out in doomed.outputs]
            outs = [out async for out in kept.outputs]
    assert rest and rest[-1].finish_reason is FinishReason.ABORT
    assert len(tokens(outs)) == ASKS[0].sampling.max_tokens
    assert_idle(executor)


async def test_rows_that_need_their_token_on_the_host_step_synchronously(
    model: Model, alone: list[tuple[list[int], list[float]]]
) -> None:
    """The `synchronous` hook (grammar masks need the previous token): a step holding such a
    row is finished before the next is scheduled, so no row of the next step is late."""
    executor = make_executor(model.runner, model.tokenizer, overlap=True)
    spy = PlanSpy(model.runner)
    driver = executor.loop.driver
    assert isinstance(driver, LocalDriver)
    driver.runner = spy
    constrained = {0}
    executor.loop.synchronous = lambda live: live.request_id in constrained
    asks = [ASKS[0], ASKS[5]]  # 12 and 14 tokens: request 1 outlives request 0
    handles = [submit(executor, i, ask) for i, ask in enumerate(asks)]
    with trio.fail_after(TIMEOUT_S):
        await executor.loop.run_until_idle()
    outs = [drain(h) for h in handles]
    for out, index in zip(outs, (0, 5), strict=True):
        assert_greedy_match(tokens(out), *alone[index])
    # Request 0 is in every step until it ends, so no step up to then has a late row; the steps
    # after it overlap again.
    last_with_0 = max(i for i, step in enumerate(spy.steps) if 0 in step)
    assert spy.late_rows_by_step[: last_with_0 + 1] == [0] * (last_with_0 + 1)
    assert sum(spy.late_rows_by_step[last_with_0 + 1 :]) > 0
    assert_idle(executor)


async def test_a_bad_word_of_two_tokens_is_banned_under_asynchronous_steps(model: Model) -> None:
    """The second token of a bad word is banned right after the first, which must be on the host
    when the next step samples: such a request steps synchronously. Its tokens follow the free
    run's up to the word's first token, then leave it, equal to the synchronous loop's, and
    never spell the word."""
    (free,), _, _ = await generate(model.runner, model.tokenizer, [ASKS[1]], overlap=True)
    run = tokens(free)
    at = 2
    word = (run[at], run[at + 1])
    ask = Ask(prompt=ASKS[1].prompt, sampling=attrs.evolve(ASKS[1].sampling, bad_word_ids=[word]))
    (ours,), spy, executor = await generate(model.runner, model.tokenizer, [ask], overlap=True)
    (sync,), _, _ = await generate(model.runner, model.tokenizer, [ask], overlap=False)
    got = tokens(ours)
    assert got == tokens(sync)
    assert got[: at + 1] == run[: at + 1] and got[at + 1] != run[at + 1]
    assert all((a, b) != word for a, b in itertools.pairwise(got))
    assert spy.late_rows == 0
    assert_idle(executor)
