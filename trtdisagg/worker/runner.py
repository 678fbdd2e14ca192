"""ModelRunner: turns a StepPlan into tensors, runs the model, samples. Synchronous by design.

The executor calls `execute` through `trio.to_thread.run_sync`, so nothing here may touch Trio.
The runner owns the model and the KV tensors and decides no policy; the scheduler owns the block
tables and decides everything else (nano-vllm's split).
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import torch

from trtdisagg.config import WorkerConfig
from trtdisagg.kv.cache import KVCache
from trtdisagg.model.batch import ForwardBatch, SeqSlice
from trtdisagg.model.llama import CausalLM
from trtdisagg.model.loader import load_model
from trtdisagg.model.parallel import Parallel
from trtdisagg.worker.sampling import SampleSpec, TokenLogprobs, sample
from trtdisagg.worker.scheduler import StepPlan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@attrs.frozen(kw_only=True)
class Sampled:
    request_id: int
    token_id: int
    logprobs: TokenLogprobs | None


@attrs.frozen(kw_only=True, eq=False)
class StepOutput:
    sampled: tuple[Sampled, ...]
    forward_s: float


@attrs.define(eq=False, kw_only=True)
class ModelRunner:
    model: CausalLM
    cache: KVCache
    device: torch.device
    tokens_per_block: int

    def execute(self, plan: StepPlan, specs: dict[int, SampleSpec]) -> StepOutput:
        """Run one forward step. `specs` holds a sampling spec for every item that samples."""
        import time

        start = time.perf_counter()
        batch = self._build_batch(plan)
        with torch.inference_mode():
            logits = self.model(batch, self.cache)
            sampling_items = [item for item in plan.items if item.samples]
            rows = [i for i, item in enumerate(plan.items) if item.samples]
            sampled: tuple[Sampled, ...] = ()
            if rows:
                picked = logits[torch.tensor(rows, device=logits.device)]
                chosen = [specs[item.request.request_id] for item in sampling_items]
                tokens, logprobs = sample(picked.float(), chosen)
                sampled = tuple(
                    Sampled(request_id=item.request.request_id, token_id=t, logprobs=lp)
                    for item, t, lp in zip(sampling_items, tokens, logprobs, strict=True)
                )
        return StepOutput(sampled=sampled, forward_s=time.perf_counter() - start)

    def _build_batch(self, plan: StepPlan) -> ForwardBatch:
        tpb = self.tokens_per_block
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seqs: list[SeqSlice] = []
        logits_indices: list[int] = []
        for item in plan.items:
            request = item.request
            table = request.block_table
            assert table is not None, f"request {request.request_id} scheduled without blocks"
            start = request.num_computed_tokens
            end = start + item.num_new_tokens
            blocks = table.block_ids[: math.ceil(end / tpb)]
            assert len(blocks) * tpb >= end, (
                f"request {request.request_id}: {len(blocks)} blocks cannot hold {end} tokens"
            )
            q_start = len(input_ids)
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(blocks[p // tpb] * tpb + p % tpb for p in range(start, end))
            seqs.append(
                SeqSlice(
                    q_start=q_start,
                    q_len=end - start,
                    kv_len=end,
                    block_ids=torch.tensor(blocks, dtype=torch.long, device=self.device),
                )
            )
            logits_indices.append(len(input_ids) - 1)

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return ForwardBatch(
            input_ids=as_tensor(input_ids),
            positions=as_tensor(positions),
            slot_mapping=as_tensor(slots),
            seqs=tuple(seqs),
            logits_indices=as_tensor(logits_indices),
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


def build_runner(config: WorkerConfig, model_dir: Path, parallel: Parallel) -> ModelRunner:
    """Load the model and allocate the KV pool. Slow: call it off the Trio loop."""
    device = torch.device(config.device)
    torch.set_num_threads(config.cpu_threads)
    if device.type == "cuda":
        torch.cuda.set_device(parallel.device_index)
        device = torch.device("cuda", parallel.device_index)
    dtype = DTYPES[config.dtype]
    model = load_model(model_dir, dtype=dtype, device=device, parallel=parallel)
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
    cache = KVCache(
        num_blocks=kv_pool_blocks(config, block_bytes),
        num_layers=num_layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        tokens_per_block=tpb,
        layout=kv.layout,
        dtype=dtype,
        device=device,
    )
    return ModelRunner(
        model=model, cache=cache, device=device, tokens_per_block=kv.tokens_per_block
    )
