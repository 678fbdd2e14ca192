"""Who sent a message: the label a connection proved, or None. No I/O.

A control ROUTER learns two things about each connection from libzmq, and reads them off every
message it receives (`sockets.connection_claims`):

* `User-Id`: set by the ZAP task (`zap.py`) to the z85 public key the client completed the
  CURVE handshake with. The client cannot choose it: libzmq lets ZAP's User-Id override one the
  peer sends in its own handshake metadata, as long as ZAP is consulted at all (the server
  sockets make sure it is: `sockets.configure_curve_server`).
* the label (`keys.LABEL_PROPERTY` metadata): whatever the client claims to be.

`verify_peer` accepts the label only when the public key derived from (secret, label) is the
User-Id: only a holder of the cluster secret can make a key that matches a label. Anything
missing, malformed or mismatched is None, and the message must be dropped (and counted).

`PeerVerifier` is the same check with a bounded memo, since it runs for every message and a
connection's claims never change. Its `admit(claims, now)` is what a control ROUTER runs on each
message: the sender's label, or None after counting the refusal and logging it, at most
`REFUSAL_LINES` lines per key or address per `REFUSAL_INTERVAL_S` (`trtdisagg/ratelimit.py`).
One per ROUTER, for its life, driven by the ROUTER's clock.
"""

from __future__ import annotations

import hmac
import logging
from typing import Final

import attrs

from trtdisagg.ratelimit import LogRateLimit, log_limited
from trtdisagg.security.keys import MAX_LABEL_CHARS, PeerLabel, client_keypair
from trtdisagg.security.secret import ClusterSecret

log = logging.getLogger(__name__)

_Z85_PUBLIC_KEY_CHARS: Final = 40
REFUSAL_LINES: Final = 3
REFUSAL_INTERVAL_S: Final = 60.0
_LOGGED_LABEL_CHARS: Final = 100


@attrs.frozen(kw_only=True)
class ConnectionClaims:
    """What libzmq says about the connection a message came on; None where it says nothing
    (`sockets.connection_claims` reads them off a frame)."""

    user_id: str | None
    """The z85 public key ZAP approved (CURVE server sockets only)."""
    label: str | None
    """The peer's `X-Label` metadata: a claim, until checked here."""
    address: str | None
    """The peer's IP address, for log lines about a peer that proved nothing."""


def verify_peer(secret: ClusterSecret, label: str | None, user_id: str | None) -> PeerLabel | None:
    """The label a connection proved (its `label` claim and its authenticated `user_id`), or
    None when it proved nothing."""
    if not _plausible(label, user_id):
        return None
    assert label is not None and user_id is not None
    try:
        claimed = PeerLabel.parse(label)
    except ValueError:
        return None
    expected = client_keypair(secret, claimed).public
    return claimed if hmac.compare_digest(expected, user_id.encode()) else None


def _plausible(label: str | None, user_id: str | None) -> bool:
    """Both claims present and of a size worth checking (a peer chooses the label's size)."""
    return (
        label is not None
        and user_id is not None
        and len(label) <= MAX_LABEL_CHARS
        and len(user_id) == _Z85_PUBLIC_KEY_CHARS
        and user_id.isascii()
    )


@attrs.frozen(kw_only=True)
class VerifierStatistics:
    accepted: int
    refused: int


@attrs.define(eq=False, kw_only=True)
class PeerVerifier:
    """`verify_peer` for one secret, remembering up to `memo_size` answers (then starting
    over: peers' claims are attacker-chosen, so the memo must not grow with them)."""

    secret: ClusterSecret
    memo_size: int = 4096
    _memo: dict[tuple[str, str], PeerLabel | None] = attrs.field(factory=dict, init=False)
    _accepted: int = attrs.field(default=0, init=False)
    _refused: int = attrs.field(default=0, init=False)
    _warnings: LogRateLimit = attrs.field(
        factory=lambda: LogRateLimit(lines=REFUSAL_LINES, interval_s=REFUSAL_INTERVAL_S),
        init=False,
    )

    def admit(self, claims: ConnectionClaims, now: float) -> PeerLabel | None:
        """The label that sent a message with these claims, or None: drop the message (it is
        counted, and logged within the rate limit)."""
        peer = self.verify(claims.label, claims.user_id)
        if peer is None:
            # Keyed by what the peer cannot choose freely per message: its key, else its address.
            who = claims.user_id or claims.address or "an unknown peer"
            label = None if claims.label is None else claims.label[:_LOGGED_LABEL_CHARS]
            log_limited(log, self._warnings, who, now,
                        "refused a control message from %s (%s, label %r): it proved no"
                        " member's label", who, claims.address, label)  # fmt: skip
        return peer

    def flush_warnings(self, now: float) -> None:
        """Log the refusals still suppressed for peers that went quiet (call it now and then)."""
        for who, count in self._warnings.flush(now):
            log.warning("refused %d more control messages from %s", count, who)

    def verify(self, label: str | None, user_id: str | None) -> PeerLabel | None:
        """`verify_peer`, counted, without logging."""
        peer = None
        if _plausible(label, user_id):
            assert label is not None and user_id is not None
            memo_key = (label, user_id)  # both short: _plausible bounds them
            if memo_key in self._memo:
                peer = self._memo[memo_key]
            else:
                if len(self._memo) >= self.memo_size:
                    self._memo.clear()
                peer = self._memo[memo_key] = verify_peer(self.secret, label, user_id)
        if peer is None:
            self._refused += 1
        else:
            self._accepted += 1
        return peer

    def statistics(self) -> VerifierStatistics:
        return VerifierStatistics(accepted=self._accepted, refused=self._refused)
