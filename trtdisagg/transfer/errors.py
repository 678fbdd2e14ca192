"""Errors of the transfer layer, each naming what it concerns (no sentinels). Pure."""

from __future__ import annotations


class TransferLayerError(Exception):
    """Base of every error raised by `trtdisagg.transfer`."""


class ProtocolError(TransferLayerError):
    """Bytes that do not decode to a known, well-formed message of this protocol version."""


class PeerIncompatible(TransferLayerError):
    """A peer that can never exchange KV with us; `reason` names each field and both values.
    Raised once at registration and cached, so that later requests fail fast the same way."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"peer {peer} is incompatible: {reason}")


class UnsupportedPairing(TransferLayerError):
    """No mapper can move bytes between these two pool views (names both views' values)."""


class MappingError(TransferLayerError):
    """Block lists or token counts that do not fit the mapped pools (a caller bug)."""


class AgentError(TransferLayerError):
    """A transfer agent refused or failed an operation (bad region, unknown remote, backend)."""
