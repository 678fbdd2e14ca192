"""An authenticated, encrypted control plane: ZeroMQ CURVE keyed by one cluster secret.

Modules (import each directly; this package imports nothing):

* `secret`   ◆ the cluster secret: rules, resolution from config and environment
* `policy`   ◆ CURVE, unsecured loopback, or refuse to start
* `limits`   ◆ `ZMQ_MAXMSGSIZE` and the handshake timeout, with their derivation
* `keys`       key derivation (HMAC-SHA256 of the secret), `PeerLabel`
* `verify`     a connection's label, checked against the key it authenticated with
* `sockets`    socket options for a CURVE server / client / unsecured socket; frame claims
* `zap`        the ZAP handler, a Trio task (`serve_zap`)

(◆: pure, no zmq/trio.) `trtdisagg/ratelimit.py` bounds the warnings about refused peers.

Keys. Every process of a cluster holds the same secret. From it each derives, with
HMAC-SHA256 and nothing else by hand, the one server keypair that every control ROUTER uses, and
one client keypair per instance rank, keyed by that rank's label "<instance_name>#<rank>", that
its DEALERs use. A client knows only an endpoint when it dials, and derives the server's public
key from the secret.

Identity. A peer's identity comes from the handshake, never from a message body. The ZAP task
sets each connection's User-Id to the public key its client proved it holds; the client also
sends its label as connection metadata. A ROUTER accepts a message only when the label's derived
public key equals the User-Id (`verify.py`), and then the label, not any name written in the
message, is the sender. A DEALER's peer is whoever holds the server key at the endpoint it
dialled: a member of the cluster.

What an attacker on the host or network, without the secret, can and cannot do:

* It cannot finish a handshake: it cannot derive the server key, so libzmq drops the connection
  before any message is read, and it never gets an answer (no INSTANCE_INFO, so no agent
  metadata and no pool address), nor sends a request, cancel or result. Traffic it captures is
  encrypted, and replaying it fails (CURVE's per-connection keys).
* A client that knows the server's public key but not the secret completes the handshake, but
  no label matches its key: its messages are dropped and counted.
* It can still open TCP connections to the control port. Each can make the process buffer at
  most one frame of `limits.MAX_CONTROL_FRAME_BYTES` for at most `limits.HANDSHAKE_TIMEOUT_MS`;
  libzmq does not cap the number of connections. It can also see traffic sizes and timing.

A holder of the secret is a member, trusted in full: it can derive any rank's key and claim any
label. Keep the secret out of world-readable files. A process running as the workers' own user
can read their environment and memory anyway (`/proc/PID/environ`, `/proc/PID/mem`, ptrace): run
workers under a user of their own.

NIXL. The agent metadata (its UCX worker address and the remote keys of the registered pools)
and the pools' addresses travel only inside INSTANCE_INFO and REGISTER_PEER, so only to verified
members. UCX itself still authenticates nobody: its listeners (tcp on each device it uses, the
host's shared-memory transports) accept any peer, and registered memory is guarded only by
knowing its address and remote key. KV bytes cross the data-plane network unencrypted, and an
RDMA write carries its remote key in the clear, so whoever can watch that network can read KV and
learn keys: keep the data plane on a trusted network (or on loopback: `confine_ucx_to_loopback`).
"""
