"""Pure modules import no torch, trio, zmq, nixl or httpx, so they stay fast to test and easy
to reuse.

Extend PURE_MODULES when adding a pure module.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

PURE_MODULES: tuple[str, ...] = (
    "trtdisagg",  # the offline engine's names come on first use
    "trtdisagg.kv.page_table",
    "trtdisagg.kv.hashing",
    "trtdisagg.kv.block_pool",
    "trtdisagg.worker.request",
    "trtdisagg.worker.scheduler",
    "trtdisagg.worker.step_plan",
    "trtdisagg.worker.in_flight",
    "trtdisagg.transfer.faults",
    "trtdisagg.transfer.agents.faulty",
    "trtdisagg.transfer.sessions",
    "trtdisagg.transfer.mappers",
    "trtdisagg.transfer.peers",
    "trtdisagg.transfer.bounce",
    "trtdisagg.transfer.prepared",
    "trtdisagg.transfer.pacing",
    "trtdisagg.worker.rank_plan",
    "trtdisagg.worker.engine.ending",
    "trtdisagg.worker.engine.outputs",
    "trtdisagg.worker.engine.tracker",
    "trtdisagg.worker.engine.ports",
    "trtdisagg.coordinator.cluster",
    "trtdisagg.coordinator.routers",
    "trtdisagg.api.fields",
    "trtdisagg.api.validation",
    "trtdisagg.api.fanout",
    "trtdisagg.api.chat",
    "trtdisagg.api.responses_api",
    "trtdisagg.api.responses_events",
    "trtdisagg.api.sse",
    "trtdisagg.ratelimit",
    "trtdisagg.security.secret",
    "trtdisagg.security.limits",
    "trtdisagg.security.policy",
    "trtdisagg.membership.etcd_wire",
    "trtdisagg.membership.records",
    "trtdisagg.membership.embedded",
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
