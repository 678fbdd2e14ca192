"""Time the batched sampler (`trtdisagg.worker.sampling`) on one device, at Llama-3's vocabulary.

For each batch size and workload it times one step's sampling from bf16 logits already on the
device (what the runner hands over), median and p90 of `--iters` calls:

  total     `sample(...)`: launch, device work, the one host sync, the Python result
  launch    `launch(...)` alone: host work to gather the rows and queue every kernel
  per_row   the per-row sampler it replaced (one torch.multinomial and one `.item()` per row;
            greedy, temperature, top-k and top-p only), for comparison

Workloads:

  greedy    every row temperature 0 (one argmax, no copies to the device)
  sampled   temperature 0.8, top_k 50, top_p 0.95; half the rows seeded
  mixed     every control: greedy, seeded and unseeded rows; logit_bias; presence, frequency
            and repetition penalties over a 512-token prompt and 128 output tokens; min_p;
            EOS suppression; allowed-token masks on some rows; logprobs (5) on some rows

    python tools/bench_sampler.py                       # cuda, batches 1 16 64
    python tools/bench_sampler.py --device cpu --vocab 32000 --iters 5   # smoke run

The table is printed last; `--result-json` writes the same figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trtdisagg.worker.request import SamplingParams
from trtdisagg.worker.sampling import (
    SampleSpec,
    TokenHistory,
    is_greedy,
    launch,
    make_generator,
    sample,
)

WORKLOADS = ("greedy", "sampled", "mixed")
EOS = (128001, 128009)


def specs_for(workload: str, batch: int, vocab: int, device: torch.device) -> list[SampleSpec]:
    """Fresh specs (fresh generators) for one step of `workload`."""
    specs = []
    mask = torch.full(((vocab + 31) // 32,), -1, dtype=torch.int32)
    mask[len(mask) // 2 :] = 0
    for i in range(batch):
        if workload == "greedy":
            params = SamplingParams(max_tokens=128, temperature=0.0)
        elif workload == "sampled":
            params = SamplingParams(
                max_tokens=128, temperature=0.8, top_k=50, top_p=0.95, seed=i if i % 2 else None
            )
        else:
            params = SamplingParams(
                max_tokens=128,
                temperature=(0.0, 0.7, 1.0, 1.2)[i % 4],
                top_k=(0, 50)[i % 2],
                top_p=(1.0, 0.9)[i % 2],
                min_p=(0.0, 0.05)[i % 2],
                seed=i if i % 3 else None,
                presence_penalty=0.5,
                frequency_penalty=0.3,
                repetition_penalty=1.1,
                logit_bias={(1000 + i) % vocab: 5.0, 2000 % vocab: -100.0},
                logprobs=5 if i % 4 == 1 else None,
            )
        history = None
        if params.penalized:
            prompt = [(i * 7919 + 13 * k) % vocab for k in range(512)]
            history = TokenHistory(prompt=prompt, output=[(p * 3) % vocab for p in prompt[:128]])
        specs.append(
            SampleSpec(
                params=params,
                generator=None if params.seed is None else make_generator(params.seed, device),
                suppress=frozenset(e for e in EOS if e < vocab)
                if workload == "mixed"
                else frozenset(),
                history=history,
                allowed=mask if workload == "mixed" and i % 8 == 5 else None,
            )
        )
    return specs


def per_row(logits: torch.Tensor, specs: list[SampleSpec]) -> list[int]:
    """The sampler this one replaced, for comparison: each row alone, one `.item()` each."""
    tokens = []
    for row, spec in zip(logits.float(), specs, strict=True):
        params = spec.params
        if is_greedy(params):
            tokens.append(int(torch.argmax(row).item()))
            continue
        scaled = row / params.temperature
        if 0 < params.top_k < scaled.numel():
            scaled = scaled.masked_fill(scaled < torch.topk(scaled, params.top_k).values[-1], -1e9)
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            drop = torch.cumsum(ordered, dim=-1) - ordered >= params.top_p
            drop[0] = False
            probs = torch.zeros_like(probs).scatter_(0, order, ordered.masked_fill(drop, 0.0))
        choice = torch.multinomial(probs, 1, generator=spec.generator)
        tokens.append(int(choice.item()))
    return tokens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, iters: int) -> list[float]:
    """Wall time of each call in ms, the device idle before each (so one call is measured)."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median_ms": statistics.median(ordered),
        "p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
    }


def run(device: torch.device, vocab: int, batches: list[int], iters: int) -> list[dict[str, Any]]:
    results = []
    noise = make_generator(0, device)
    for batch in batches:
        logits = torch.randn(batch, vocab, device=device, dtype=torch.bfloat16) * 4
        for workload in WORKLOADS:
            row = time_workload(logits, workload, iters, noise)
            results.append(row)
            median = row["total"]["median_ms"]
            print(f"batch {batch:3d} {workload:8s} total {median:.3f} ms", file=sys.stderr)
    return results


def time_workload(
    logits: torch.Tensor, workload: str, iters: int, noise: torch.Generator
) -> dict[str, Any]:
    """One (batch, workload) cell. Each call gets fresh specs, as each step's requests would."""
    batch, vocab = logits.shape
    device = logits.device
    made = [specs_for(workload, batch, vocab, device) for _ in range(3 * (iters + 3))]
    calls = iter(made)
    total = timed(lambda: sample(logits, next(calls), generator=noise), device, iters)
    launches = []
    for _ in range(iters + 3):
        _sync(device)
        start = time.perf_counter()
        pending = launch(logits, next(calls), generator=noise)
        launches.append((time.perf_counter() - start) * 1e3)
        pending.result()
    row: dict[str, Any] = {"batch": batch, "workload": workload}
    row["total"] = _stats(total)
    row["launch"] = _stats(launches[3:])
    if workload != "mixed":
        row["per_row"] = _stats(timed(lambda: per_row(logits, next(calls)), device, iters))
    return row


def print_table(results: list[dict[str, Any]], device: str, vocab: int) -> None:
    print(f"\nsampler, vocab {vocab}, {device}: median (p90) ms per step")
    print("| batch | workload | total | launch (host) | per-row sampler |")
    print("|---:|---|---:|---:|---:|")
    for r in results:
        cells = [f"{r[k]['median_ms']:.3f} ({r[k]['p90_ms']:.3f})" if k in r else "-"
                 for k in ("total", "launch", "per_row")]  # fmt: skip
        print(f"| {r['batch']} | {r['workload']} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)  # as a CPU worker runs (cpu_threads defaults to 1)
    batches = [int(b) for b in args.batches.split(",")]
    with torch.inference_mode():
        results = run(device, args.vocab, batches, args.iters)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    if args.result_json is not None:
        document = {"tool": "bench_sampler", "device": name, "vocab": args.vocab,
                    "torch": torch.__version__, "results": results}  # fmt: skip
        args.result_json.write_text(json.dumps(document, indent=2))
    print_table(results, name or device.type, args.vocab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
