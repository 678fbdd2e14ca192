"""A model step that raises, in a real executor loop (tiny model, CPU, one rank).

The failure is injected through the test hooks (`TestHooks.step_failures`, through the
`FaultyRunner` the builder wraps around the runner): the step's forward raises in its worker
thread, where a CUDA error or a sampling bug would. The requests of that step
fail with the cause, every other request goes on, and every block comes back; failures in a row
stop the worker (`Executor.stopped`) and fail whatever it still held.
"""

from __future__ import annotations

import time

import pytest
import trio

from tests.oracle import assert_greedy_match
from tests.tiny_model import TinyModel, load_tiny
from trtdisagg.config import KvCacheConfig, WorkerConfig
from trtdisagg.errors import WorkerStopped
from trtdisagg.worker.engine.executor import Executor, RequestHandle, RequestOutput
from trtdisagg.worker.engine.loop import MAX_CONSECUTIVE_STEP_FAILURES
from trtdisagg.worker.engine.test_hooks import TestHooks
from trtdisagg.worker.engine.wakeup import Wakeup
from trtdisagg.worker.request import FinishReason, Request, SamplingParams

TOKENS_PER_BLOCK = 16
MAX_SEQ_LEN = 256
NEW_TOKENS = 6
TIMEOUT_S = 60.0  # a whole test's requests, on a loaded 2-core machine
INJECTED = "internal error in the model step: InjectedStepFailure: step failure injected"


@pytest.fixture(scope="module")
def model() -> TinyModel:
    """One runner for the module: each test's executor gets a fresh pool over its KV tensors."""
    return load_tiny(tokens_per_block=TOKENS_PER_BLOCK)


def make_executor(
    model: TinyModel, *, max_batch_size: int, wakeup: Wakeup | None = None
) -> Executor:
    """max_batch_size 1: one request per step, so a failed step holds exactly one of them."""
    config = WorkerConfig(
        max_batch_size=max_batch_size,
        max_num_tokens=256,
        max_seq_len=MAX_SEQ_LEN,
        # A failed step must leave the prefix cache as sound as the pool.
        kv_cache_config=KvCacheConfig(
            tokens_per_block=TOKENS_PER_BLOCK, max_tokens=2048, enable_block_reuse=True
        ),
    )
    return model.executor(config, wakeup=wakeup, test_hooks=TestHooks())


def prompt(first: int) -> list[int]:
    """Prompts that share no leading block, so none is served from another's prefix cache."""
    return [10 + (first * 37 + 5 * i) % 400 for i in range(20)]


def submit(executor: Executor, request_id: int) -> RequestHandle:
    request = Request(
        request_id=request_id,
        prompt_token_ids=prompt(request_id),
        sampling=SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
        arrival_time=time.monotonic(),
    )
    return executor.submit(request)


async def outputs(handle: RequestHandle) -> list[RequestOutput]:
    with trio.fail_after(TIMEOUT_S):
        return [output async for output in handle.outputs]


def tokens(outs: list[RequestOutput]) -> list[int]:
    assert outs[-1].error is None, outs[-1].error
    assert outs[-1].finish_reason is FinishReason.LENGTH
    return [t for out in outs for t in out.token_ids]


def failure(outs: list[RequestOutput]) -> str:
    """The error of a failed request: one final output, an internal (500) error."""
    (last,) = outs
    assert last.finish_reason is FinishReason.ERROR and last.internal, last
    assert last.error is not None
    return last.error


def failed_steps(executor: Executor) -> float | None:
    return executor.metrics.registry.get_sample_value("trtdisagg_step_failures_total")


async def assert_idle(executor: Executor) -> None:
    """Nothing held: every block free or reusable (prefix cache), as when the worker started.

    Within TIMEOUT_S: on the CPU a failed step's successor is queued already, and the failed
    requests' blocks come back when the loop has finished it (held for it until then)."""
    assert executor.num_active() == 0

    def idle() -> bool:
        stats = executor.scheduler.statistics()
        pool = stats.pool
        return (stats.num_running, stats.num_waiting) == (0, 0) and (
            pool.free_blocks + pool.reusable_blocks == pool.total_blocks
        )

    with trio.move_on_after(TIMEOUT_S):
        while not idle():  # noqa: ASYNC110  (the loop's state, polled, bounded)
            await trio.sleep(0.001)
    stats = executor.scheduler.statistics()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    pool = stats.pool
    assert pool.free_blocks + pool.reusable_blocks == pool.total_blocks, pool


