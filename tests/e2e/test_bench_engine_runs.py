"""tools/bench_engine.py end to end, small: the offline engine in a child process and a worker
over HTTP on the same workload (tiny, CPU), with probes, busy fractions and ratios. A benchmark
that stops working is caught here, not on the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(280)]

ROOT = Path(__file__).resolve().parents[2]


def test_a_small_run_reports_both_paths(tmp_path: Path) -> None:
    argv = [
        sys.executable, str(ROOT / "tools" / "bench_engine.py"), "--model", "tiny",
        "--concurrency", "1,4", "--input-len", "32", "--output-len", "24", "--num-requests",
        "12", "--warmup", "1", "--set", "max_num_tokens=512", "--label", "smoke",
    ]  # fmt: skip
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=260, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "bench_engine.json").read_text())
    assert doc["config"]["max_num_tokens"] == 512
    assert "worker ready" in (tmp_path / "bench_engine_worker.log").read_text()
    for mode in ("offline", "http"):
        runs = doc[mode]["runs"] if mode == "offline" else doc[mode]
        assert set(runs) == {"1", "4"}
        for run in runs.values():
            assert run["completed"] == 12 and run["failed"] == 0
            assert run["output_tok_s"] > 0 and run["tpot_ms"]["p50"] > 0
            # 12 prompts of 32 tokens, each prefilled in one step (max_num_tokens 512), then 23
            # tokens each from decode-only steps (at most 4 rows a step).
            steps = run["steps"]
            assert 1 <= steps["prefill_steps"] <= 12 and steps["decode_steps"] >= 12 * 23 / 4
            assert steps["decode_step_ms"] > 0 and 0 < steps["prefill_share"] < 1
    busy = doc["offline"]["runs"]["1"]["device_busy"]  # c=4 has too few waves for a window
    assert busy is not None and 0 < busy <= 1.05
    probes = doc["offline"]["probes"]
    assert probes["prefill_ms"] > 0 and probes["decode_ms"] > 0
    assert "http/offline tok/s, c=4" in doc["ratios"]
    assert "http TTFT p50 / (prefill + decode step), c=1" in doc["ratios"]
    table = done.stdout.splitlines()
    assert table[0].startswith("bench_engine smoke") and table[1].split()[:2] == ["mode", "c"]
