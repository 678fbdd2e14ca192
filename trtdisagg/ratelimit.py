"""Per-peer log rate limiting: at most N lines per peer in any window of T seconds. Pure.

A peer that sends garbage, or that is refused, must not be able to flood the log: each line it
causes goes through `LogRateLimit.admit(peer, now)`. The answer is None (suppress the line) or an
`Admission` (log it), which carries how many of that peer's lines were suppressed since its last
logged one, so the log still says how much happened:

    limit = LogRateLimit(lines=5, interval_s=10.0)
    ...
    log_limited(log, limit, peer, clock(), "dropped a bad frame from %s", peer)

The guarantee is sliding, not per fixed window: among any `lines + 1` admitted lines of one
peer, the first and the last are at least `interval_s` apart. Every suppressed line is counted
exactly once: in the next admission of that peer, or, for a peer that went quiet, in what
`flush(now)` returns once its window has passed (call it now and then, e.g. from a sweep task,
and log the counts).

Peers are whatever the caller names them by (a label, a public key, an address); they may be
chosen by an attacker, so at most `max_peers` of them are tracked. When the table is full, a
peer whose window has passed with nothing pending is forgotten to make room; if there is none,
the new peer's lines count against one shared overflow entry (`OVERFLOW_PEER`, named in the
`Admission`), so memory stays bounded, the guarantee holds per entry and no count is lost.

Lifecycle: one instance per thing that logs (e.g. one per control socket), owned by it, driven
by its clock; no I/O, no threads, no timers.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Hashable
from typing import Any, Final

import attrs

OVERFLOW_PEER: Final = "<other peers>"


@attrs.frozen(kw_only=True)
class Admission:
    """Log this line; `suppressed` lines of the same peer were dropped since its last one."""

    peer: Hashable
    """Whom the line was counted against: the peer, or `OVERFLOW_PEER`."""
    suppressed: int


@attrs.frozen(kw_only=True)
class RateLimitStatistics:
    admitted: int
    suppressed: int
    """Every line suppressed so far (reported or not)."""
    peers: int
    """Entries held: at most `max_peers`, plus the overflow entry when in use."""


@attrs.define(eq=False, kw_only=True)
class _PeerWindow:
    admitted_at: collections.deque[float]  # the last `lines` admission times, oldest first
    pending: int = 0  # suppressed since the last admission, not yet reported


def _positive(_inst: object, attr: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attr.name} must be positive, got {value}")


@attrs.define(eq=False, kw_only=True)
class LogRateLimit:
    lines: int = attrs.field(validator=_positive)
    interval_s: float = attrs.field(validator=_positive)
    max_peers: int = attrs.field(default=1024, validator=_positive)
    _windows: dict[Hashable, _PeerWindow] = attrs.field(factory=dict, init=False)
    _overflow: _PeerWindow | None = attrs.field(default=None, init=False)
    _admitted: int = attrs.field(default=0, init=False)
    _suppressed: int = attrs.field(default=0, init=False)

    def admit(self, peer: Hashable, now: float) -> Admission | None:
        """Whether to log a line about `peer` at time `now` (never earlier than a previous
        call's `now`). None: suppress it (it is counted)."""
        key, window = self._window(peer, now)
        times = window.admitted_at
        if len(times) == self.lines and now - times[0] < self.interval_s:
            window.pending += 1
            self._suppressed += 1
            return None
        times.append(now)  # a deque with maxlen `lines`: the oldest time falls out
        self._admitted += 1
        admission = Admission(peer=key, suppressed=window.pending)
        window.pending = 0
        return admission

    def flush(self, now: float) -> list[tuple[Hashable, int]]:
        """The pending suppressed counts of peers whose last admitted line is at least a window
        old, and forget those peers: each count is returned once, and a peer's next line then
        starts a fresh window."""
        done = [peer for peer, window in self._windows.items() if self._passed(window, now)]
        counts = [(peer, self._windows.pop(peer).pending) for peer in done]
        overflow = self._overflow
        if overflow is not None and self._passed(overflow, now):
            counts.append((OVERFLOW_PEER, overflow.pending))
            self._overflow = None
        return [(peer, count) for peer, count in counts if count]

    def statistics(self) -> RateLimitStatistics:
        return RateLimitStatistics(
            admitted=self._admitted,
            suppressed=self._suppressed,
            peers=len(self._windows) + (self._overflow is not None),
        )

    def _window(self, peer: Hashable, now: float) -> tuple[Hashable, _PeerWindow]:
        window = self._windows.get(peer)
        if window is not None:
            return peer, window
        if len(self._windows) >= self.max_peers:
            self._forget_a_quiet_peer(now)
        if len(self._windows) >= self.max_peers:
            # Every tracked peer is still inside its window: a new one shares the overflow
            # entry, which is kept beside the `max_peers` others.
            window = self._overflow
            if window is None:
                window = self._overflow = _PeerWindow(admitted_at=self._deque())
            return OVERFLOW_PEER, window
        window = self._windows[peer] = _PeerWindow(admitted_at=self._deque())
        return peer, window

    def _forget_a_quiet_peer(self, now: float) -> None:
        """Forget one peer with nothing pending whose last line is a window old: its next line
        starts a fresh window without breaking the guarantee."""
        for peer, window in self._windows.items():
            if not window.pending and self._passed(window, now):
                del self._windows[peer]
                return

    def _passed(self, window: _PeerWindow, now: float) -> bool:
        return not window.admitted_at or now - window.admitted_at[-1] >= self.interval_s

    def _deque(self) -> collections.deque[float]:
        return collections.deque(maxlen=self.lines)


def log_limited(
    logger: logging.Logger,
    limit: LogRateLimit,
    peer: Hashable,
    now: float,
    message: str,
    *args: object,
    level: int = logging.WARNING,
) -> bool:
    """Log `message % args` at `level` unless `limit` suppresses it for `peer`; a line that
    follows suppressed ones says how many. True when it was logged."""
    admission = limit.admit(peer, now)
    if admission is None:
        return False
    if not admission.suppressed:
        logger.log(level, message, *args)
    elif admission.peer == OVERFLOW_PEER:
        logger.log(
            level, message + " (%d lines about other peers suppressed)", *args, admission.suppressed
        )
    else:
        logger.log(level, message + " (%d similar lines suppressed)", *args, admission.suppressed)
    return True
