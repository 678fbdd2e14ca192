"""tools/bench_transfer.py end to end, small: two spawned children with real NIXL agents and
transceivers, every schedule against raw NIXL, ctx kept busy by its "next step", the bytes
verified on gen. A benchmark that stops working is caught here, not on the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def test_a_small_run_of_every_schedule_verifies_its_bytes(tmp_path: Path) -> None:
    result = tmp_path / "bench.json"
    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    argv = [
        sys.executable, str(ROOT / "tools" / "bench_transfer.py"),
        "--kv-mib", "1", "--iterations", "3", "--warmup", "1", "--schedule", "both",
        "--ctx-busy-ms", "1", "--nixl-progress-thread", "off", "--result-json", str(result),
        "--ctx-cpus", str(first), "--gen-cpus", str(last),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("ratio_vs_raw_nixl=")
    assert float(lines[-1].split("=")[1]) > 0
    assert any(line.startswith("  ctx busy: its next step runs 1 ms") for line in lines)
    assert f"  pinned: ctx to CPU {first}, gen to CPU {last}" in lines
    doc = json.loads(result.read_text())
    assert doc["verified"] is True
    assert doc["config"]["ctx_busy_s"] == pytest.approx(0.001)
    assert set(doc["schedules"]) == {"context-first", "generation-first"}
