"""Socket options of a control socket, secured or not, and what a received frame says about
its connection. The transfer layer's messenger calls these; nothing here waits or owns a task.

Call `configure_*` on a fresh socket, before it binds or connects: libzmq copies a socket's
security options into each listener and connection as it is made, so options set later do not
apply to them (a NULL client still got through a ROUTER made a CURVE server after its bind).
Each function checks that and raises ValueError otherwise.

* `configure_curve_server` (every control ROUTER, with a secret): CURVE server with the
  cluster's server keypair; ZAP domain `ZAP_DOMAIN` and ZAP enforcement on, so libzmq asks the
  ZAP task (`zap.py`) about every client and refuses all of them when no ZAP task is bound.
  Without enforcement libzmq skips ZAP when no handler is bound; with enforcement but an empty
  domain it skips ZAP even when one is. Either way it then admits every client that knows the
  server key, and the ROUTER reports as `User-Id` whatever the client put in its own handshake
  metadata (public keys are not secrets: that would let anyone pass as a member). The handshake
  must finish within `HANDSHAKE_TIMEOUT_MS`.
* `configure_curve_client` (every control DEALER, with a secret): CURVE client with its rank's
  keypair, the server's public key, and its label as the `X-Label` metadata.
* `configure_unsecured` (no secret, loopback only: `policy.py`): neither.
All three set `ZMQ_MAXMSGSIZE` (`limits.py`).

`connection_claims(frame)` reads `User-Id`, `X-Label` and `Peer-Address` off a frame received
with `recv_multipart(copy=False)` (a copied frame has lost them); every frame of a message
carries its connection's properties. A property the connection lacks is None, and so is one
pyzmq cannot decode as UTF-8 (a peer's own metadata may be any bytes; reading it raised
UnicodeDecodeError). libzmq returns a property up to its first NUL byte.
"""

from __future__ import annotations

from typing import Final

import zmq

from trtdisagg.security.keys import LABEL_PROPERTY, PeerLabel, client_keypair, server_keypair
from trtdisagg.security.limits import HANDSHAKE_TIMEOUT_MS, MAX_CONTROL_FRAME_BYTES
from trtdisagg.security.secret import ClusterSecret
from trtdisagg.security.verify import ConnectionClaims

ZAP_DOMAIN: Final = b"trtdisagg-control"

_Socket = zmq.Socket[bytes]


def configure_curve_server(socket: _Socket, secret: ClusterSecret) -> None:
    """Make `socket` (a ROUTER, not yet bound) a CURVE server that only ZAP-approved clients
    can reach."""
    _check_fresh(socket)
    keys = server_keypair(secret)
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    socket.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_FRAME_BYTES)


def configure_curve_client(socket: _Socket, secret: ClusterSecret, label: PeerLabel) -> None:
    """Make `socket` (a DEALER, not yet connected) a CURVE client speaking for `label`."""
    _check_fresh(socket)
    server = server_keypair(secret)
    keys = client_keypair(secret, label)
    socket.setsockopt(zmq.CURVE_SERVERKEY, server.public)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    socket.setsockopt(zmq.METADATA, f"{LABEL_PROPERTY}:{label.text}".encode())
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_FRAME_BYTES)


def configure_unsecured(socket: _Socket) -> None:
    """Only the size cap: the no-secret, loopback-only control plane."""
    _check_fresh(socket)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_FRAME_BYTES)


def _check_fresh(socket: _Socket) -> None:
    endpoint = socket.getsockopt(zmq.LAST_ENDPOINT)
    if endpoint:
        raise ValueError(
            f"socket already bound or connected ({endpoint!r}): security options set now would"
            " not apply to it"
        )


def connection_claims(frame: zmq.Frame) -> ConnectionClaims:
    """The claims of the connection `frame` came on (a frame from `recv*(copy=False)`)."""
    return ConnectionClaims(
        user_id=_property(frame, "User-Id"),
        label=_property(frame, LABEL_PROPERTY),
        address=_property(frame, "Peer-Address"),
    )


def _property(frame: zmq.Frame, name: str) -> str | None:
    try:
        value = frame.get(name)
    except zmq.ZMQError:  # EINVAL: the connection has no such property
        return None
    except UnicodeDecodeError:  # pyzmq decodes as UTF-8 a value the peer chose
        return None
    return value if isinstance(value, str) else None
