"""tools/bench_sampler.py runs end to end on CPU and prints its table last (the GPU figures are
the lead's to take on the device)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_sampler


def test_the_table_comes_last_with_every_cell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sampler.json"
    argv = ["--device", "cpu", "--vocab", "512", "--iters", "2", "--batches", "1,3"]
    assert bench_sampler.main([*argv, "--result-json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 6 and lines[-6:] == rows
    assert [r.split(" | ")[1] for r in rows] == list(bench_sampler.WORKLOADS) * 2
    results = json.loads(out.read_text())["results"]
    assert {r["workload"]: "per_row" in r for r in results[:3]} == {
        "greedy": True, "sampled": True, "mixed": False,
    }  # fmt: skip
