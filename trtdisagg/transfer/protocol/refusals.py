"""Peers' messages the protocol drops or refuses, counted by reason, warned about per peer. Pure.

`impersonation`: it names another sender than the rank its connection proved to be (or a write
notice names a rank whose agent did not send it); `not_owner`: it touches another peer
instance's session; `over_limit`: its gen instance holds `max_sessions_per_peer` transfers here.
(control.py counts the sockets' `unauthenticated` and `handshake`.) Warnings are limited per
peer, so a flood costs a few lines a minute and a count of what was suppressed.
"""

from __future__ import annotations

import logging
from typing import Final

import attrs

from trtdisagg.ratelimit import LogRateLimit, log_limited

log = logging.getLogger("trtdisagg.transfer.protocol")

REASONS: Final = ("impersonation", "not_owner", "over_limit")


@attrs.define(eq=False, kw_only=True)
class Refusals:
    counts: dict[str, int] = attrs.Factory(lambda: dict.fromkeys(REASONS, 0))
    _warnings: LogRateLimit = attrs.Factory(lambda: LogRateLimit(lines=5, interval_s=60.0))

    def refuse(self, reason: str, peer: str, now: float, message: str, *args: object) -> None:
        """Count a message of `peer` refused for `reason`, and warn (within the limit)."""
        self.counts[reason] += 1
        self.warn(peer, now, message, *args)

    def not_owner(self, what: str, key: int, peer: str, now: float) -> None:
        self.refuse("not_owner", peer, now, "%s %d from %s dropped: another peer instance's"
                    " session", what, key, peer)  # fmt: skip

    def warn(self, peer: str, now: float, message: str, *args: object) -> None:
        """A warning caused by `peer`'s input, at most a few per peer and minute."""
        log_limited(log, self._warnings, peer, now, message, *args)

    def flush(self, now: float) -> None:
        """Log how many warnings were suppressed for peers that went quiet."""
        for peer, count in self._warnings.flush(now):
            log.warning("%d more warnings about control messages from %s", count, peer)
