"""Errors of the transfer layer. Pure.

Every failure the transfer layer reports is one of these, each carrying what it concerns. None of
them is a sentinel or a bare `Exception`; the executor maps them to request failures, the HTTP
layer to status codes.

    TransferLayerError
    ├── ProtocolError        bytes from a peer that are not a valid message of this protocol
    ├── PeerIncompatible     a peer that can never exchange KV with us (checked at registration)
    ├── UnsupportedPairing   two pool views no mapper can pair (peers wraps it in PeerIncompatible)
    ├── MappingError         a request whose block lists do not fit the pools (a caller bug)
    └── AgentError           a transfer agent refused or failed an operation
"""

from __future__ import annotations


class TransferLayerError(Exception):
    """Base of every error raised by `trtdisagg.transfer`."""


class ProtocolError(TransferLayerError):
    """Bytes that do not decode to a known, well-formed message of this protocol version."""


class PeerIncompatible(TransferLayerError):
    """A peer whose settings can never work with ours; the reason names each field and both values.

    Raised once at registration; the caller caches it so that later requests to that peer fail
    fast with the same message.
    """

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"peer {peer} is incompatible: {reason}")
        self.peer = peer
        self.reason = reason


class UnsupportedPairing(TransferLayerError):
    """No mapper can move bytes between these two pool views (names both views' values)."""


class MappingError(TransferLayerError):
    """Block lists or token counts that do not fit the mapped pools."""


class AgentError(TransferLayerError):
    """A transfer agent refused or failed an operation (bad region, unknown remote, backend)."""
