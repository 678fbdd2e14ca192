"""What the ctx and gen sides (ctx.py, gen.py) share: the peer ranks met, and the count of peers'
messages refused, by reason (docs/LIFECYCLE.md, "Who may touch a transfer"; control.py counts the
sockets' `unauthenticated` and `handshake`). Warnings are limited per peer, so a flood costs a
few lines a minute and a count of what was suppressed. Pure.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Final, TypedDict

import attrs

from trtdisagg.ratelimit import LogRateLimit, log_limited
from trtdisagg.transfer.protocol import events as ev
from trtdisagg.transfer.protocol.peers import PeerRegistrar
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.sessions import TransferOutcome
from trtdisagg.transfer.protocol.wire import Cancel, Message

log = logging.getLogger("trtdisagg.transfer.protocol")

REASONS: Final = ("impersonation", "not_owner", "over_limit")
Out = list[ev.Effect]


class _Sender(TypedDict):
    """The fields of a message (wire.FromRank) that name its sender."""

    instance_name: str
    instance_rank: int


@attrs.define(eq=False, kw_only=True)
class Refusals:
    counts: dict[str, int] = attrs.Factory(lambda: dict.fromkeys(REASONS, 0))
    _warnings: LogRateLimit = attrs.Factory(lambda: LogRateLimit(lines=5, interval_s=60.0))

    def refuse(self, reason: str, peer: str, now: float, message: str, *args: object) -> None:
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


@attrs.define(eq=False, kw_only=True)
class Side:
    local: RankInfo
    timeout_s: float
    registrar: PeerRegistrar  # the peer ranks met, shared by both sides
    refusals: Refusals = attrs.Factory(Refusals)
    bounced: int = 0  # transfers that went through staging (since start)
    _started: dict[int, float] = attrs.Factory(dict)  # key -> when

    @property
    def _me(self) -> _Sender:
        """The fields that name this rank as a message's sender (wire.FromRank)."""
        return {
            "instance_name": self.local.instance_name,
            "instance_rank": self.local.instance_rank,
        }

    def _send(self, peer: tuple[str, int], message: Message, out: Out) -> None:
        if (info := self.registrar.get(peer)) is not None:
            out.append(ev.Send(endpoint=info.control_endpoint, message=message))

    def _cancel(self, key: int, instance: str, ranks: Iterable[int], out: Out) -> None:
        cancel = Cancel(key=key, **self._me)
        for rank in sorted(ranks):
            self._send((instance, rank), cancel, out)

    def _outcome(self, key: int, now: float, **fields: Any) -> TransferOutcome:
        return TransferOutcome(key=key, seconds=now - self._started.pop(key, now), **fields)
