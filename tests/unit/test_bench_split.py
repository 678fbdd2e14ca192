"""tools/bench_split.py's summary: per-prompt differences between the three paths."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_split


def test_the_differences_are_taken_per_prompt_not_between_percentiles() -> None:
    # The machine stalled on different prompts for different paths: per prompt, the handover
    # is 5, -30 and 49 ms (p50 5 ms); p50(manual) - p50(direct) would say 9 ms.
    times = {
        "direct": [0.010, 0.050, 0.011],
        "manual": [0.015, 0.020, 0.060],
        "coordinator": [0.017, 0.022, 0.062],
    }
    text, document = bench_split.report(times)
    handover = document["manual - direct (handover)"]
    own = document["coordinator - manual (the coordinator itself)"]
    assert handover["p50_ms"] == pytest.approx(5.0)
    assert own["p50_ms"] == pytest.approx(2.0) and own["p90_ms"] == pytest.approx(2.0)
    assert text.splitlines()[-1] == "coordinator_added_ms_p50=2.00"


def test_bad_arguments_are_refused_with_the_rule() -> None:
    with pytest.raises(SystemExit):
        bench_split.main(["--output-len", "1"])  # ctx would finish the request itself
