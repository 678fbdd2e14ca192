"""ModelRunner: turns a StepPlan into tensors, runs the model, samples. Synchronous by design.

The executor calls it from worker threads (`trio.to_thread.run_sync`), so nothing here may touch
Trio. The runner owns the model and the KV tensors and decides no policy; the scheduler owns the
block tables and decides everything else (nano-vllm's split).

A step is launched, then finished (`launch`, `finish`; `execute` does both): launching queues the
forward and the sampling and starts the sampled tokens' one copy to the host; finishing reads
them once that copy is done (`launched.py`). Between the two the loop may launch the next step:
a decode row whose token is still in flight reads it from the last step's sampled tokens on the
device (`step_inputs.LateRow`), so the device never waits for the host.

A prompt's `n` choices sample their first tokens from one logits row, one draw per choice
(`SampleSpec.forks`). A step of a fork that writes a block its prompt's other choices share
copies that block first (`StepPlan.copies`, on the device, before the forward).

The model runs its fused path (`CausalLM.use_ops`: Triton kernels on CUDA in bf16/fp16, torch
ops elsewhere). On CUDA a decode-only step (every item computes one token) is replayed from a
CUDA graph per batch size when `cuda_graphs` is on and one fits (`decode_graphs.py`); any other
step from a graph per token-count bucket (`step_graphs.py`); else it runs eagerly. On CPU a
decode-only step attends batched (through a compiled forward when `cpu_compile` is on,
`compiled_decode.py`) and a mixed one per sequence. Each step sends its integer
inputs to the device in one copy, and its sampling (`sampling.py`, every row batched on the
device) syncs the host only to copy its tokens back; a step that computes prompt logprobs
(`prompt_logprobs.py`) reads them at its launch.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

from trtdisagg.config import WorkerConfig
from trtdisagg.kv.block_pool import BlockCopy
from trtdisagg.kv.cache import KVCache
from trtdisagg.model.batch import ForwardBatch
from trtdisagg.model.llama import CausalLM
from trtdisagg.model.loader import load_model
from trtdisagg.model.ops import select_ops
from trtdisagg.model.parallel import Parallel
from trtdisagg.worker.compiled_decode import CompiledDecode
from trtdisagg.worker.decode_graphs import (
    DecodeGraphs,
    DecodeRows,
    DecodeStaging,
    blocks_for,
    graph_batch_sizes,
)
from trtdisagg.worker.launched import LaunchedStep, Sampled, StepOutput
from trtdisagg.worker.prompt_logprobs import PromptLogprobs, prompt_logprobs_of
from trtdisagg.worker.rank_plan import ItemInputs, logit_rows
from trtdisagg.worker.sampling import SampleSpec, launch, make_generator
from trtdisagg.worker.scheduler import StepPlan
from trtdisagg.worker.step_graphs import StepGraphs, token_buckets
from trtdisagg.worker.step_inputs import (
    LateRow,
    StepInputs,
    build_batch,
    fill_late,
    plan_items,
    step_inputs,
    to_device,
)

if TYPE_CHECKING:
    from trtdisagg.worker.rank_group import RankGroup

log = logging.getLogger(__name__)

__all__ = ["LaunchedStep", "ModelRunner", "Sampled", "StepOutput", "build_runner", "plan_items"]

Patch = Callable[[ForwardBatch], None]  # writes a step's late tokens into its input batch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@attrs.define(eq=False, kw_only=True)
class ModelRunner:
    model: CausalLM
    cache: KVCache
    device: torch.device
    tokens_per_block: int
    # Decode-only steps attend batched (DecodeMeta) instead of per sequence.
    batched_decode: bool = False
    # Captured decode graphs (CUDA, cuda_graphs on), tried first for decode-only steps.
    graphs: DecodeGraphs | None = None
    # Captured graphs of mixed and prefill steps per token-count bucket, tried first for them.
    step_graphs: StepGraphs | None = None
    # The compiled decode forward (CPU, cpu_compile on), for decode-only steps.
    compiled: CompiledDecode | None = None
    # Time each step's device work with CUDA events (`StepOutput.device_s`).
    time_steps: bool = True
    # The unseeded rows' random draws (seeded requests draw from their own generators).
    noise: torch.Generator = attrs.field(
        default=attrs.Factory(lambda self: make_generator(None, self.device), takes_self=True)
    )
    # The step launched last: its sampled tokens, on the device, feed the next step's late rows.
    _last: LaunchedStep | None = attrs.field(default=None, alias="last")
    _last_rows: dict[int, int] = attrs.field(factory=dict, alias="last_rows")
    _finished: LaunchedStep | None = attrs.field(default=None, alias="finished")  # taken last
    _last_lost: bool = attrs.field(default=False, alias="last_lost")  # see `lost`

    def execute(self, plan: StepPlan, specs: dict[int, SampleSpec]) -> StepOutput:
        """Run one step and wait for its tokens (`prepare`, `launch`, `finish`)."""
        launched = self.launch(self.prepare(plan), specs)
        launched.wait()
        return self.finish(launched)

    def prepare(self, plan: StepPlan) -> StepInputs:
        """The step's host-side inputs (call before the plan's requests change again)."""
        return step_inputs(plan, self.tokens_per_block, batched_decode=self.batched_decode)

    def launch(self, inputs: StepInputs, specs: dict[int, SampleSpec]) -> LaunchedStep:
        """Queue one step's forward and sampling; `specs` holds a sampling spec for every item
        that samples. A late row takes the token that the previous launched step samples for
        its request, on the device. On CPU the step is done when this returns; on CUDA it is
        queued (unless sampling needs the host), and its tokens come with `finish`."""
        start = time.perf_counter()
        self.copy_blocks(inputs.copies)
        with torch.inference_mode(), self._on_device():
            started = self._timing_event()
            patch = self._late_patch(inputs.late)
            if inputs.decode is not None:
                logits = self._decode(inputs.decode, patch)
            else:
                logits = self._forward_items(inputs.items, patch)
            prompt = prompt_logprobs_of(logits, inputs.items) if inputs.prompt_logprobs else ()
            launched = self._sample_launch(logits, inputs.rows, specs, start, started, prompt)
        self._last, self._last_lost = launched, False
        # A late row is a request's own decode (choice 0): forks never run in the next step.
        self._last_rows = {
            request_id: i for i, (request_id, choice) in enumerate(launched.rows) if choice == 0
        }
        return launched

    def lost(self) -> None:
        """The step launched last raised, and a step behind it is queued already (a CPU
        runner's host stream). That step's late rows are the failed step's requests, which fail
        with it: they read a placeholder token and what they compute is dropped."""
        self._last, self._last_rows, self._last_lost = None, {}, True

    def finish(self, launched: LaunchedStep) -> StepOutput:
        """The tokens of a launched step, once `launched.wait()` returned (or `done` is true)."""
        self._finished = launched
        return launched.output()

    def execute_items(
        self, items: Sequence[ItemInputs], specs: dict[int, SampleSpec], group: RankGroup
    ) -> StepOutput:
        """Rank 0 of a multi-rank instance: run its shard of the step, then sample."""
        start = time.perf_counter()
        with torch.inference_mode(), self._on_device():
            logits = self.forward_items(items, group)
            if logits is None:  # rank 0 is not the last stage: the last stage sends them
                logits = group.receive_logits((logit_rows(items), self.model.args.vocab_size))
            rows = [(i.request_id, i.samples) for i in items]
            prompt = prompt_logprobs_of(logits, items)
            launched = self._sample_launch(logits, rows, specs, start, None, prompt)
            launched.wait()
        return launched.output()

    def forward_items(self, items: Sequence[ItemInputs], group: RankGroup) -> torch.Tensor | None:
        """This rank's share of one step of a multi-rank instance.

        Every rank of the instance calls it with the same items. A stage after the first waits
        for the previous stage's hidden states; a stage before the last passes its own on. The
        last stage returns the logits (TP rank 0 of it sends them to rank 0 when that is another
        rank); every other rank returns None, except rank 0, which gets them from the caller.
        """
        with torch.inference_mode(), self._on_device():
            batch = self._build_batch(items)
            parallel = group.parallel
            hidden = None
            if not parallel.is_first_stage:
                shape = (batch.num_tokens, self.model.args.hidden_size)
                hidden = group.receive_hidden(shape, self.model.dtype)
            out = self.model(batch, self.cache, hidden)
            if not parallel.is_last_stage:
                group.send_hidden(out)
                return None
            if group.rank == group.logits_source and group.rank != 0:
                group.send_logits(out)
                return None
            return out if group.rank == 0 else None

    def _sample_launch(
        self,
        logits: torch.Tensor,
        rows: Sequence[tuple[int, bool]],
        specs: dict[int, SampleSpec],
        start: float,
        started: torch.cuda.Event | None,
        prompt_logprobs: tuple[PromptLogprobs, ...],
    ) -> LaunchedStep:
        """Sample the rows whose (request_id, samples) says so (`logits` has one row each, then
        any prompt-logprobs rows) and start the tokens' one copy to the host. A row whose spec
        has forks is sampled once more per fork (choice 1, 2, ...)."""
        wanted: list[tuple[int, int, int]] = []  # row, request id, choice
        chosen: list[SampleSpec] = []
        for i, (request_id, samples) in enumerate(rows):
            if samples:
                spec = specs[request_id]
                for choice, one in enumerate((spec, *spec.forks)):
                    wanted.append((i, request_id, choice))
                    chosen.append(one)
        index = [i for i, _, _ in wanted]
        pending = launch(
            logits,
            chosen,
            rows=None if index == list(range(logits.shape[0])) else index,
            generator=self.noise,
        )
        return LaunchedStep.queue(
            tuple((request_id, choice) for _, request_id, choice in wanted),
            pending,
            launched_at=start,
            started=started,
            prompt_logprobs=prompt_logprobs,
        )

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """A step's copy-on-write of forks' shared blocks (`StepPlan.copies`), before its
        forward writes them. Every rank copies its own shard."""
        if not copies:
            return
        with torch.inference_mode(), self._on_device():
            self.cache.copy_blocks([c.src for c in copies], [c.dst for c in copies])

    def kv_ready(self) -> None:
        """Make sure the KV written by the steps whose tokens were taken is in device memory.

        Call before a transfer agent reads the pool (ctx: before the KV send starts). The agent
        copies on its own streams, which do not wait for ours, so the order must be made on the
        host. A request's KV is sent once the step that sampled its first token was finished,
        and that step's ready event follows its forward on the one stream the steps use, so
        waiting for the last finished step's event suffices (it has fired: this returns at
        once). A step launched later and still running never writes a sending request's blocks:
        the scheduler stops scheduling a context_only request once its first token is in
        flight. No-op on CPU, where writes are complete when a step returns.
        """
        if self._finished is not None:
            self._finished.wait()

    def _timing_event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda" or not self.time_steps:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _on_device(self) -> contextlib.AbstractContextManager[object]:
        # The executor calls from a worker thread, whose current CUDA device (which Triton
        # launches on) is not necessarily ours.
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def _decode(self, rows: DecodeRows, patch: Patch | None) -> torch.Tensor:
        if self.graphs is not None:
            logits = self.graphs.run(rows, patch)
            if logits is not None:
                return logits
        if self.compiled is not None and self.compiled.fits(rows):
            batch = self.compiled.batch(rows)
            if patch is not None:
                patch(batch)
            return self.compiled(batch)
        staging = DecodeStaging.allocate(
            len(rows), rows.max_blocks, tokens_per_block=self.tokens_per_block, device=self.device
        )
        batch = staging.fill(rows)
        if patch is not None:
            patch(batch)
        return self.model(batch, self.cache)

    def _forward_items(self, items: Sequence[ItemInputs], patch: Patch | None) -> torch.Tensor:
        # A graph reads back each sequence's last position only: prompt logprobs run eagerly.
        if self.step_graphs is not None and not any(i.num_extra_rows for i in items):
            logits = self.step_graphs.run(items, patch)
            if logits is not None:
                return logits
        batch = self._build_batch(items)
        if patch is not None:
            patch(batch)
        return self.model(batch, self.cache)

    def _late_patch(self, late: Sequence[LateRow]) -> Patch | None:
        """What writes the late rows' tokens into a batch's input ids, on the device."""
        if not late:
            return None
        last = self._last
        if last is None and self._last_lost:
            return None
        if last is None:
            raise AssertionError("a step has pending tokens, but no step was launched before it")
        try:
            sources = [self._last_rows[row.request_id] for row in late]
        except KeyError as missing:
            raise AssertionError(
                f"request {missing} has a pending token that the last step did not sample"
            ) from None
        index = to_device([row.row for row in late] + sources, self.device)
        count = len(late)

        def patch(batch: ForwardBatch) -> None:
            fill_late(batch.input_ids, index[:count], last.tokens, index[count:])

        return patch

    def _build_batch(self, items: Sequence[ItemInputs]) -> ForwardBatch:
        return build_batch(
            items,
            self.device,
            tokens_per_block=self.tokens_per_block,
            batched_decode=self.batched_decode,
        )


def kv_pool_blocks(config: WorkerConfig, block_bytes: int) -> int:
    """How many blocks the pool holds: from max_tokens, or from free GPU memory."""
    kv = config.kv_cache_config
    tpb = kv.tokens_per_block
    if kv.free_gpu_memory_fraction is not None and config.device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        by_memory = int(free * kv.free_gpu_memory_fraction) // block_bytes
        if kv.max_tokens is not None:
            return max(1, min(by_memory, kv.max_tokens // tpb))
        return max(1, by_memory)
    assert kv.max_tokens is not None, "config validation guarantees max_tokens off CUDA"
    return max(1, kv.max_tokens // tpb)


def build_runner(
    config: WorkerConfig,
    model_dir: Path,
    parallel: Parallel,
    *,
    agree_blocks: Callable[[int], int] | None = None,
) -> ModelRunner:
    """Load the model, allocate the KV pool, capture decode graphs. Slow: call it off the Trio
    loop. A multi-rank instance passes `agree_blocks` (the minimum over its ranks): rank 0's
    scheduler hands out block ids that must exist in every rank's pool."""
    device = torch.device(config.device)
    torch.set_num_threads(config.cpu_threads)
    if device.type == "cuda":
        torch.cuda.set_device(parallel.device_index)
        device = torch.device("cuda", parallel.device_index)
    dtype = DTYPES[config.dtype]
    model = load_model(model_dir, dtype=dtype, device=device, parallel=parallel)
    # The fused path everywhere: one q/k/v and one gate/up GEMM per layer (on CPU, torch ops:
    # fewer calls per step than the reference modules make).
    model.use_ops(select_ops(device, dtype))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the unfused weights' memory, before the pool is sized
    kv = config.kv_cache_config
    num_layers = len(model.local_layer_ids)
    heads = model.local_num_kv_heads
    head_dim = model.args.head_dim
    tpb = kv.tokens_per_block
    block_bytes = KVCache.bytes_per_block(
        num_layers=num_layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        tokens_per_block=tpb,
        dtype=dtype,
    )
    num_blocks = kv_pool_blocks(config, block_bytes)
    if agree_blocks is not None:
        num_blocks = agree_blocks(num_blocks)
    cache = KVCache(
        num_blocks=num_blocks,
        num_layers=num_layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        tokens_per_block=tpb,
        layout=kv.layout,
        dtype=dtype,
        device=device,
    )
    runner = ModelRunner(
        model=model,
        cache=cache,
        device=device,
        tokens_per_block=kv.tokens_per_block,
        batched_decode=True,
    )
    ops = model.ops
    start = time.perf_counter()
    with torch.inference_mode():
        model.warm_up(cache)  # every kernel variant serving can meet, graphs or not
    if ops is not None:
        log.info("compiled the fused path's kernels in %.1f s", time.perf_counter() - start)
    single = parallel.tp_size == 1 and parallel.pp_size == 1
    if config.cuda_graphs and device.type == "cuda" and ops is not None:
        if not ops.graph_safe or not single:
            log.info("CUDA graphs off: they need the Triton ops and one rank (TP = PP = 1)")
        else:
            _capture_graphs(runner, config, max_seq_len=config.max_seq_len)
    if config.cpu_compile:
        if device.type != "cpu" or not single:
            log.info("cpu_compile off: it compiles CPU workers of one rank (TP = PP = 1)")
        else:
            runner.compiled = CompiledDecode(model, cache)
            try:
                runner.compiled.warm_up()
            except Exception as error:  # inductor needs a C++ compiler, among other things
                raise RuntimeError(
                    f"cpu_compile: compiling the decode step failed: {error}"
                ) from error
    return runner


