"""Event-loop lag: how late a short Trio sleep wakes up.

Anything that holds the Trio thread (a slow library call in a handler, a synchronous copy)
delays every request of the process at once, and no per-request timer shows why. Sampling the
wake-up delay a few times a second makes it a metric and, past a threshold, a log line. It costs
about ten wake-ups a second, so an idle process stays near 0% CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

log = logging.getLogger(__name__)

INTERVAL_S = 0.1
BLOCKED_LOG_S = 0.2
"""A lag this long is logged (at most once per `LOG_EVERY_S`, with the count since)."""
LOG_EVERY_S = 10.0


async def watch_loop_lag(
    observe: Callable[[float], None],
    *,
    interval: float = INTERVAL_S,
    blocked_log_s: float = BLOCKED_LOG_S,
) -> None:
    """Observe each sleep's overshoot in seconds, forever."""
    last_log = -LOG_EVERY_S
    blocked_since_log = 0
    while True:
        start = trio.current_time()
        await trio.sleep(interval)
        now = trio.current_time()
        lag = max(0.0, now - start - interval)
        observe(lag)
        if lag < blocked_log_s:
            continue
        blocked_since_log += 1
        if now - last_log >= LOG_EVERY_S:
            log.warning(
                "event loop blocked: a %.0f ms sleep woke %.0f ms late (%d such since the last "
                "line); a handler is holding the Trio thread",
                interval * 1e3,
                lag * 1e3,
                blocked_since_log,
            )
            last_log, blocked_since_log = now, 0
