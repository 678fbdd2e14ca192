"""Where a serving step's device time goes: kernel time per step, by kernel family, on CUDA.

Runs the offline engine (`trtdisagg.LLM`; bench_engine's config flags and workload) at one
concurrency: a warm-up, a closed loop timed without the profiler, then --waves x concurrency
requests under torch.profiler (CUDA activity only). Steps are cut at the sampled tokens' copy to
the host (one per step). A step whose kernel time exceeds --prompt-factor x the median is counted
as one that carries prompt tokens (decode steps are the median at any realistic concurrency).
Printed per kind: the steps' median span (first kernel to the tokens' copy) and kernel time, the
kernel time per step by family with calls per step, and the gaps between kernels, largest first
by the pair of kernels around them.

    python3 tools/profile_steps.py --config conf/gpu/worker.yaml --concurrency 16 \\
        --input-len 512 --output-len 128 --vocab-size 32000

The trace goes to --trace-out (gzip'd Chrome trace) when given.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

# Kernel families by a piece of the kernel's name, first match wins.
FAMILIES = (
    ("paged_attention", "attention"),
    ("rms_norm", "rms_norm"),
    ("rope_kv", "rope+kv write"),
    ("silu_mul", "silu_mul"),
    ("splitkreduce", "split-k reduce"),
    ("nvjet", "gemm"),
    ("gemm", "gemm"),
    ("cutlass", "gemm"),
    ("xmma", "gemm"),
    ("argmax", "argmax"),
    ("reduce_kernel", "reduce"),
    ("memcpy", "memcpy"),
    ("memset", "memset"),
    ("index", "index"),
)
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@attrs.frozen
class Event:
    name: str
    start_us: float
    duration_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us

    @property
    def is_tokens_copy(self) -> bool:
        return "Memcpy DtoH" in self.name or "Device -> P" in self.name


@attrs.frozen
class Step:
    events: tuple[Event, ...]
    span_us: float  # from the end of the step before to the end of this one's tokens copy

    @property
    def busy_us(self) -> float:
        return sum(e.duration_us for e in self.events)


def family(name: str) -> str:
    low = name.lower()
    for piece, label in FAMILIES:
        if piece in low:
            return label
    return "other: " + name[:48]


def gpu_events(trace: dict[str, Any]) -> list[Event]:
    """The device's kernels, copies and memsets of a Chrome trace, in start order."""
    events = [
        Event(name=e["name"], start_us=float(e["ts"]), duration_us=float(e["dur"]))
        for e in trace.get("traceEvents", ())
        if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES
    ]
    return sorted(events, key=lambda e: e.start_us)


def cut_steps(events: Sequence[Event]) -> list[Step]:
    """The events between consecutive tokens copies, each run ending with its copy. What comes
    before the first copy is dropped: its step started before the profiler did."""
    steps: list[Step] = []
    previous: int | None = None
    for i, event in enumerate(events):
        if not event.is_tokens_copy:
            continue
        if previous is not None and i > previous + 1:
            run = tuple(events[previous + 1 : i + 1])
            steps.append(Step(events=run, span_us=event.end_us - events[previous].end_us))
        previous = i
    return steps


def split_kinds(steps: Sequence[Step], prompt_factor: float) -> dict[str, list[Step]]:
    if not steps:
        return {}
    median = statistics.median(s.busy_us for s in steps)
    kinds: dict[str, list[Step]] = {"decode": [], "with prompt": []}
    for step in steps:
        kinds["with prompt" if step.busy_us > prompt_factor * median else "decode"].append(step)
    return {kind: group for kind, group in kinds.items() if group}


def by_family(steps: Sequence[Step]) -> list[tuple[str, float, float]]:
    """(family, kernel µs per step, calls per step), largest time first."""
    time_us: collections.defaultdict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    for step in steps:
        for event in step.events:
            time_us[family(event.name)] += event.duration_us
            calls[family(event.name)] += 1
    n = len(steps)
    largest = sorted(time_us.items(), key=lambda item: item[1], reverse=True)
    return [(name, total / n, calls[name] / n) for name, total in largest]


def gaps(events: Sequence[Event], at_least_us: float) -> list[tuple[str, str, float, int]]:
    """Idle time between consecutive device events, summed by (before, after) family pair:
    (before, after, total µs, count), largest first."""
    total: collections.defaultdict[tuple[str, str], float] = collections.defaultdict(float)
    count: collections.Counter[tuple[str, str]] = collections.Counter()
    for a, b in itertools.pairwise(events):
        gap = b.start_us - a.end_us
        if gap >= at_least_us:
            key = (family(a.name), family(b.name))
            total[key] += gap
            count[key] += 1
    largest = sorted(total.items(), key=lambda item: item[1], reverse=True)
    return [(a, b, us, count[(a, b)]) for (a, b), us in largest]


def report(events: Sequence[Event], prompt_factor: float, gap_us: float) -> str:
    steps = cut_steps(events)
    lines = [f"{len(events)} device events, {len(steps)} steps"]
    for kind, group in split_kinds(steps, prompt_factor).items():
        lines.append(
            f"== {kind}: {len(group)} steps, span p50 "
            f"{statistics.median(s.span_us for s in group):.1f} us, kernels p50 "
            f"{statistics.median(s.busy_us for s in group):.1f} us, events per step p50 "
            f"{statistics.median(len(s.events) for s in group):.0f}"
        )
        for name, us, calls in by_family(group):
            lines.append(f"   {name:52s} {us:9.1f} us/step {calls:7.1f} calls/step")
    if events:
        window_ms = (events[-1].end_us - events[0].start_us) / 1e3
        found = gaps(events, gap_us)
        lines.append(
            f"gaps >= {gap_us} us: {sum(c for *_, c in found)}, "
            f"{sum(us for _, _, us, _ in found) / 1e3:.2f} ms of {window_ms:.1f} ms"
        )
        for before, after, us, n in found[:12]:
            lines.append(f"   {us / 1e3:8.2f} ms  n={n:5d}  {before} -> {after}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from bench_engine import build_parser as engine_parser

    parser = engine_parser()
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--waves", type=int, default=3, help="profiled requests / concurrency")
    parser.add_argument("--prompt-factor", type=float, default=1.3)
    parser.add_argument("--gap-us", type=float, default=3.0)
    parser.add_argument("--trace-out", type=Path)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import torch
    import trio
    from _engine_offline import offline_loop
    from bench_engine import concurrencies, worker_config, workload

    from trtdisagg.offline import LLM

    args = build_parser().parse_args(argv)
    config = worker_config(args)
    llm = LLM(config.pop("model"), **config)
    concurrency = concurrencies(args)[0]
    warm, measured = workload(args, concurrency)
    trio.run(offline_loop, llm, warm, min(concurrency, len(warm)))
    start = time.perf_counter()
    records, _ = trio.run(offline_loop, llm, measured, concurrency)
    tokens = sum(r.output_tokens for r in records)
    print(f"unprofiled, c={concurrency}: {tokens / (time.perf_counter() - start):.1f} tok/s")
    _, profiled = workload(args, concurrency + 1)  # prompts of their own: no prefix-cache hits
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    profiler.start()
    trio.run(offline_loop, llm, profiled[: args.waves * concurrency], concurrency)
    torch.cuda.synchronize()
    profiler.stop()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        profiler.export_chrome_trace(str(path))
        raw = path.read_bytes()
    if args.trace_out is not None:
        args.trace_out.write_bytes(gzip.compress(raw))
    print(report(gpu_events(json.loads(raw)), args.prompt_factor, args.gap_us))
    return 0


if __name__ == "__main__":
    sys.exit(main())
