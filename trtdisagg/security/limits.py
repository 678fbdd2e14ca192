"""How large a control-plane message may be (`ZMQ_MAXMSGSIZE`), and why. Pure.

Every control socket (ROUTER and DEALER, with or without CURVE) sets `ZMQ_MAXMSGSIZE` to
`MAX_CONTROL_FRAME_BYTES`. libzmq checks a frame's declared size against it before reading the
frame, and a frame over it closes that connection: nothing is buffered, and a DEALER reconnects
by itself (its later messages go through). The check applies during the handshake too, to peers
that never authenticate: without it, one TCP peer that declares a 1 GiB handshake frame makes
libzmq buffer whatever it streams. So the cap bounds what any one connection can make the
process hold, and `HANDSHAKE_TIMEOUT_MS` bounds how long a connection that has not completed
its handshake can hold it.

Under CURVE the cap applies to the encrypted frame, `CURVE_FRAME_OVERHEAD` bytes longer than
the message ("\\x07MESSAGE", an 8-byte nonce, a flags byte and a 16-byte MAC).

The largest legitimate message is INSTANCE_INFO (ctx rank 0 to gen: every rank's RankInfo).
Sized for the largest supported instance:

* `MAX_INSTANCE_RANKS` ranks (TP x PP),
* `MAX_LOCAL_LAYERS` layers held by one rank (the page table has two entries per layer),
* `MAX_AGENT_METADATA_BYTES` of transfer-agent metadata per rank (NIXL's UCX metadata is well
  under 2 KiB per rank with one pool on a CPU host; GPU hosts with several NICs add to it),
* endpoints and names at their longest, every integer at its widest msgpack form.

At those bounds INSTANCE_INFO encodes to 5.45 MiB (tests/unit/test_security_limits.py builds it
with the real encoder). `MAX_CONTROL_PAYLOAD_BYTES` is 8 MiB: that plus a margin of about half.
The other messages are far smaller: REGISTER_PEER is one RankInfo (under 90 KiB at the bounds);
REQUEST_DATA's block ids take 8 bytes per block, so 8 MiB is a million blocks.

A worker whose own INSTANCE_INFO would not fit must refuse to start (`check_fits`) rather than
have every gen's connection dropped by libzmq without a word.
"""

from __future__ import annotations

from typing import Final

MAX_INSTANCE_RANKS: Final = 64
MAX_LOCAL_LAYERS: Final = 256
MAX_AGENT_METADATA_BYTES: Final = 64 * 1024

MAX_CONTROL_PAYLOAD_BYTES: Final = 8 * 2**20
CURVE_FRAME_OVERHEAD: Final = 33
MAX_CONTROL_FRAME_BYTES: Final = MAX_CONTROL_PAYLOAD_BYTES + CURVE_FRAME_OVERHEAD

# A connection must finish its handshake (CURVE and the ZAP check) within this, or libzmq
# closes it and frees what it buffered. A member's handshake needs one round trip and one
# answer from the ZAP task.
HANDSHAKE_TIMEOUT_MS: Final = 10_000


class MessageTooLarge(ValueError):
    """A control message this process would send exceeds MAX_CONTROL_PAYLOAD_BYTES."""


def check_fits(payload_bytes: int, what: str) -> None:
    """Raise MessageTooLarge, naming `what` and both sizes, unless a message of
    `payload_bytes` fits under the cap (peers would drop the connection that carried it)."""
    if payload_bytes > MAX_CONTROL_PAYLOAD_BYTES:
        raise MessageTooLarge(
            f"{what} is {payload_bytes} bytes, over the control plane's limit of"
            f" {MAX_CONTROL_PAYLOAD_BYTES} (an instance of at most {MAX_INSTANCE_RANKS} ranks,"
            f" {MAX_LOCAL_LAYERS} layers per rank and {MAX_AGENT_METADATA_BYTES} bytes of agent"
            " metadata per rank fits)"
        )
