"""bench_engine's offline phase: the engine in this process, no HTTP, closed-loop clients.

Run by `bench_engine.py` in a child process (`--phase offline`), so that its device memory is
gone before the HTTP worker starts. Builds `trtdisagg.LLM` from the worker config, then:

* probes: one prompt's prefill forward and one decode step at batch 1, each timed alone on the
  runner (median of several, host wall time around a synchronous step, and the device time from
  CUDA events); on CUDA also the HBM bandwidth (a large device copy), the decode floor it
  implies, and the bf16 matmul rate (a large GEMM), for the TTFT, TPOT and prefill ratios;
* per concurrency: a closed loop of `concurrency` clients submitting straight to the executor
  and reading each request's outputs, timed as bench_serving times a stream (TTFT = first
  token, TPOT = (E2E - TTFT) / (tokens - 1)); the device's busy fraction over the steady part
  (from the first request's end to the last submission) from the step device-time counter.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
import trio
from _bench_common import RequestRecord, RequestSpec

from trtdisagg.offline import LLM
from trtdisagg.worker.request import Request, RequestState, SamplingParams
from trtdisagg.worker.sampling import SampleSpec
from trtdisagg.worker.scheduler import ScheduledItem, StepPlan

DEVICE_SECONDS = "trtdisagg_step_device_seconds_total"
REQUEST_IDS = itertools.count(1)


@attrs.define(eq=False)
class Timeline:
    """(time, device seconds so far) samples, and the steady window's bounds."""

    samples: list[tuple[float, float]] = attrs.Factory(list)
    first_done: float | None = None
    last_submit: float | None = None
    every_s: float = 0.05  # the sampling period

    def busy(self) -> float | None:
        """Device seconds per second over [first_done, last_submit], the counter interpolated
        linearly between its samples; None when the window is not covered or shorter than two
        sampling periods (too few requests for a steady part: give --num-requests >= 4 x c)."""
        if self.first_done is None or self.last_submit is None:
            return None
        lo, hi = self.first_done, self.last_submit
        samples = sorted(self.samples)
        if hi - lo < 2 * self.every_s or not samples:
            return None
        if samples[0][0] > lo or samples[-1][0] < hi:
            return None
        return (_at(samples, hi) - _at(samples, lo)) / (hi - lo)


def _at(samples: Sequence[tuple[float, float]], t: float) -> float:
    """The counter at time `t`, between the samples that bracket it."""
    for (t0, d0), (t1, d1) in itertools.pairwise(samples):
        if t0 <= t <= t1:
            return d0 if t1 == t0 else d0 + (d1 - d0) * (t - t0) / (t1 - t0)
    return samples[-1][1]


async def sample_counter(read: Any, timeline: Timeline, every_s: float) -> None:
    """Append (now, read()) every `every_s` until cancelled."""
    while True:
        timeline.samples.append((time.perf_counter(), float(await read())))
        await trio.sleep(every_s)


Issue = Callable[[RequestSpec], Awaitable[RequestRecord]]
Counter = Callable[[], Awaitable[float]]


async def closed_loop(
    issue: Issue,
    specs: Sequence[RequestSpec],
    concurrency: int,
    read_counter: Counter,
    *,
    every_s: float,
    engine: Callable[[Callable[[], bool]], Awaitable[None]] | None = None,
) -> tuple[list[RequestRecord], Timeline]:
    """`concurrency` clients, each issuing its next request when its last one ended, while the
    device-time counter is sampled every `every_s`. `engine(more)`, when given, runs alongside
    (the offline engine's loop, told whether more requests will come)."""
    timeline = Timeline(every_s=every_s)
    records: list[RequestRecord] = []
    pending = list(reversed(specs))

    async def client() -> None:
        while pending:
            spec = pending.pop()
            if not pending:
                timeline.last_submit = time.perf_counter()
            records.append(await issue(spec))
            timeline.first_done = timeline.first_done or time.perf_counter()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample_counter, read_counter, timeline, every_s)
        async with trio.open_nursery() as clients:
            if engine is not None:
                clients.start_soon(engine, lambda: bool(pending))
            for _ in range(concurrency):
                clients.start_soon(client)
        timeline.samples.append((time.perf_counter(), await read_counter()))
        nursery.cancel_scope.cancel()
    return records, timeline


async def offline_loop(
    llm: LLM, specs: Sequence[RequestSpec], concurrency: int
) -> tuple[list[RequestRecord], Timeline]:
    """The closed loop against the engine in this process: clients submit to its executor and
    read each request's outputs, timed as a streaming client times its chunks."""
    executor = llm.executor
    registry = executor.metrics.registry
    t0 = time.perf_counter()

    async def issue(spec: RequestSpec) -> RequestRecord:
        sent = time.perf_counter()
        request = Request(
            request_id=next(REQUEST_IDS),
            prompt_token_ids=list(spec.prompt_ids),
            sampling=SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True),
            arrival_time=time.monotonic(),
        )
        handle = executor.submit(request)
        first = None
        count = 0
        async for out in handle.outputs:
            if out.token_ids:
                first = first or time.perf_counter()
                count += len(out.token_ids)
        return RequestRecord(
            cls="all",
            index=spec.index,
            input_len=spec.input_len,
            output_len=spec.output_len,
            ok=first is not None,
            start_s=sent - t0,
            ttft_s=None if first is None else first - sent,
            e2e_s=time.perf_counter() - sent,
            output_tokens=count,
        )

    async def read_counter() -> float:
        return float(registry.get_sample_value(DEVICE_SECONDS) or 0.0)

    return await closed_loop(
        issue,
        specs,
        concurrency,
        read_counter,
        every_s=0.05,
        engine=executor.loop.run_until_idle,
    )


