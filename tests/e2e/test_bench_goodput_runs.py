"""tools/bench_goodput.py end to end on the CPU (`--cpu-smoke`: the tiny model, tiny lengths,
1.5 s points): two real clusters started with `up` one after the other, aggregated and
disaggregated, two Poisson rates each through bench_serving's machinery, every process's
/metrics read, the summary, table, plot and point files written. A sweep that stops working is
caught here, not on the device."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def run_tool(argv: list[str], timeout: float) -> tuple[int, str, str]:
    """The tool as a child; on a timeout it gets SIGINT first, so it stops its clusters."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        pytest.fail(f"bench_goodput ran past {timeout:g} s:\n{out[-2000:]}\n{err[-2000:]}")
    return proc.returncode, out, err


def test_a_cpu_smoke_sweep_measures_both_modes_and_says_what_it_saw(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [
        sys.executable, str(ROOT / "tools" / "bench_goodput.py"), "run", "--cpu-smoke",
        "--modes", "aggregated,disagg", "--workloads", "chat", "--out", str(out),
        "--work", str(tmp_path / "work"),
        # Shorter points than the smoke's 3 s: each still has requests, and the paths are alike.
        "--point-s", "1.5", "--warmup-requests", "1",
    ]  # fmt: skip
    code, stdout, stderr = run_tool(argv, timeout=180)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    doc = json.loads((out / "goodput_summary.json").read_text())
    points = {(p["mode"], p["rate"]): p for p in doc["points"]}
    assert set(points) == {(m, r) for m in ("aggregated", "disagg") for r in (2.0, 4.0)}
    for p in points.values():
        assert p["requests"] > 0 and 0.0 <= p["attainment"] <= 1.0
        assert p["violations"]["error"] == 0.0, p["first_error"]
        assert p["gpus"] == 2  # the two-H200 files' GPUs, though this ran on the CPU
        assert p["observed"]["idle_after_s"] is not None  # the next point began on idle servers
        assert {"decode", "front_end_lag", "client", "gen_kv", "prefill"} <= set(p["indicators"])
    for rate in (2.0, 4.0):
        aggregated, disagg = points["aggregated", rate], points["disagg", rate]
        # Aggregated: every request served by one gen alone, no KV moved.
        assert aggregated["observed"]["local_prefill_share"] == 1.0
        assert aggregated["observed"]["transfer_mean_ms"] is None
        assert "ctx_queue" not in aggregated["indicators"]
        # Disaggregated: every request went ctx -> gen, its KV written by ctx.
        assert disagg["observed"]["local_prefill_share"] == 0.0
        assert disagg["observed"]["transfer_mean_ms"] > 0
        assert {"ctx_queue", "transfer", "ctx_kv"} <= set(disagg["indicators"])
    results = doc["results"]["chat"]
    assert results["disagg"]["per_gpu_vs_aggregated"] is not None
    assert results["aggregated"]["max_rate"]["bound"] in (
        "interpolated",
        "at_least",
        "below_lowest",
    )
    assert (out / "goodput_chat.png").stat().st_size > 10_000
    table = stdout[stdout.index("== chat: TTFT <= 2000 ms") :]  # printed last
    assert table.splitlines()[-1].startswith("disagg") and "\n[" not in table
    with tarfile.open(out / "goodput_points.tar.gz") as tar:
        member = tar.extractfile("goodput/disagg/chat_rate4.json")
        assert member is not None
        point_file = json.loads(member.read())
    assert len(point_file["records"]) == points["disagg", 4.0]["requests"]
    assert point_file["goodput_point"]["attainment"] == points["disagg", 4.0]["attainment"]
