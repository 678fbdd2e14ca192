"""Every Triton kernel variant that warm-up launches compiles for Hopper (sm_90) without
spilling, as a dependent launch that waits for the kernel before it, checked on this machine
without a GPU (`tools/triton_compile_check.py`, in a process
without the interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

TOOL = Path(__file__).resolve().parents[2] / "tools" / "triton_compile_check.py"


@pytest.mark.slow
def test_warm_up_variants_compile_for_hopper() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(TOOL)], env=env, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = "17 variants, 0 failed or spilled, 17 launch as dependents"
    assert summary in done.stdout, done.stdout[-3000:]
    assert "wgmma" in done.stdout
