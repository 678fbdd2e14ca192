"""Pure modules import no torch, trio, zmq, nixl or httpx, so they stay fast to test and easy
to reuse.

Extend PURE_MODULES when adding a pure module outside transfer/protocol/ (whose every module is
pure, and taken here by name).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROTOCOL = Path(__file__).parents[2] / "trtdisagg" / "transfer" / "protocol"
PURE_MODULES: tuple[str, ...] = (
    "trtdisagg",  # the offline engine's names come on first use
    "trtdisagg.kv.page_table",
    "trtdisagg.kv.hashing",
    "trtdisagg.kv.block_pool",
    "trtdisagg.kv.event_log",
    "trtdisagg.kv.free_runs",
    "trtdisagg.worker.request",
    "trtdisagg.worker.scheduler",
    "trtdisagg.worker.step_plan",
    "trtdisagg.worker.in_flight",
    "trtdisagg.worker.token_bans",
    "trtdisagg.faults.spec",
    "trtdisagg.faults.agent",
    "trtdisagg.transfer.errors",
    "trtdisagg.transfer.runtime.agents.base",
    # every module of the transfer protocol core, present and future
    *sorted(f"trtdisagg.transfer.protocol.{path.stem}" for path in PROTOCOL.glob("[!_]*.py")),
    "trtdisagg.worker.rank_plan",
    "trtdisagg.worker.engine.ending",
    "trtdisagg.worker.engine.outputs",
    "trtdisagg.worker.engine.tracker",
    "trtdisagg.worker.engine.ports",
    "trtdisagg.worker.engine.forks",
    "trtdisagg.worker.http.handoff",
    "trtdisagg.worker.http.prompt_scores",
    "trtdisagg.worker.http.plain_chunk",
    "trtdisagg.coordinator.cluster",
    "trtdisagg.coordinator.routers",
    "trtdisagg.coordinator.ledger",
    "trtdisagg.coordinator.continuation",
    "trtdisagg.coordinator.whole_answer",
    "trtdisagg.api.reasoning",
    "trtdisagg.api.responses_items",
    "trtdisagg.api.fields",
    "trtdisagg.api.fields_base",
    "trtdisagg.api.vllm_fields",
    "trtdisagg.api.validation",
    "trtdisagg.api.fanout",
    "trtdisagg.api.chat",
    "trtdisagg.api.grammars",
    "trtdisagg.api.tool_calls",
    "trtdisagg.api.responses_api",
    "trtdisagg.api.responses_fields",
    "trtdisagg.api.tokenize",
    "trtdisagg.api.responses_events",
    "trtdisagg.api.sse",
    "trtdisagg.api.unknown_fields",
    "trtdisagg.ratelimit",
    "trtdisagg.security.secret",
    "trtdisagg.security.limits",
    "trtdisagg.security.policy",
    "trtdisagg.membership.etcd_wire",
    "trtdisagg.membership.records",
    "trtdisagg.membership.embedded",
    "trtdisagg.coordinator.split",
)
FORBIDDEN: tuple[str, ...] = ("torch", "trio", "zmq", "nixl", "httpx")

# One fresh interpreter (here, other tests may have imported anything) imports the modules in
# turn, and names the first one after which a forbidden package is loaded: that one brought it.
_PROBE = """
import importlib, json, sys
forbidden, found = {forbidden!r}, {{}}
for module in {modules!r}:
    importlib.import_module(module)
    loaded = sorted({{m for m in sys.modules if m.split(".")[0] in forbidden}})
    if loaded:
        found[module] = loaded
        break
print(json.dumps(found))
"""


def test_pure_modules_import_no_io_and_no_torch() -> None:
    code = _PROBE.format(modules=PURE_MODULES, forbidden=FORBIDDEN)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {}, f"a pure module imports: {result.stdout.strip()}"


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
