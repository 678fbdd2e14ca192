"""CURVE keys derived from the cluster secret, and the label that names a client. No I/O.

Every key is `HMAC-SHA256(secret, purpose)`: 32 bytes, used as a Curve25519 secret key (any 32
bytes are one; libzmq clamps them), whose public key libzmq computes (`zmq.curve_public`).
Nothing else here is cryptography. The purposes are separated so that no label can name the
server's key:

* the server keypair, one per cluster: `DERIVATION_VERSION + b"/server"`. Every control ROUTER
  uses it, and a client derives its public key from the secret alone, knowing nothing but the
  endpoint it dials.
* a client keypair per instance rank: `DERIVATION_VERSION + b"/client/" + label`, where the
  label is `PeerLabel.text`, "<instance_name>#<instance_rank>" (as `RankInfo.label` and agent
  names write it). Every DEALER of that rank uses it and sends the label as connection metadata
  (`LABEL_PROPERTY`); the server accepts the connection's messages only when the label's
  derived public key is the key the connection authenticated with (`verify.py`).

Pure functions of their inputs; a worker derives its two keypairs once at start.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Final

import attrs
import zmq
from zmq.utils import z85

from trtdisagg.security.secret import ClusterSecret

DERIVATION_VERSION: Final = b"trtdisagg-curve-v1"
LABEL_PROPERTY: Final = "X-Label"  # the client's label, as ZMQ_METADATA sends it
MAX_LABEL_CHARS: Final = 96
# An instance name as rank_info.make_instance_name makes it, or any name of the same alphabet.
_INSTANCE_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MAX_RANK: Final = 2**16 - 1


@attrs.frozen(kw_only=True)
class PeerLabel:
    """Who a client connection speaks for: one rank of one instance."""

    instance_name: str
    instance_rank: int

    def __attrs_post_init__(self) -> None:
        if not _INSTANCE_NAME.fullmatch(self.instance_name):
            raise ValueError(
                f"instance name {self.instance_name!r}: letters, digits, '.', '_' and '-' only"
            )
        if not 0 <= self.instance_rank <= _MAX_RANK:
            raise ValueError(f"instance rank {self.instance_rank} outside [0, {_MAX_RANK}]")
        if len(self.text) > MAX_LABEL_CHARS:
            raise ValueError(f"label {self.text!r} longer than {MAX_LABEL_CHARS} characters")

    @property
    def text(self) -> str:
        return f"{self.instance_name}#{self.instance_rank}"

    @property
    def key(self) -> tuple[str, int]:
        """(instance_name, instance_rank), as `RankInfo.key` and wire messages name a rank."""
        return (self.instance_name, self.instance_rank)

    @classmethod
    def parse(cls, text: str) -> PeerLabel:
        """The label `text` writes; ValueError for anything else (labels come from peers)."""
        if len(text) > MAX_LABEL_CHARS:
            raise ValueError(f"label of {len(text)} characters, over {MAX_LABEL_CHARS}")
        name, sep, rank = text.rpartition("#")
        if not sep or not rank.isdigit() or not rank.isascii() or rank != str(int(rank)):
            raise ValueError(f"label {text!r} is not <instance_name>#<instance_rank>")
        return cls(instance_name=name, instance_rank=int(rank))


@attrs.frozen(kw_only=True)
class CurveKeypair:
    """A CURVE keypair, both keys z85-encoded (40 bytes), as libzmq's socket options take them."""

    public: bytes
    secret: bytes = attrs.field(repr=False)


def derive_key_material(secret: ClusterSecret, purpose: bytes) -> bytes:
    """32 bytes for `purpose`, from the cluster secret: HMAC-SHA256(secret, purpose)."""
    return hmac.new(secret.value, purpose, hashlib.sha256).digest()


def _keypair(material: bytes) -> CurveKeypair:
    secret_key = z85.encode(material)
    return CurveKeypair(public=zmq.curve_public(secret_key), secret=secret_key)


def server_keypair(secret: ClusterSecret) -> CurveKeypair:
    """The cluster's one server keypair (every control ROUTER)."""
    return _keypair(derive_key_material(secret, DERIVATION_VERSION + b"/server"))


def client_keypair(secret: ClusterSecret, label: PeerLabel) -> CurveKeypair:
    """The keypair of the instance rank `label` (every DEALER of that rank)."""
    purpose = DERIVATION_VERSION + b"/client/" + label.text.encode()
    return _keypair(derive_key_material(secret, purpose))
