"""The paged attention kernel against the per-sequence path, and an 8k prefill against the GPU's
measured bf16 matmul rate, for the 8B geometry on one GPU.

Builds a Llama-3.1-8B-shaped CausalLM (as tools/bench_decode.py: seeded random bf16 weights on
the GPU, fused Triton ops) and a KV pool of random K/V, then for each workload

  prefill_512   one 512-token prompt (concurrency 1)
  prefill_8k    one 8,192-token prompt
  mixed         64 decode rows at --context tokens next to one 512-token prompt chunk
  mixed_16      15 decode rows next to a 497-token chunk (concurrency 16, 512 tokens a step)
  decode_64     64 decode rows at --context tokens

times, with CUDA events (warm-up first, median of --iters runs):

  attn_kernel   one layer's attention: the paged attention kernel, one launch
  attn_per_seq  the same through `Attention._attend_per_sequence` (SDPA per sequence)
  fwd_kernel    the whole eager forward on the Triton ops (attention through the kernel)
  fwd_per_seq   the same forward with attention per sequence

The 8k forward's rate counts 2 x parameters x tokens plus causal attention FLOPs
(4 x head_dim x heads x layers x n(n+1)/2) and is set against a bf16 matmul measured in the same
run (8192^3, random inputs). A sweep of the long tiles (`TILE_SWEEP`) on the prompts and mixed
steps, and of the split counts on decode_64, follow; the compiled-variant count is checked to
stay flat after warm-up.

    python tools/bench_attention.py                     # one H200: prints a table last
    python tools/bench_attention.py --small --device cpu --no-sweep   # smoke test (interpreter)

Full results go to `$OUT/bench_attention.json` when OUT is set (and to --result-json).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

ROW_NAMES = ("attn_kernel", "attn_per_seq", "fwd_kernel", "fwd_per_seq")


def time_ms(
    fn: Callable[[], object], device: torch.device, *, iters: int, warmup: int = 2
) -> dict[str, float]:
    """Median (and spread) of `iters` separately timed calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    runs: list[float] = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(runs), "min_ms": min(runs), "max_ms": max(runs), "n": iters}


