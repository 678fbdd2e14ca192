"""tools/profile_steps.py's analysis of a profiler trace: steps cut at the tokens' copy, their
kinds, the kernel families and the gaps between kernels. No GPU: traces built here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import profile_steps as ps

COPY = "Memcpy DtoH (Device -> Pinned)"


def trace(*runs: list[tuple[str, float]], gap: float = 1.0) -> dict[str, Any]:
    """Back-to-back kernels with `gap` µs between them; each run is one step's (name, µs)."""
    events: list[dict[str, Any]] = [{"ph": "i", "name": "a host marker", "ts": 0}]
    t = 100.0
    for run in runs:
        for name, duration in run:
            category = "gpu_memcpy" if name.startswith("Memcpy") else "kernel"
            events.append({"ph": "X", "cat": category, "name": name, "ts": t, "dur": duration})
            t += duration + gap
    return {"traceEvents": list(reversed(events))}  # the tool sorts by start time


DECODE = [("nvjet_sm90_tst_64x16", 40.0), ("_paged_attention_kernel", 10.0), (COPY, 1.0)]
PROMPT = [("nvjet_sm90_tst_176x128", 300.0), ("_paged_attention_kernel", 50.0), (COPY, 1.0)]


def test_steps_are_cut_at_the_tokens_copy_and_sorted_into_kinds() -> None:
    events = ps.gpu_events(trace([("_rms_norm_kernel", 2.0), (COPY, 1.0)], DECODE, DECODE, PROMPT))
    assert [e.name for e in events][:2] == ["_rms_norm_kernel", COPY]
    steps = ps.cut_steps(events)
    assert len(steps) == 3  # the run before the first copy started before the profiler
    assert [s.busy_us for s in steps] == [51.0, 51.0, 351.0]
    assert steps[0].span_us == 3 * 1.0 + 51.0  # three gaps of 1 µs, then its kernels
    kinds = ps.split_kinds(steps, prompt_factor=1.3)
    assert [len(kinds["decode"]), len(kinds["with prompt"])] == [2, 1]


def test_kernel_families_and_their_time_per_step() -> None:
    steps = ps.cut_steps(ps.gpu_events(trace([(COPY, 1.0)], DECODE, DECODE)))
    table = {name: (us, calls) for name, us, calls in ps.by_family(steps)}
    assert table == {"gemm": (40.0, 1.0), "attention": (10.0, 1.0), "memcpy": (1.0, 1.0)}
    assert ps.family("void cublasLt::splitKreduce_kernel<32, 16>") == "split-k reduce"
    assert ps.family("reduce_kernel<512, 1, ReduceOp<float, ArgMaxOps<float>>>") == "argmax"
    assert ps.family("something new").startswith("other: ")


def test_gaps_are_summed_by_the_pair_around_them() -> None:
    events = ps.gpu_events(trace(DECODE, DECODE, gap=4.0))
    found = ps.gaps(events, at_least_us=3.0)
    assert (found[0][2], found[0][3]) == (8.0, 2)  # gemm -> attention, twice
    assert {(a, b) for a, b, _, _ in found} == {
        ("gemm", "attention"),
        ("attention", "memcpy"),
        ("memcpy", "gemm"),
    }
    assert ps.gaps(events, at_least_us=5.0) == []
    text = ps.report(events, prompt_factor=1.3, gap_us=3.0)
    assert "1 steps" in text.splitlines()[0] and "gemm -> attention" in text
