"""Decode step time of an 8B-shaped model on one GPU, against the HBM floor of the same run.

Builds a Llama-3.1-8B-shaped CausalLM (32 layers, hidden 4096, 32 heads over 8 kv heads,
intermediate 14336, vocab 128256) with seeded random bf16 weights directly on the GPU, sizes a KV
pool with `free_gpu_memory_fraction` (and reports what it took), fills the blocks in use with
random K/V, and times one decode step (every sequence at `--context` tokens) at each batch size:

  eager_per_seq   the reference path: separate q/k/v and gate/up GEMMs, attention per sequence
  eager_batched   the reference path with batched decode attention (padded gather + one SDPA)
  eager_fused     fused GEMMs + Triton kernels (norms, RoPE + KV write, paged attention), eager
  graph           the same, replayed from a CUDA graph (what the worker runs)
  runner_graph    ModelRunner.execute on a decode-only StepPlan: host-side input staging, the
                  graph replay and greedy sampling with its host sync (wall clock)
  gemm_only       just the step's weight GEMMs (and lm_head), from a CUDA graph: what cuBLAS
                  reaches on the weight reads alone

The floor is measured in the same run: a large device-to-device copy and a read-only reduction
give the achieved HBM bandwidth; floor = (weight bytes read + KV bytes read per step) / bandwidth,
also against the nominal 4.8 TB/s. Weight bytes read exclude the embedding table (a step reads
one row per sequence). Attention alone is timed too (gather + SDPA against the Triton kernel,
with a small tile/split sweep), one layer's call at a time, replayed from a CUDA graph.

    python tools/bench_decode.py --result-json out.json
    python tools/bench_decode.py --small --device cpu      # smoke test of the code paths
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from trtdisagg.config import KvCacheConfig, WorkerConfig
from trtdisagg.kv.block_pool import BlockTable
from trtdisagg.kv.cache import KVCache
from trtdisagg.kv.page_table import Layout
from trtdisagg.model.args import Llama3RopeScaling, ModelArgs
from trtdisagg.model.batch import DecodeMeta, ForwardBatch, SeqSlice
from trtdisagg.model.llama import CausalLM
from trtdisagg.model.ops import TorchOps, decode_attention_torch, select_ops
from trtdisagg.worker.decode_graphs import DecodeGraphs, blocks_for, decode_rows
from trtdisagg.worker.request import Request, SamplingParams
from trtdisagg.worker.runner import ModelRunner, kv_pool_blocks
from trtdisagg.worker.sampling import SampleSpec
from trtdisagg.worker.scheduler import ScheduledItem, StepPlan

NOMINAL_HBM_BYTES_PER_S = 4.8e12  # H200 datasheet
MODES = ("eager_per_seq", "eager_batched", "eager_fused", "graph", "runner_graph", "gemm_only")


def llama_8b_args() -> ModelArgs:
    return ModelArgs(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        attention_bias=False,
        o_proj_bias=False,
        qk_norm=False,
        bos_token_id=128000,
        eos_token_ids=(128001,),
    )


def small_args() -> ModelArgs:
    return attrs.evolve(
        llama_8b_args(),
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
    )


# ---- timing ----


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    fn: Callable[[], object], device: torch.device, *, iters: int, repeats: int = 3, warmup: int = 2
) -> dict[str, float]:
    """Mean time per call over `iters` calls, median (and spread) over `repeats` runs."""
    for _ in range(warmup):
        fn()
    sync(device)
    runs: list[float] = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            runs.append((time.perf_counter() - t0) * 1e3 / iters)
    return {"ms": statistics.median(runs), "min_ms": min(runs), "max_ms": max(runs)}


def wall_ms(fn: Callable[[], object], device: torch.device, *, iters: int) -> dict[str, float]:
    """Host wall clock per call (each call ends in a host sync of its own)."""
    for _ in range(2):
        fn()
    sync(device)
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        runs.append((time.perf_counter() - t0) * 1e3 / iters)
    return {"ms": statistics.median(runs), "min_ms": min(runs), "max_ms": max(runs)}


# ---- the floor ----


def hbm_bandwidth(device: torch.device, gib: float) -> dict[str, float]:
    """Achieved bandwidth: device-to-device copy (bytes read + written) and a read-only sum."""
    n = int(gib * 2**30) // 4
    src = torch.randn(n, device=device)  # random, not zeros (METHOD.md)
    dst = torch.empty_like(src)
    nbytes = n * 4
    iters = 10 if device.type == "cuda" else 1
    copy = time_ms(lambda: dst.copy_(src), device, iters=iters, repeats=5)
    read = time_ms(lambda: torch.sum(src), device, iters=iters, repeats=5)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "buffer_bytes": nbytes,
        "copy_ms": copy["ms"],
        "copy_bytes_per_s": 2 * nbytes / (copy["ms"] / 1e3),  # read + write
        "read_ms": read["ms"],
        "read_bytes_per_s": nbytes / (read["ms"] / 1e3),
    }


# ---- model, pool, sequences ----


def init_weights(model: CausalLM, seed: int) -> None:
    generator = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.02, generator=generator)
            else:
                param.normal_(0.0, 0.02, generator=generator)


def param_bytes(model: CausalLM) -> tuple[int, int]:
    """(all parameter bytes, embedding table bytes)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens
    return total, 0 if embed is None else embed.weight.numel() * embed.weight.element_size()


