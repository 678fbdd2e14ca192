"""Pure modules import no torch, trio, zmq, nixl or httpx, so they stay fast to test and easy
to reuse.

Extend PURE_MODULES when adding a pure module outside transfer/protocol/ (whose every module is
pure, and taken here by name).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PROTOCOL = Path(__file__).parents[2] / "trtdisagg" / "transfer" / "protocol"
PURE_MODULES: tuple[str, ...] = (
    "trtdisagg.kv.page_table",
    "trtdisagg.kv.hashing",
    "trtdisagg.kv.block_pool",
    "trtdisagg.worker.request",
    "trtdisagg.worker.scheduler",
    "trtdisagg.faults.spec",
    "trtdisagg.faults.agent",
    "trtdisagg.transfer.errors",
    "trtdisagg.transfer.runtime.agents.base",
    # every module of the transfer protocol core, present and future
    *sorted(f"trtdisagg.transfer.protocol.{path.stem}" for path in PROTOCOL.glob("[!_]*.py")),
    "trtdisagg.worker.rank_plan",
    "trtdisagg.coordinator.cluster",
    "trtdisagg.coordinator.routers",
    "trtdisagg.coordinator.split",
)
FORBIDDEN: tuple[str, ...] = ("torch", "trio", "zmq", "nixl", "httpx")

_PROBE = """
import importlib, sys
importlib.import_module({module!r})
forbidden = {forbidden!r}
print(sorted({{m for m in sys.modules if m.split(".")[0] in forbidden}}))
"""


@pytest.mark.parametrize("module", PURE_MODULES)
def test_module_is_pure(module: str) -> None:
    # A fresh interpreter: in this one, other tests may already have imported anything.
    code = _PROBE.format(module=module, forbidden=FORBIDDEN)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"{module} imports {result.stdout.strip()}"


_WORKER_PROBE = """
import sys
import trtdisagg.worker.serve, trtdisagg.worker.ranks, trtdisagg.cli
print(sorted(m for m in sys.modules if m.startswith("trtdisagg.faults") or "testing" in m.split(".")
             and m.startswith("trtdisagg")))
"""


def test_a_worker_loads_no_fault_injection_and_no_test_fakes() -> None:
    """Fault injection is loaded only when armed (worker/transfer_setup.py), and no production
    module imports a `testing` module."""
    result = subprocess.run(
        [sys.executable, "-c", _WORKER_PROBE], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
