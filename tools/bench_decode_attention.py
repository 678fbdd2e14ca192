"""Decode attention of every layer of the 8B geometry, by key-split count and short-tile shape.

A decode step of B sequences runs the paged attention kernel once per layer, each launch reading
that layer's K/V of every sequence. Timing one layer alone flatters a small batch: 16 sequences
of 600 tokens hold 39 MB a layer, which an H200's L2 keeps. So each configuration is timed as
one CUDA graph of all 32 layers' launches (the decode step's pattern: 1.2 GB of K/V, nothing
reused between launches), median of --iters replays, and set against the K/V bytes it reads.

Contexts are spread evenly over --context LO:HI, as in a closed loop of 512-token prompts and 128
output tokens (512:640). Per batch: every split count the kernel is compiled for, with the
default tiles; then, with --tiles, every (keys per iteration, warps, pipeline stages) of the
short tile at the default split count and at the fastest one (or at each of --tile-splits).

    python tools/bench_decode_attention.py --batches 1,16,64 --context 512:640 --tiles
    MIN_SPLIT_KEYS=64 python tools/bench_decode_attention.py     # the kernel's split floor
    python tools/bench_decode_attention.py --small --device cpu  # smoke test (interpreter)

Results go to --result-json, and to $OUT/bench_decode_attention.json when OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

KV_HEADS, Q_HEADS, HEAD_DIM = 8, 32, 128


def graph_ms(fn: Callable[[], object], iters: int) -> float:
    """Median ms of `iters` replays of `fn` captured as one CUDA graph (after two eager runs)."""
    for _ in range(2):
        fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    runs = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end))
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="2 layers (smoke test)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", default="512:640", help="LO:HI tokens, spread evenly")
    parser.add_argument("--tiles", action="store_true", help="sweep the short tile too")
    parser.add_argument(
        "--tile-splits", help="comma-separated split counts of the tile sweep (default: the "
        "default split count and the fastest one)",
    )  # fmt: skip
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    if not on_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    if os.environ.get("MIN_SPLIT_KEYS"):  # before the kernel is first compiled
        import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

        import trtdisagg.model.paged_attention as kernel_module

        kernel_module.MIN_SPLIT_KEYS = tl.constexpr(int(os.environ["MIN_SPLIT_KEYS"]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_decode import fill_random

    from trtdisagg.kv.cache import KVCache
    from trtdisagg.kv.page_table import Layout
    from trtdisagg.model import attention_meta
    from trtdisagg.model.paged_attention import (
        SPLIT_CHOICES,
        AttentionTiles,
        num_splits_for,
        paged_attention,
    )

    layers = 2 if args.small else 32
    lo, hi = (int(x) for x in args.context.split(":"))
    batches = [int(b) for b in args.batches.split(",")]
    tile_splits = [int(s) for s in args.tile_splits.split(",")] if args.tile_splits else []
    tpb = args.tokens_per_block
    cache = KVCache(
        num_blocks=max(batches) * -(-hi // tpb) + 8, num_layers=layers, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, tokens_per_block=tpb, layout=Layout.HND, dtype=torch.bfloat16,
        device=device,
    )  # fmt: skip
    order = torch.randperm(cache.num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    fill_random(cache, torch.tensor(order, device=device), seed=2)

    def time_it(fn: Callable[[], object]) -> float:
        if on_cuda:
            return graph_ms(fn, args.iters)
        fn()
        return float("nan")

    rows: list[dict[str, Any]] = []

    def sweep(batch: int) -> None:
        contexts = [lo + (hi - lo) * i // max(batch - 1, 1) for i in range(batch)]
        blocks = iter(order)
        tables = [[next(blocks) for _ in range(-(-c // tpb))] for c in contexts]
        meta = attention_meta.from_lists([1] * batch, contexts, tables, device=device)
        kv_bytes = sum(contexts) * layers * 2 * KV_HEADS * HEAD_DIM * 2
        queries = [
            torch.randn(batch, Q_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
            for _ in range(layers)
        ]
        default_splits = num_splits_for(batch, KV_HEADS, device)

        def step(tiles: AttentionTiles, splits: int) -> None:
            for layer, q in enumerate(queries):
                paged_attention(
                    q, cache, layer, meta, tiles=tiles, dot_fp32=not on_cuda, num_splits=splits
                )

        def record(tiles: AttentionTiles, splits: int) -> float:
            label = (
                f"B={batch:3d} block_n={tiles.block_n:3d} warps={tiles.short_warps} "
                f"stages={tiles.short_stages} splits={splits:2d}"
            )
            try:
                ms = time_it(functools.partial(step, tiles, splits))
            except Exception as exc:  # a variant over the SM's resources is data, not a stop
                print(f"{label} FAILED {type(exc).__name__}")
                return float("inf")
            default = splits == default_splits and tiles == AttentionTiles()
            mark = "  (default)" if default else ""
            print(f"{label} {ms:8.3f} ms {kv_bytes / ms / 1e6:7.0f} GB/s{mark}", flush=True)
            rows.append({
                "batch": batch, "block_n": tiles.block_n, "warps": tiles.short_warps,
                "stages": tiles.short_stages, "splits": splits, "ms": ms, "kv_bytes": kv_bytes,
            })  # fmt: skip
            return ms

        by_split = {s: record(AttentionTiles(), s) for s in SPLIT_CHOICES}
        if not args.tiles:
            return
        fastest = min(by_split, key=lambda s: by_split[s])
        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
            tiles = AttentionTiles(block_n=block_n, short_warps=warps, short_stages=stages)
            for splits in tile_splits or sorted({default_splits, fastest}):
                record(tiles, splits)

    for batch in batches:
        sweep(batch)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "min_split_keys": os.environ.get("MIN_SPLIT_KEYS", "default"),
        "rows": rows,
    }
    targets = [args.result_json] if args.result_json else []
    if os.environ.get("OUT"):
        targets.append(Path(os.environ["OUT"]) / "bench_decode_attention.json")
    for target in targets:
        target.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