async def reference(model: TinyModel, request_ids: list[int]) -> dict[int, list[int]]:
    """Each request's greedy tokens, run alone on an executor where nothing fails."""
    executor = make_executor(model, max_batch_size=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        expected = {i: tokens(await outputs(submit(executor, i))) for i in request_ids}
        nursery.cancel_scope.cancel()
    return expected


async def test_a_failed_step_fails_only_its_requests(
    model: TinyModel, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    expected = await reference(model, [1, 2])
    executor = make_executor(model, max_batch_size=1)
    await nursery.start(executor.run)
    assert executor.test_hooks is not None
    executor.test_hooks.step_failures = 1
    failing, waiting = submit(executor, 0), submit(executor, 1)  # one step holds only `failing`

    assert failure(await outputs(failing)).startswith(INJECTED)
    assert tokens(await outputs(waiting)) == expected[1]  # queued behind it: untouched
    assert tokens(await outputs(submit(executor, 2))) == expected[2]  # the worker serves on
    assert failed_steps(executor) == 1
    assert executor.stopped is None
    await assert_idle(executor)
    logged = [r for r in caplog.records if r.getMessage().startswith("model step failed")]
    assert len(logged) == 1 and logged[0].exc_info is not None  # once, with the traceback


async def test_failed_steps_in_a_row_stop_the_worker(
    model: TinyModel, nursery: trio.Nursery
) -> None:
    executor = make_executor(model, max_batch_size=1)
    await nursery.start(executor.run)
    assert executor.test_hooks is not None
    executor.test_hooks.step_failures = MAX_CONSECUTIVE_STEP_FAILURES
    handles = [submit(executor, i) for i in range(MAX_CONSECUTIVE_STEP_FAILURES + 2)]

    errors = [failure(await outputs(handle)) for handle in handles]
    in_steps, held = (
        errors[:MAX_CONSECUTIVE_STEP_FAILURES],
        errors[MAX_CONSECUTIVE_STEP_FAILURES:],
    )
    assert all(error.startswith(INJECTED) for error in in_steps), in_steps
    # The ones still queued when the worker stopped are failed with the reason, not left waiting.
    assert all(error.startswith("this worker stopped serving: 3 model steps") for error in held)
    assert executor.stopped is not None and "InjectedStepFailure" in executor.stopped
    with pytest.raises(WorkerStopped, match="InjectedStepFailure"):
        submit(executor, 99)
    assert failed_steps(executor) == MAX_CONSECUTIVE_STEP_FAILURES
    await assert_idle(executor)


async def test_a_successful_step_resets_the_count(model: TinyModel, nursery: trio.Nursery) -> None:
    count = MAX_CONSECUTIVE_STEP_FAILURES - 1
    expected = await reference(model, [10, 20])
    executor = make_executor(model, max_batch_size=1)
    await nursery.start(executor.run)
    hooks = executor.test_hooks
    assert hooks is not None
    for first in (0, 10):
        hooks.step_failures = count
        handles = [submit(executor, first + 1 + i) for i in range(count)]
        for handle in handles:
            assert failure(await outputs(handle)).startswith(INJECTED)
        assert tokens(await outputs(submit(executor, first + 10))) == expected[first + 10]
    assert executor.stopped is None
    assert failed_steps(executor) == 2 * count
    await assert_idle(executor)


async def test_a_step_queued_behind_a_failed_one_serves_its_other_requests(
    model: TinyModel, nursery: trio.Nursery
) -> None:
    """`failing`'s prompt fills the first step's token budget, so `waiting` starts in the next
    one, next to `failing`'s decode: a step the loop queues before the first one's outcome is
    known. The first step fails; in the next, `failing`'s row reads a placeholder for the token
    never sampled, and `waiting` gets its tokens (those it gets alone, near-tie rule: its
    prefill shares a batch here)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    alone = make_executor(model, max_batch_size=1)
    async with trio.open_nursery() as inner:
        await inner.start(alone.run)
        ref = await outputs(alone.submit(ask(1, prompt(1), params)))
        inner.cancel_scope.cancel()
    margins = [lp.top[0][1] - lp.top[1][1] for out in ref for lp in out.logprobs if lp]
    config = WorkerConfig(
        max_batch_size=2,
        max_num_tokens=32,
        max_seq_len=MAX_SEQ_LEN,
        kv_cache_config=KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK, max_tokens=2048),
    )
    executor = model.executor(config, test_hooks=TestHooks())
    await nursery.start(executor.run)
    assert executor.test_hooks is not None
    executor.test_hooks.step_failures = 1
    failing = executor.submit(ask(0, [11 + i for i in range(32)], params))
    waiting = executor.submit(ask(1, prompt(1), params))

    assert failure(await outputs(failing)).startswith(INJECTED)
    assert_greedy_match(tokens(await outputs(waiting)), tokens(ref), margins)
    assert failed_steps(executor) == 1
    assert executor.stopped is None
    await assert_idle(executor)


def ask(request_id: int, prompt_ids: list[int], params: SamplingParams) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=params,
        arrival_time=time.monotonic(),
    )