def _capture_graphs(runner: ModelRunner, config: WorkerConfig, *, max_seq_len: int | None) -> None:
    """Capture decode graphs per batch size and mixed-step graphs per token bucket; log what
    they cost in time and device memory."""
    model, cache = runner.model, runner.cache
    width = blocks_for(
        max_seq_len or model.args.max_position_embeddings, cache.tokens_per_block, cache.num_blocks
    )
    device = cache.device
    batch_sizes = graph_batch_sizes(config.max_batch_size)
    buckets = token_buckets(min(config.cuda_graph_max_tokens, config.max_num_tokens))
    start = time.perf_counter()
    if model.ops is not None:
        with torch.inference_mode():
            model.ops.plan_gemms(model.weight_gemms(), rows=(*batch_sizes, *buckets))
        log.info("timed the weight GEMMs of small steps in %.1f s", time.perf_counter() - start)
    torch.cuda.synchronize(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    start = time.perf_counter()
    graphs = DecodeGraphs(
        model=model,
        cache=cache,
        batch_sizes=batch_sizes,
        max_blocks_per_seq=width,
    )
    graphs.capture()
    runner.graphs = graphs
    decode_s = time.perf_counter() - start
    if buckets:
        steps = StepGraphs(
            model=model,
            cache=cache,
            buckets=buckets,
            max_seqs=config.max_batch_size,
            max_blocks_per_seq=width,
        )
        steps.capture()
        runner.step_graphs = steps
    used = max(0, free_before - torch.cuda.mem_get_info(device)[0])
    log.info(
        "captured decode CUDA graphs for batch sizes %s in %.1f s and mixed-step graphs for "
        "%d token buckets up to %d in %.1f s; all graphs hold %.2f GiB of device memory",
        graphs.captured_sizes,
        decode_s,
        len(buckets),
        buckets[-1] if buckets else 0,
        time.perf_counter() - start - decode_s,
        used / 2**30,
    )