def make_pool(
    model: CausalLM, device: torch.device, *, fraction: float | None, max_tokens: int, tpb: int
) -> tuple[KVCache, dict[str, Any]]:
    config = WorkerConfig(
        device=device.type,
        dtype="bfloat16",
        kv_cache_config=KvCacheConfig(
            tokens_per_block=tpb,
            max_tokens=None if fraction is not None else max_tokens,
            free_gpu_memory_fraction=fraction,
        ),
    )
    block_bytes = KVCache.bytes_per_block(
        num_layers=model.local_num_layers,
        num_kv_heads=model.local_num_kv_heads,
        head_dim=model.args.head_dim,
        tokens_per_block=tpb,
        dtype=model.dtype,
    )
    sizing: dict[str, Any] = {"fraction": fraction, "block_bytes": block_bytes}
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()
        sizing["free_before"] = torch.cuda.mem_get_info(device)[0]
    num_blocks = kv_pool_blocks(config, block_bytes)
    cache = KVCache(
        num_blocks=num_blocks,
        num_layers=model.local_num_layers,
        num_kv_heads=model.local_num_kv_heads,
        head_dim=model.args.head_dim,
        tokens_per_block=tpb,
        layout=Layout.HND,
        dtype=model.dtype,
        device=device,
    )
    sizing["num_blocks"] = num_blocks
    sizing["pool_bytes"] = num_blocks * block_bytes
    if device.type == "cuda" and fraction is not None:
        sync(device)
        free_after = torch.cuda.mem_get_info(device)[0]
        asked = sizing["free_before"] * fraction
        sizing["free_after"] = free_after
        sizing["asked_bytes"] = asked
        sizing["taken_bytes"] = sizing["free_before"] - free_after
        sizing["taken_over_asked"] = sizing["taken_bytes"] / asked
        sizing["within_2pct"] = abs(sizing["taken_over_asked"] - 1) < 0.02
    return cache, sizing


def fill_random(cache: KVCache, block_ids: torch.Tensor, seed: int, chunk: int = 128) -> None:
    generator = torch.Generator(device=cache.device).manual_seed(seed)
    for start in range(0, block_ids.numel(), chunk):
        ids = block_ids[start : start + chunk]
        shape = (ids.numel(), *cache.pool.shape[1:])
        cache.pool[ids] = torch.randn(
            shape, generator=generator, device=cache.device, dtype=torch.float32
        ).to(cache.dtype)


