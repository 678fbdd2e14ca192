"""ModelRunner: turns a StepPlan into tensors, runs the model, samples. Synchronous by design.

The executor calls `execute` through `trio.to_thread.run_sync`, so nothing here may touch Trio.
The runner owns the model and the KV tensors and decides no policy; the scheduler owns the block
tables and decides everything else (nano-vllm's split).

On CUDA the model runs its fused path (`CausalLM.use_ops`, Triton kernels in bf16/fp16), and a
decode-only step (every item computes one token) goes through batched attention: replayed from a
CUDA graph when `cuda_graphs` is on and one fits (`decode_graphs.py`), else eagerly. Every other
step, and every step on CPU, builds a flat-token batch and attends per sequence. Each step sends
its integer inputs to the device in one copy, and sampling (`sampling.py`, every row batched on
the device) costs one host sync per step.
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
from trtdisagg.model.batch import DecodeMeta, ForwardBatch, SeqSlice
from trtdisagg.model.llama import CausalLM
from trtdisagg.model.loader import load_model
from trtdisagg.model.ops import select_ops
from trtdisagg.model.parallel import Parallel
from trtdisagg.worker.decode_graphs import (
    DecodeGraphs,
    DecodeRows,
    DecodeStaging,
    blocks_for,
    decode_rows,
    graph_batch_sizes,
)
from trtdisagg.worker.prompt_logprobs import (
    PromptLogprobs,
    prompt_logprobs_of,
    wants_prompt_logprobs,
    with_prompt_targets,
)
from trtdisagg.worker.rank_plan import ItemInputs, logit_rows, step_items
from trtdisagg.worker.sampling import SampleSpec, TokenLogprobs, make_generator, sample
from trtdisagg.worker.scheduler import StepPlan

if TYPE_CHECKING:
    from trtdisagg.worker.rank_group import RankGroup

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@attrs.frozen(kw_only=True)
class Sampled:
    request_id: int
    token_id: int
    logprobs: TokenLogprobs | None
    choice: int = 0  # i > 0: the first token of fork i of the request (`SampleSpec.forks`)


@attrs.frozen(kw_only=True, eq=False)
class StepOutput:
    sampled: tuple[Sampled, ...]
    forward_s: float
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()


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
    # The unseeded rows' random draws (seeded requests draw from their own generators).
    noise: torch.Generator = attrs.field(
        default=attrs.Factory(lambda self: make_generator(None, self.device), takes_self=True)
    )

    def execute(self, plan: StepPlan, specs: dict[int, SampleSpec]) -> StepOutput:
        """Run one forward step. `specs` holds a sampling spec for every item that samples."""
        start = time.perf_counter()
        self.copy_blocks(plan.copies)
        with torch.inference_mode(), self._on_device():
            prompt = any(wants_prompt_logprobs(i.request) for i in plan.items)
            items: tuple[ItemInputs, ...] = ()
            if (
                self.batched_decode
                and plan.items
                and not prompt
                and all(i.num_new_tokens == 1 for i in plan.items)
            ):
                logits = self._decode(plan)
            else:
                items = plan_items(plan, self.tokens_per_block)
                logits = self.model(self._build_batch(items), self.cache)
            rows = [(i.request.request_id, i.samples) for i in plan.items]
            sampled = self._sample_rows(logits[: len(rows)], rows, specs)
            prompt_logprobs = prompt_logprobs_of(logits, items) if prompt else ()
        return StepOutput(
            sampled=sampled, forward_s=time.perf_counter() - start, prompt_logprobs=prompt_logprobs
        )

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
            sampled = self._sample_rows(logits[: len(rows)], rows, specs)
            prompt_logprobs = prompt_logprobs_of(logits, items)
        return StepOutput(
            sampled=sampled, forward_s=time.perf_counter() - start, prompt_logprobs=prompt_logprobs
        )

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

    def _sample_rows(
        self,
        logits: torch.Tensor,
        rows: Sequence[tuple[int, bool]],
        specs: dict[int, SampleSpec],
    ) -> tuple[Sampled, ...]:
        """Sample the rows whose (request_id, samples) says so; `logits` has one row each. A
        row whose spec has forks is sampled once more per fork (choice 1, 2, ...)."""
        wanted: list[tuple[int, int, int]] = []  # row, request id, choice
        chosen: list[SampleSpec] = []
        for i, (request_id, samples) in enumerate(rows):
            if samples:
                spec = specs[request_id]
                for choice, one in enumerate((spec, *spec.forks)):
                    wanted.append((i, request_id, choice))
                    chosen.append(one)
        if not wanted:
            return ()
        index = [i for i, _, _ in wanted]
        tokens, logprobs = sample(
            logits,
            chosen,
            rows=None if index == list(range(len(rows))) else index,
            generator=self.noise,
        )
        return tuple(
            Sampled(request_id=request_id, token_id=t, logprobs=lp, choice=choice)
            for (_, request_id, choice), t, lp in zip(wanted, tokens, logprobs, strict=True)
        )

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """A step's copy-on-write of forks' shared blocks (`StepPlan.copies`), before its
        forward writes them. Every rank copies its own shard."""
        if not copies:
            return
        with torch.inference_mode(), self._on_device():
            self.cache.copy_blocks([c.src for c in copies], [c.dst for c in copies])

    def kv_ready(self) -> None:
        """Wait until the KV written by every step launched so far is in device memory.

        Call before a transfer agent reads the pool (ctx: before the KV send starts). The agent
        copies on its own streams, which do not wait for ours, so the order must be made on the
        host: an event recorded on the current stream, then synchronized. Steps run on the
        current (default) stream of this device from a worker thread; the default stream is the
        same object in every thread, so recording here orders after them. Usually the step's
        sampling already synchronized and this returns at once. No-op on CPU, where
        writes are complete when the step returns.
        """
        if self.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        event.synchronize()

    def _on_device(self) -> contextlib.AbstractContextManager[object]:
        # The executor calls from a worker thread, whose current CUDA device (which Triton
        # launches on) is not necessarily ours.
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def decode_inputs(self, plan: StepPlan) -> DecodeRows:
        """The inputs of a decode-only step."""
        entries = []
        for item in plan.items:
            request = item.request
            table = request.block_table
            assert table is not None, f"request {request.request_id} scheduled without blocks"
            entries.append(
                (
                    request.prompt_token_ids,
                    request.output_token_ids,
                    request.num_computed_tokens,
                    table.block_ids,
                )
            )
        return decode_rows(entries, self.tokens_per_block)

    def _decode(self, plan: StepPlan) -> torch.Tensor:
        rows = self.decode_inputs(plan)
        if self.graphs is not None:
            logits = self.graphs.run(rows)
            if logits is not None:
                return logits
        staging = DecodeStaging.allocate(
            len(rows), rows.max_blocks, tokens_per_block=self.tokens_per_block, device=self.device
        )
        return self.model(staging.fill(rows), self.cache)

    def _build_batch(self, items: Sequence[ItemInputs]) -> ForwardBatch:
        tpb = self.tokens_per_block
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[tuple[int, int, int, int]] = []  # q_start, q_len, kv_len, blocks
        blocks_flat: list[int] = []
        logits_indices: list[int] = []
        for item in items:
            start, end, blocks = item.start, item.end, item.block_ids
            q_start = len(input_ids)
            input_ids.extend(item.token_ids)
            positions.extend(range(start, end))
            slots.extend(blocks[p // tpb] * tpb + p % tpb for p in range(start, end))
            spans.append((q_start, end - start, end, len(blocks)))
            blocks_flat.extend(blocks)
            logits_indices.append(len(input_ids) - 1)

        for item, (q_start, *_) in zip(items, spans, strict=True):
            # Prompt logprobs: the chunk's other positions that predict a prompt token.
            logits_indices.extend(range(q_start, q_start + item.num_extra_rows))
        head = _single_token_head(spans) if self.batched_decode else 0
        head_table, head_lens = _head_table(spans[:head], blocks_flat)
        # Everything in one tensor: one host-to-device copy per step.
        n, s = len(input_ids), len(logits_indices)
        packed = _to_device(
            [
                *input_ids,
                *positions,
                *slots,
                *logits_indices,
                *blocks_flat,
                *head_table,
                *head_lens,
            ],
            self.device,
        )
        seqs: list[SeqSlice] = []
        offset = 3 * n + s
        for q_start, q_len, kv_len, num_blocks in spans:
            block_ids = packed[offset : offset + num_blocks]
            seqs.append(SeqSlice(q_start=q_start, q_len=q_len, kv_len=kv_len, block_ids=block_ids))
            offset += num_blocks
        decode_head = None
        if head:
            width = len(head_table) // head
            decode_head = DecodeMeta(
                block_table=packed[offset : offset + head * width].view(head, width),
                context_lens=packed[offset + head * width : offset + head * width + head],
                max_context_len=max(head_lens),
            )
        return ForwardBatch(
            input_ids=packed[:n],
            positions=packed[n : 2 * n],
            slot_mapping=packed[2 * n : 3 * n],
            seqs=tuple(seqs),
            logits_indices=packed[3 * n : 3 * n + s],
            decode_head=decode_head,
        )


def plan_items(plan: StepPlan, tokens_per_block: int) -> tuple[ItemInputs, ...]:
    """A scheduler plan as explicit inputs (what rank 0 broadcasts to the other ranks)."""
    entries = []
    for item in plan.items:
        request = item.request
        table = request.block_table
        assert table is not None, f"request {request.request_id} scheduled without blocks"
        start = request.num_computed_tokens
        end = start + item.num_new_tokens
        prompt, outputs = request.prompt_token_ids, request.output_token_ids
        # Slice without copying the whole sequence: a decode step needs one token.
        p = len(prompt)
        new_tokens = prompt[start:end] + outputs[max(start - p, 0) : max(end - p, 0)]
        entries.append(
            (request.request_id, tuple(new_tokens), start, tuple(table.block_ids), item.samples)
        )
    built = step_items(entries, tokens_per_block)
    if not any(wants_prompt_logprobs(item.request) for item in plan.items):
        return built
    return tuple(
        with_prompt_targets(inputs, item.request) if wants_prompt_logprobs(item.request) else inputs
        for inputs, item in zip(built, plan.items, strict=True)
    )


def _single_token_head(spans: Sequence[tuple[int, int, int, int]]) -> int:
    """How many leading sequences of a mixed step have one new token (their rows are 0..k-1).

    0 when every sequence has one (a decode-only step has its own batched path) or when fewer
    than two lead: one sequence gains nothing from the batched kernel.
    """
    head = 0
    while head < len(spans) and spans[head][1] == 1:
        head += 1
    return 0 if head == len(spans) or head < 2 else head


def _head_table(
    spans: Sequence[tuple[int, int, int, int]], blocks_flat: Sequence[int]
) -> tuple[list[int], list[int]]:
    """The leading sequences' block ids as one padded [k, W] table (flattened) and their kv_lens.

    Rows are padded with their own first block: any valid id does, the kernel reads only the
    first ceil(kv_len / tokens_per_block) entries.
    """
    if not spans:
        return [], []
    width = max(num_blocks for *_, num_blocks in spans)
    table: list[int] = []
    offset = 0
    for *_, num_blocks in spans:
        row = list(blocks_flat[offset : offset + num_blocks])
        table.extend(row + [row[0]] * (width - num_blocks))
        offset += num_blocks
    return table, [kv_len for _, _, kv_len, _ in spans]


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        host = torch.tensor(values, dtype=torch.long, pin_memory=True)
        return host.to(device, non_blocking=True)
    return torch.tensor(values, dtype=torch.long, device=device)


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
    if device.type == "cuda":
        model.use_ops(select_ops(device, dtype))
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
    single = parallel.tp_size == 1 and parallel.pp_size == 1
    if config.cuda_graphs and device.type == "cuda" and ops is not None:
        if not ops.graph_safe or not single:
            log.info("CUDA graphs off: they need the Triton ops and one rank (TP = PP = 1)")
        else:
            max_seq_len = config.max_seq_len or model.args.max_position_embeddings
            graphs = DecodeGraphs(
                model=model,
                cache=cache,
                batch_sizes=graph_batch_sizes(config.max_batch_size),
                max_blocks_per_seq=blocks_for(max_seq_len, tpb, cache.num_blocks),
            )
            start = time.perf_counter()
            graphs.capture()
            runner.graphs = graphs
            log.info(
                "captured decode CUDA graphs for batch sizes %s in %.1f s",
                graphs.captured_sizes,
                time.perf_counter() - start,
            )
    return runner
