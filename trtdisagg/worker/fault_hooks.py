"""Arming test-only fault injection in a worker (TRTDISAGG_FAULTS; rules in trtdisagg/faults/).

Armed only when the config carries a spec. The one injector of the process then reaches the
control-plane ROUTER and every DEALER (message faults), the transfer agent (`FaultyAgent`:
submit, stall and WRITE_NOTICE faults), and the test-only routes `GET/POST /debug/faults`, which
read the counts and replace the rules at run time. Each injected fault is counted in
`trtdisagg_faults_injected_total{action,message}`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from trtdisagg.config import WorkerConfig

if TYPE_CHECKING:
    from trtdisagg.faults.spec import FaultInjector, FaultRule
from trtdisagg.metrics import WorkerMetrics

log = logging.getLogger(__name__)


def arm_faults(config: WorkerConfig, metrics: WorkerMetrics) -> FaultInjector | None:
    """The process's fault injector, or None (the normal case: no hook anywhere)."""
    if config.fault_injection is None:
        return None
    from trtdisagg.faults.spec import FaultInjector, parse_faults  # armed: tests only

    plan = parse_faults(config.fault_injection)  # validated with the config already
    log.warning(
        "FAULT INJECTION IS ARMED (TRTDISAGG_FAULTS=%r): this worker drops, delays and fails KV "
        "transfers on purpose. For tests only; never run it in production.",
        str(plan),
    )

    def count(rule: FaultRule) -> None:
        labels = {"action": rule.action.value, "message": rule.message_type or ""}
        metrics.faults_injected.labels(**labels).inc()

    return FaultInjector(plan=plan, on_fault=count)