class Workload:
    """`max_batch` sequences of `context` tokens each (the step computes the last one)."""

    def __init__(
        self, cache: KVCache, *, max_batch: int, context: int, vocab: int, seed: int
    ) -> None:
        tpb = cache.tokens_per_block
        self.context = context
        self.tpb = tpb
        per_seq = math.ceil(context / tpb)
        generator = torch.Generator().manual_seed(seed)
        perm = torch.randperm(cache.num_blocks, generator=generator)[: max_batch * per_seq]
        if perm.numel() < max_batch * per_seq:
            raise SystemExit(f"pool of {cache.num_blocks} blocks is too small")
        self.blocks = perm.view(max_batch, per_seq).tolist()
        self.tokens = torch.randint(0, vocab, (max_batch, context), generator=generator).tolist()
        fill_random(cache, perm.to(cache.device), seed)
        self.device = cache.device

    def batch(self, size: int, *, batched: bool) -> ForwardBatch:
        """The eager ForwardBatch of one decode step of the first `size` sequences."""
        pos, tpb, dev = self.context - 1, self.tpb, self.device
        blocks = self.blocks[:size]
        table = torch.tensor(blocks, dtype=torch.long, device=dev)
        seqs = tuple(
            SeqSlice(q_start=i, q_len=1, kv_len=self.context, block_ids=table[i])
            for i in range(size)
        )
        decode = None
        if batched:
            decode = DecodeMeta(
                block_table=table.to(torch.int32),  # as the runner's staging sends it
                context_lens=torch.full((size,), self.context, device=dev, dtype=torch.int32),
                max_context_len=self.context,
            )
        return ForwardBatch(
            input_ids=torch.tensor([t[pos] for t in self.tokens[:size]], device=dev),
            positions=torch.full((size,), pos, device=dev, dtype=torch.long),
            slot_mapping=torch.tensor(
                [b[pos // tpb] * tpb + pos % tpb for b in blocks], device=dev
            ),
            seqs=seqs,
            logits_indices=torch.arange(size, device=dev),
            decode=decode,
        )

    def rows(self, size: int) -> Any:
        return decode_rows(
            [(self.tokens[i], [], self.context - 1, self.blocks[i]) for i in range(size)],
            self.tpb,
        )

    def plan(self, size: int) -> tuple[StepPlan, dict[int, SampleSpec]]:
        items = []
        specs = {}
        for i in range(size):
            request = Request(
                request_id=i,
                prompt_token_ids=self.tokens[i],
                sampling=SamplingParams(max_tokens=16, temperature=0.0),
                arrival_time=0.0,
                num_computed_tokens=self.context - 1,
                block_table=BlockTable(block_ids=self.blocks[i]),
            )
            items.append(ScheduledItem(request=request, num_new_tokens=1, samples=True))
            specs[i] = SampleSpec(params=request.sampling, generator=None)
        return StepPlan(items=tuple(items), num_tokens=size), specs


def gemm_only_fn(model: CausalLM, size: int) -> Callable[[], object]:
    """The step's weight GEMMs alone (fused qkv, o, gate_up, down per layer; lm_head)."""
    x = torch.randn(size, model.args.hidden_size, device=model.device, dtype=model.dtype)
    layers = model.decoder_layers
    lm_head = model.lm_head
    assert lm_head is not None
    linear = F.linear

    def down(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(gate_up[:, : weight.shape[1]], weight)

    def run() -> torch.Tensor:
        h = x
        for block in layers:
            attn, mlp = block.self_attn, block.mlp
            assert attn.qkv_weight is not None and mlp.gate_up_weight is not None
            qkv = linear(h, attn.qkv_weight)
            h = linear(qkv[:, : attn.o_proj.weight.shape[1]], attn.o_proj.weight)
            h = down(linear(h, mlp.gate_up_weight), mlp.down_proj.weight)
        return linear(h, lm_head.weight)

    return run


def graphed(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


# ---- attention alone ----


def attention_ms(
    fn: Callable[[int], object], layers: int, device: torch.device
) -> dict[str, float]:
    """GPU time of one layer's call `fn(layer)`. On CUDA from a graph of one call per layer:
    launched one by one from Python, a decode attention kernel would be timed by its launch
    (longer on the host than the kernel on the GPU), and one layer's KV called again and again
    would be read from L2 instead of HBM."""
    if device.type != "cuda":
        return time_ms(lambda: fn(0), device, iters=1)
    replay = graphed(lambda: [fn(layer) for layer in range(layers)], device)
    return {key: value / layers for key, value in time_ms(replay, device, iters=5).items()}


def bench_attention(
    model: CausalLM, cache: KVCache, work: Workload, sizes: list[int], device: torch.device
) -> list[dict[str, Any]]:
    ops = model.ops
    rows: list[dict[str, Any]] = []
    heads, dim = model.args.num_heads, model.args.head_dim
    kv_per_seq = work.context * 2 * cache.num_kv_heads * dim * cache.element_bytes  # one layer
    for size in sizes:
        meta = work.batch(size, batched=True).decode
        assert meta is not None
        q = torch.randn(size, heads, dim, device=device, dtype=model.dtype)
        variants: list[tuple[str, Callable[[int], object]]] = [
            ("torch_gather_sdpa", functools.partial(decode_attention_torch, q, cache, meta=meta))
        ]
        if ops is not None and ops.name == "triton":
            from trtdisagg.model.attention_meta import from_decode
            from trtdisagg.model.paged_attention import AttentionTiles, num_splits_for
            from trtdisagg.model.triton_ops import TritonOps

            auto = num_splits_for(size, cache.num_kv_heads, device)
            configs = [(auto, 64), (auto, 32), (auto, 128), (max(1, auto // 4), 64)]
            for splits, block_n in dict.fromkeys(configs):
                tuned = TritonOps(AttentionTiles(block_n=block_n))
                call = functools.partial(
                    tuned.paged_attention, q, cache, meta=from_decode(meta), num_splits=splits
                )
                variants.append((f"triton splits={splits} block_n={block_n}", call))
        for name, fn in variants:
            try:
                t = attention_ms(fn, cache.num_layers, device)
            except Exception as exc:  # report and go on: one variant must not sink the run
                rows.append({"batch": size, "variant": name, "error": repr(exc)[:300]})
                continue
            rows.append(
                {
                    "batch": size,
                    "variant": name,
                    "us": t["ms"] * 1e3,
                    "kv_bytes": size * kv_per_seq,
                    "bytes_per_s": size * kv_per_seq / (t["ms"] / 1e3),
                }
            )
    return rows


def kernel_breakdown(fn: Callable[[], object], *, steps: int) -> list[dict[str, Any]]:
    """GPU time per step of each kernel that `fn` runs (torch.profiler / CUPTI), largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows: list[dict[str, Any]] = []
    for event in prof.key_averages():
        value: Any = getattr(event, "self_device_time_total", None)
        if value is None:
            value = getattr(event, "self_cuda_time_total", 0.0)
        device_us = float(value)
        if device_us <= 0:
            continue
        rows.append(
            {
                "name": event.key,
                "us_per_step": device_us / steps,
                "calls_per_step": event.count / steps,
            }
        )
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    return [{"name": "TOTAL", "us_per_step": total, "calls_per_step": 0.0}, *rows]


# ---- main ----


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a 2-layer model (smoke test)")
    parser.add_argument("--fraction", type=float, default=0.9, help="free_gpu_memory_fraction")
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--bandwidth-gib", type=float, default=4.0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ops", choices=("auto", "torch", "triton"), default="auto", help="fused-path kernels"
    )
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = [int(b) for b in args.batches.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.set_device(device)
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if on_cuda else platform.processor(),
        "context": args.context,
        "batches": sizes,
    }
    try:
        report["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        report["triton"] = None
    if on_cuda:
        props = torch.cuda.get_device_properties(device)
        report["sm_count"] = props.multi_processor_count
        report["gpu_memory_bytes"] = props.total_memory

    print(f"device {report['device']}  torch {report['torch']}  triton {report['triton']}")
    bw = hbm_bandwidth(device, args.bandwidth_gib if on_cuda else 0.25)
    report["bandwidth"] = bw
    best_bw = max(bw["copy_bytes_per_s"], bw["read_bytes_per_s"])
    print(
        f"HBM: copy {bw['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), "
        f"read-only sum {bw['read_bytes_per_s'] / 1e12:.2f} TB/s"
    )

    margs = small_args() if args.small else llama_8b_args()
    model = CausalLM(margs, dtype=torch.bfloat16, device=device)
    init_weights(model, args.seed)
    total_bytes, embed_bytes = param_bytes(model)
    ops: TorchOps = select_ops(device, torch.bfloat16)
    if args.ops == "torch":
        ops = TorchOps()
    elif args.ops == "triton":
        from trtdisagg.model.triton_ops import TritonOps

        ops = TritonOps()
    model.use_ops(ops)
    if on_cuda:
        torch.cuda.empty_cache()
    report["model"] = {
        "layers": margs.num_layers,
        "hidden": margs.hidden_size,
        "heads": margs.num_heads,
        "kv_heads": margs.num_kv_heads,
        "intermediate": margs.intermediate_size,
        "vocab": margs.vocab_size,
        "param_bytes": total_bytes,
        "embedding_bytes": embed_bytes,
        "ops": ops.name,
    }
    print(
        f"model: {total_bytes / 1e9:.2f} GB of bf16 weights "
        f"({embed_bytes / 1e9:.2f} GB embedding), ops {ops.name}"
    )

    max_batch = max(sizes)
    cache, sizing = make_pool(
        model,
        device,
        fraction=args.fraction if on_cuda else None,
        max_tokens=max_batch * (args.context + args.tokens_per_block) * 2,
        tpb=args.tokens_per_block,
    )
    report["kv_pool_sizing"] = sizing
    if "taken_over_asked" in sizing:
        print(
            f"KV pool: fraction {args.fraction} of {sizing['free_before'] / 2**30:.1f} GiB "
            f"free asks {sizing['asked_bytes'] / 2**30:.2f} GiB, took "
            f"{sizing['taken_bytes'] / 2**30:.2f} GiB ({sizing['taken_over_asked']:.4f} of it), "
            f"{sizing['num_blocks']} blocks"
        )
    work = Workload(
        cache, max_batch=max_batch, context=args.context, vocab=margs.vocab_size, seed=args.seed
    )

    graphs: DecodeGraphs | None = None
    if on_cuda and ops.graph_safe and any(m in modes for m in ("graph", "runner_graph")):
        graphs = DecodeGraphs(
            model=model,
            cache=cache,
            batch_sizes=tuple(sizes),
            max_blocks_per_seq=blocks_for(
                margs.max_position_embeddings, args.tokens_per_block, cache.num_blocks
            ),
        )
        t0 = time.perf_counter()
        graphs.capture()
        report["graph_capture_s"] = time.perf_counter() - t0
        print(f"captured graphs for {graphs.captured_sizes} in {report['graph_capture_s']:.1f} s")

    weight_read = total_bytes - embed_bytes
    kv_token = 2 * margs.num_layers * margs.num_kv_heads * margs.head_dim * 2
    results: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    for size in sizes:
        step_bytes = (
            weight_read + size * embed_bytes // margs.vocab_size + size * args.context * kv_token
        )
        floor_measured = step_bytes / best_bw * 1e3
        floor_nominal = step_bytes / NOMINAL_HBM_BYTES_PER_S * 1e3
        iters = args.iters if on_cuda else 1
        logits: dict[str, torch.Tensor] = {}
        for mode in modes:
            fn: Callable[[], object] | None = None
            timer = time_ms
            mode_iters = iters
            if mode == "eager_per_seq":
                batch = work.batch(size, batched=False)
                mode_iters = max(1, iters // (4 if size > 8 else 1))

                def fn(batch: ForwardBatch = batch) -> object:
                    model.ops = None  # the reference path, on the same (fused-view) weights
                    try:
                        return model(batch, cache)
                    finally:
                        model.ops = ops

            elif mode == "eager_batched":
                batch = work.batch(size, batched=True)

                def fn(batch: ForwardBatch = batch) -> object:
                    model.ops = None  # the reference path, on the same (fused-view) weights
                    try:
                        return model(batch, cache)
                    finally:
                        model.ops = ops

            elif mode == "eager_fused":
                batch = work.batch(size, batched=True)

                def fn(batch: ForwardBatch = batch) -> object:
                    return model(batch, cache)

            elif mode == "graph" and graphs is not None:
                rows = work.rows(size)

                def fn(rows: Any = rows) -> object:
                    assert graphs is not None
                    return graphs.run(rows)

            elif mode == "runner_graph" and graphs is not None:
                runner = ModelRunner(
                    model=model,
                    cache=cache,
                    device=device,
                    tokens_per_block=args.tokens_per_block,
                    batched_decode=True,
                    graphs=graphs,
                )
                plan, specs = work.plan(size)

                def fn(
                    runner: ModelRunner = runner, plan: StepPlan = plan, specs: Any = specs
                ) -> object:
                    return runner.execute(plan, specs)

                timer = wall_ms  # type: ignore[assignment]
            elif mode == "gemm_only" and on_cuda:
                fn = graphed(gemm_only_fn(model, size), device)
            if fn is None:
                continue
            try:
                with torch.inference_mode():
                    t = timer(fn, device, iters=mode_iters)
                    if mode in ("eager_per_seq", "eager_batched", "eager_fused", "graph"):
                        out = fn()
                        assert isinstance(out, torch.Tensor)
                        logits[mode] = out.float().clone()
            except Exception as exc:  # report and go on
                print(f"  batch {size} {mode}: FAILED {exc!r}")
                results.append({"batch": size, "mode": mode, "error": repr(exc)[:500]})
                continue
            row = {
                "batch": size,
                "context": args.context,
                "mode": mode,
                "step_ms": t["ms"],
                "step_ms_min": t["min_ms"],
                "step_ms_max": t["max_ms"],
                "tokens_per_s": size / (t["ms"] / 1e3),
                "step_bytes": step_bytes,
                "floor_ms_measured_bw": floor_measured,
                "floor_ms_nominal_bw": floor_nominal,
                "x_floor_measured": t["ms"] / floor_measured,
                "x_floor_nominal": t["ms"] / floor_nominal,
            }
            if mode == "gemm_only":
                row["step_bytes"] = weight_read
                row["x_floor_measured"] = t["ms"] / (weight_read / best_bw * 1e3)
                row["x_floor_nominal"] = t["ms"] / (weight_read / NOMINAL_HBM_BYTES_PER_S * 1e3)
            results.append(row)
            print(
                f"  batch {size:3d} {mode:14s} {t['ms']:9.3f} ms  "
                f"({row['x_floor_measured']:.2f}x measured floor {floor_measured:.3f} ms, "
                f"{row['x_floor_nominal']:.2f}x nominal {floor_nominal:.3f} ms)"
            )
        if "eager_per_seq" in logits:
            ref = logits["eager_per_seq"].double()
            for mode, value in logits.items():
                err = float((value.double() - ref).norm() / ref.norm())
                checks[f"batch{size}_{mode}_rel_err_vs_per_seq"] = err
                same = bool(torch.equal(value.argmax(-1), logits["eager_per_seq"].argmax(-1)))
                checks[f"batch{size}_{mode}_argmax_equal"] = same
    report["results"] = results
    report["checks"] = checks
    save(
        report, args.result_json
    )  # again at the end; this keeps the main figures if later parts fail

    with torch.inference_mode():
        report["attention"] = bench_attention(model, cache, work, sizes, device)
        if graphs is not None:
            report["kernels"] = {}
            for size in sizes:
                rows = work.rows(size)
                try:
                    top = kernel_breakdown(functools.partial(graphs.run, rows), steps=3)
                except Exception as exc:  # diagnostics only
                    print(f"profiler failed: {exc!r}")
                    break
                report["kernels"][str(size)] = top
                print(f"graph replay at batch {size}: kernel time per step by kernel")
                for entry in top[:14]:
                    print(
                        f"  {entry['us_per_step']:9.1f} us  {entry['calls_per_step']:5.0f} calls  "
                        f"{entry['name'][:90]}"
                    )
    print("attention alone (one layer):")
    for row in report["attention"]:
        if "error" in row:
            print(f"  batch {row['batch']:3d} {row['variant']:32s} FAILED {row['error']}")
        else:
            print(
                f"  batch {row['batch']:3d} {row['variant']:32s} {row['us']:8.1f} us  "
                f"{row['bytes_per_s'] / 1e12:.2f} TB/s of KV"
            )

    print_table(report, best_bw)
    save(report, args.result_json)
    if args.result_json is not None:
        print(f"wrote {args.result_json}")
    return 0


def save(report: dict[str, Any], path: Path | None) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str))


def print_table(report: dict[str, Any], best_bw: float) -> None:
    print()
    print(f"decode step, context {report['context']}, {report['device']}")
    print(
        f"HBM measured {best_bw / 1e12:.2f} TB/s, nominal {NOMINAL_HBM_BYTES_PER_S / 1e12:.1f} TB/s"
    )
    header = ("batch", "mode", "ms", "tok/s", "floor ms", "x floor", "x nominal")
    print("{:>5} {:14} {:>9} {:>9} {:>9} {:>8} {:>9}".format(*header))
    for row in report["results"]:
        if "error" in row:
            print(f"{row['batch']:>5} {row['mode']:14} FAILED")
            continue
        floor = row["floor_ms_measured_bw"]
        if row["mode"] == "gemm_only":
            floor = row["step_bytes"] / best_bw * 1e3
        print(
            f"{row['batch']:>5} {row['mode']:14} {row['step_ms']:9.3f} {row['tokens_per_s']:9.0f} "
            f"{floor:9.3f} {row['x_floor_measured']:8.2f} {row['x_floor_nominal']:9.2f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