def matmul_rate(device: torch.device, size: int, iters: int) -> dict[str, float]:
    """bf16 GEMM rate (FLOP/s) on random inputs, three input sets in rotation."""
    sets = [
        (torch.randn(size, size, device=device).to(torch.bfloat16),
         torch.randn(size, size, device=device).to(torch.bfloat16))
        for _ in range(3)
    ]  # fmt: skip
    turn = iter(range(1 << 30))

    def run() -> torch.Tensor:
        a, b = sets[next(turn) % 3]
        return a @ b

    t = time_ms(run, device, iters=iters, warmup=3)
    return {"size": size, "ms": t["ms"], "flops_per_s": 2 * size**3 / (t["ms"] / 1e3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a 2-layer model, small sizes")
    parser.add_argument("--context", type=int, default=1024, help="decode rows' context")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    from bench_decode import fill_random, init_weights, llama_8b_args, small_args

    from trtdisagg.kv.cache import KVCache
    from trtdisagg.kv.page_table import Layout
    from trtdisagg.model import attention_meta
    from trtdisagg.model.batch import AttentionMeta, ForwardBatch, SeqSlice
    from trtdisagg.model.llama import CausalLM
    from trtdisagg.model.paged_attention import SPLIT_CHOICES, AttentionTiles
    from trtdisagg.model.triton_ops import TritonOps, compiled_variants

    class PerSequenceOps(TritonOps):
        """The Triton ops with attention one sequence at a time (the path the kernel replaces)."""

        def prepare_attention(self, batch: ForwardBatch) -> AttentionMeta | None:
            return None

    on_cuda = device.type == "cuda"
    if on_cuda:
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    small = args.small
    margs = small_args() if small else llama_8b_args()
    scale = 16 if small else 1
    iters = args.iters if on_cuda else 1
    context = args.context // scale
    workloads: dict[str, list[tuple[int, int]]] = {
        "prefill_512": [(512 // scale, 512 // scale)],
        "prefill_8k": [(8192 // scale, 8192 // scale)],
        "mixed": [(1, context)] * (64 // scale) + [(512 // scale, 512 // scale)],
        # concurrency 16 with max_num_tokens 512: 15 decode rows beside a new prompt's chunk
        "mixed_16": [(1, context)] * (15 // scale) + [(497 // scale, 497 // scale)],
        "decode_64": [(1, context)] * (64 // scale),
    }
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "triton": importlib.metadata.version("triton"),
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if on_cuda else platform.processor(),
        "workloads": {
            k: {"seqs": len(v), "q_tokens": sum(q for q, _ in v)} for k, v in workloads.items()
        },
    }
    print(f"device {report['device']}  torch {report['torch']}  triton {report['triton']}")
    matmul = matmul_rate(device, 8192 if on_cuda else 256, iters)
    report["matmul"] = matmul
    print(f"bf16 matmul {matmul['size']}^3: {matmul['flops_per_s'] / 1e12:.0f} TFLOP/s")

    model = CausalLM(margs, dtype=torch.bfloat16, device=device)
    init_weights(model, 0)
    ops, per_seq_ops = TritonOps(), PerSequenceOps()
    model.use_ops(ops)
    params = sum(p.numel() for p in model.parameters())
    tpb = args.tokens_per_block
    blocks_needed = sum(-(-kv // tpb) for seqs in workloads.values() for _, kv in seqs)
    cache = KVCache(
        num_blocks=blocks_needed + 8, num_layers=margs.num_layers,
        num_kv_heads=margs.num_kv_heads, head_dim=margs.head_dim, tokens_per_block=tpb,
        layout=Layout.HND, dtype=torch.bfloat16, device=device,
    )  # fmt: skip
    order = torch.randperm(cache.num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    fill_random(cache, torch.tensor(order, device=device), seed=2)
    with torch.inference_mode():
        model.warm_up(cache)
    if on_cuda:
        torch.cuda.synchronize(device)
    warmed = compiled_variants()

    def batch_for(seqs: list[tuple[int, int]]) -> ForwardBatch:
        nonlocal order
        tables: list[list[int]] = []
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        slices: list[SeqSlice] = []
        last: list[int] = []
        for q_len, kv_len in seqs:
            count = -(-kv_len // tpb)
            table, order = order[:count], order[count:]
            tables.append(table)
            start = kv_len - q_len
            slices.append(SeqSlice(
                q_start=len(ids), q_len=q_len, kv_len=kv_len,
                block_ids=torch.tensor(table, device=device),
            ))  # fmt: skip
            ids.extend((7 * p + 3) % margs.vocab_size for p in range(start, kv_len))
            positions.extend(range(start, kv_len))
            slots.extend(table[p // tpb] * tpb + p % tpb for p in range(start, kv_len))
            last.append(len(ids) - 1)
        meta = attention_meta.from_lists(
            [q for q, _ in seqs], [kv for _, kv in seqs], tables, device=device
        )
        return ForwardBatch(
            input_ids=torch.tensor(ids, device=device),
            positions=torch.tensor(positions, device=device),
            slot_mapping=torch.tensor(slots, device=device),
            seqs=tuple(slices),
            logits_indices=torch.tensor(last, device=device),
            attention=meta,
        )

    attn = model.decoder_layers[0].self_attn
    results: list[dict[str, Any]] = []
    batches: dict[str, ForwardBatch] = {}
    for name, seqs in workloads.items():
        batch = batch_for(seqs)
        batches[name] = batch
        meta = batch.attention
        assert meta is not None
        n = batch.num_tokens
        q = torch.randn(n, margs.num_heads, margs.head_dim, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        plain = attrs.evolve(batch, attention=None)

        def per_seq_attention(
            q: torch.Tensor = q, out: torch.Tensor = out, seqs: tuple[SeqSlice, ...] = batch.seqs
        ) -> None:
            attn._attend_per_sequence(
                q, out, seqs=seqs, masks=(None,) * len(seqs), cache=cache, layer=0
            )

        def kernel_attention(q: torch.Tensor = q, meta: AttentionMeta = meta) -> object:
            return ops.paged_attention(q, cache, 0, meta)

        def forward_with(run_ops: TritonOps, fb: ForwardBatch) -> Callable[[], object]:
            def run() -> object:
                model.ops = run_ops
                try:
                    return model(fb, cache)
                finally:
                    model.ops = ops

            return run

        runs: dict[str, Callable[[], object]] = {
            "attn_kernel": kernel_attention,
            "attn_per_seq": per_seq_attention,
            "fwd_kernel": forward_with(ops, batch),
            "fwd_per_seq": forward_with(per_seq_ops, plain),
        }
        for mode, fn in runs.items():
            heavy = mode.startswith("fwd") and (name == "prefill_8k" or mode == "fwd_per_seq")
            with torch.inference_mode():
                t = time_ms(fn, device, iters=max(3, iters // 4) if heavy else iters)
            row = {"workload": name, "mode": mode, **t}
            results.append(row)
            print(f"  {name:12s} {mode:13s} {t['ms']:10.3f} ms  (min {t['min_ms']:.3f})")
    report["results"] = results
    report["compiled_after_warm_up"] = {
        k: v - warmed.get(k, 0) for k, v in compiled_variants().items()
    }

    # The 8k prefill: achieved rate of the forward and of the attention kernel alone.
    n = workloads["prefill_8k"][0][0]
    attn_flops_layer = 4 * margs.head_dim * margs.num_heads * n * (n + 1) // 2
    flops = 2 * params * n + attn_flops_layer * margs.num_layers
    by = {(r["workload"], r["mode"]): r for r in results}
    fwd_ms = by[("prefill_8k", "fwd_kernel")]["ms"]
    kernel_ms = by[("prefill_8k", "attn_kernel")]["ms"]
    prefill = {
        "tokens": n,
        "params": params,
        "flops": flops,
        "attention_share": attn_flops_layer * margs.num_layers / flops,
        "forward_ms": fwd_ms,
        "forward_flops_per_s": flops / (fwd_ms / 1e3),
        "fraction_of_matmul": flops / (fwd_ms / 1e3) / matmul["flops_per_s"],
        "attention_kernel_flops_per_s": attn_flops_layer / (kernel_ms / 1e3),
    }
    report["prefill_8k"] = prefill

    sweep: list[dict[str, Any]] = []
    if not args.no_sweep:
        for long_rows, block_n, warps, stages in TILE_SWEEP:
            tiles = AttentionTiles(
                long_rows=long_rows, block_n=block_n, long_warps=warps, num_stages=stages
            )
            label = f"rows={long_rows} block_n={block_n} warps={warps} stages={stages}"
            if tiles == AttentionTiles():
                label += " (default)"
            run = TritonOps(tiles).paged_attention
            for name in ("prefill_512", "mixed_16", "mixed", "prefill_8k"):
                what = f"{name} tiles"
                meta = batches[name].attention
                assert meta is not None
                q = torch.randn(batches[name].num_tokens, margs.num_heads, margs.head_dim,
                                device=device, dtype=torch.bfloat16)  # fmt: skip
                try:
                    with torch.inference_mode():
                        t = time_ms(functools.partial(run, q, cache, 0, meta), device,
                                    iters=iters)  # fmt: skip
                except Exception as exc:  # one variant failing (out of shared memory) is data
                    sweep.append({"what": what, "config": label, "error": repr(exc)[:300]})
                    continue
                row = {"what": what, "config": label, **t}
                if name == "prefill_8k":
                    row["flops_per_s"] = attn_flops_layer / (t["ms"] / 1e3)
                sweep.append(row)
        meta64 = batches["decode_64"].attention
        assert meta64 is not None
        q64 = torch.randn(meta64.num_seqs, margs.num_heads, margs.head_dim, device=device,
                          dtype=torch.bfloat16)  # fmt: skip
        for splits in SPLIT_CHOICES:
            attend = functools.partial(
                ops.paged_attention, q64, cache, 0, meta64, num_splits=splits
            )
            with torch.inference_mode():
                t = time_ms(attend, device, iters=iters)
            sweep.append({"what": "decode_64 splits", "config": f"splits={splits}", **t})
    report["sweep"] = sweep
    save(report, args.result_json)
    print_table(report)
    return 0


# Long-tile configs of the sweep: (rows, block_n, warps, stages); the default is among them.
TILE_SWEEP = (
    (64, 64, 4, 2), (128, 64, 8, 3), (128, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 3),
    (128, 32, 8, 3), (64, 128, 4, 2),
)  # fmt: skip


def save(report: dict[str, Any], path: Path | None) -> None:
    text = json.dumps(report, indent=2, default=str)
    targets = [path] if path is not None else []
    if os.environ.get("OUT"):
        targets.append(Path(os.environ["OUT"]) / "bench_attention.json")
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(f"wrote {target}")


def print_table(report: dict[str, Any]) -> None:
    print()
    for row in report["sweep"]:
        extra = f"{row['flops_per_s'] / 1e12:7.1f} TFLOP/s" if "flops_per_s" in row else ""
        if "error" in row:
            print(f"sweep {row['what']:17s} {row['config']:40s} FAILED {row['error'][:60]}")
        else:
            print(f"sweep {row['what']:17s} {row['config']:40s} {row['ms']:9.3f} ms {extra}")
    print()
    print(f"{report['device']}: median ms (CUDA events)")
    by = {(r["workload"], r["mode"]): r["ms"] for r in report["results"]}
    print(f"{'workload':12s} " + " ".join(f"{m:>12s}" for m in ROW_NAMES) + "  attn x  fwd x")
    for name in report["workloads"]:
        ms = [by.get((name, m), float("nan")) for m in ROW_NAMES]
        print(
            f"{name:12s} " + " ".join(f"{v:12.3f}" for v in ms)
            + f"  {ms[1] / ms[0]:6.2f} {ms[3] / ms[2]:6.2f}"
        )  # fmt: skip
    p = report["prefill_8k"]
    print(
        f"prefill {p['tokens']} tokens: forward {p['forward_ms']:.1f} ms, "
        f"{p['forward_flops_per_s'] / 1e12:.0f} TFLOP/s = {p['fraction_of_matmul']:.2f} of the "
        f"measured bf16 matmul {report['matmul']['flops_per_s'] / 1e12:.0f} TFLOP/s "
        f"(target >= 0.45; attention {p['attention_share']:.0%} of FLOPs, its kernel "
        f"{p['attention_kernel_flops_per_s'] / 1e12:.0f} TFLOP/s)"
    )
    print(f"compiled after warm-up: {report['compiled_after_warm_up']} (all 0 expected)")


if __name__ == "__main__":
    raise SystemExit(main())
