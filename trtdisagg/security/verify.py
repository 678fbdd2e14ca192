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
connection's claims never change; one per ROUTER, for its life.
"""

from __future__ import annotations

import hmac
from typing import Final

import attrs

from trtdisagg.security.keys import MAX_LABEL_CHARS, PeerLabel, client_keypair
from trtdisagg.security.secret import ClusterSecret

_Z85_PUBLIC_KEY_CHARS: Final = 40


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

    def verify(self, label: str | None, user_id: str | None) -> PeerLabel | None:
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