def probe_steps(
    llm: LLM, input_len: int, vocab: int, *, prefill_lens: Sequence[int] = (), repeats: int = 7
) -> dict[str, float]:
    """One prompt's prefill (of `input_len`, and of each of `prefill_lens`) and one decode step
    at batch 1 after `input_len` tokens, each alone on the runner: host wall time around a
    synchronous step, and the device time from its CUDA events; medians."""
    runner = llm.runner
    args = runner.model.args
    embed = runner.model.model.embed_tokens
    # Matmul parameters: the input embedding is a lookup (unless tied to the output head).
    params = sum(p.numel() for p in runner.model.parameters())
    lm_head = runner.model.lm_head
    if embed is not None and (lm_head is None or lm_head.weight is not embed.weight):
        params -= embed.weight.numel()
    out: dict[str, float] = {"matmul_parameters": float(params)}
    for length in dict.fromkeys([input_len, *prefill_lens]):
        with _request(llm, length, vocab) as request:
            prefill = _plan(request, length)
            wall, device = _timed(runner, request, prefill, computed=0, repeats=repeats)
            attention = 2 * args.num_layers * args.num_heads * args.head_dim * length * length
            tag = "prefill" if length == input_len else f"prefill_{length}"
            out[f"{tag}_ms"] = 1e3 * wall
            out[f"{tag}_device_ms"] = 1e3 * device
            out[f"{tag}_tflops"] = (2 * params * length + attention) / device / 1e12
            if length == input_len:
                wall, device = _timed(runner, request, _plan(request, 1), computed=length,
                                      repeats=repeats)  # fmt: skip
                out["decode_ms"] = 1e3 * wall
                out["decode_device_ms"] = 1e3 * device
    return out


@contextlib.contextmanager
def _request(llm: LLM, length: int, vocab: int) -> Iterator[Request]:
    """A running request of a `length`-token prompt with blocks for one more token."""
    pool = llm.executor.scheduler.pool
    prompt = [(31 * i + 7) % vocab for i in range(length)]
    table = pool.open_table(prompt, reuse=False)
    if not pool.grow(table, length + 1):
        pool.release(table)
        raise SystemExit(f"the KV pool cannot hold a {length}-token prompt")
    try:
        yield Request(
            request_id=-1,
            prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=2, temperature=0.0),
            arrival_time=0.0,
            state=RequestState.RUNNING,
            block_table=table,
        )
    finally:
        pool.release(table)


def _plan(request: Request, num_new_tokens: int) -> StepPlan:
    item = ScheduledItem(request=request, num_new_tokens=num_new_tokens, samples=True)
    return StepPlan(items=(item,), num_tokens=num_new_tokens)


def _timed(
    runner: Any, request: Request, plan: StepPlan, *, computed: int, repeats: int
) -> tuple[float, float]:
    """Median host wall time and device time of `plan`, after one untimed run."""
    specs = {request.request_id: SampleSpec(params=request.sampling, generator=None)}
    walls, devices = [], []
    for _ in range(repeats + 1):
        request.num_computed_tokens = computed
        request.output_token_ids = [] if computed < request.num_prompt_tokens else [1]
        sync(runner.device)
        start = time.perf_counter()
        out = runner.execute(plan, specs)
        sync(runner.device)
        walls.append(time.perf_counter() - start)
        devices.append(out.device_s)
    return statistics.median(walls[1:]), statistics.median(devices[1:])


def probe_device(llm: LLM, input_len: int) -> dict[str, float]:
    """CUDA only: HBM bandwidth, the batch-1 decode floor it implies, the bf16 GEMM rate."""
    device = llm.runner.device
    if device.type != "cuda":
        return {}
    size = 1 << 30
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * size / _cuda_time(lambda: dst.copy_(src))
    model = llm.runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens
    if embed is not None and (model.lm_head is None or model.lm_head.weight is not embed.weight):
        weights -= embed.weight.numel() * embed.weight.element_size()  # one row is read
    cache = llm.runner.cache
    kv = input_len * cache.pool[0].numel() * cache.pool.element_size() // cache.tokens_per_block
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    gemm = _cuda_time(lambda: a @ a)
    return {
        "hbm_gb_s": bandwidth / 1e9,
        "decode_floor_ms": 1e3 * (weights + kv) / bandwidth,
        "bf16_matmul_tflops": 2 * 8192**3 / gemm / 1e12,
    }


def _cuda_time(fn: Any, repeats: int = 10) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / repeats


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
