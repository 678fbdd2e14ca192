"""Every Triton kernel variant that warm-up launches compiles for Hopper (sm_90) without
spilling, as a dependent launch that waits for the kernel before it, checked on this machine
without a GPU (`tools/triton_compile_check.py`, in a process
without the interpreter), and the tool lists each variant's machine code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

TOOL = Path(__file__).resolve().parents[2] / "tools" / "triton_compile_check.py"


@pytest.mark.slow
def test_warm_up_variants_compile_for_hopper(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(TOOL), "--sass-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = "17 variants, 0 failed or spilled, 17 launch as dependents"
    assert summary in done.stdout, done.stdout[-3000:]
    assert "wgmma" in done.stdout
    listings = sorted(tmp_path.glob("*.sass"))
    assert len(listings) == 17 == len(list(tmp_path.glob("*.ptx")))
    # Hopper's tensor-core instructions in the attention kernel with long tiles
    long_tiles = [p for p in listings if "paged_attention" in p.name and "HAS_LONG_True" in p.name]
    assert long_tiles and all("HGMMA" in p.read_text() for p in long_tiles)
