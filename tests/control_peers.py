"""Peers of a secured control plane, played by a test: strangers (no secret, another secret, a
random key that claims a member's label) and members of the cluster (its secret, a label of
their own), each a plain blocking zmq DEALER. A member can also be a gen instance of its own
(`Intruder`): a NIXL agent and a pool in this process, registered with a ctx like any gen.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Iterator, Sequence

import attrs
import torch
import zmq

from trtdisagg.security.keys import LABEL_PROPERTY, PeerLabel, server_keypair
from trtdisagg.security.secret import ClusterSecret
from trtdisagg.security.sockets import configure_curve_client
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.wire import (
    PROTOCOL_VERSION,
    InstanceInfo,
    Message,
    RegisterAck,
    RegisterPeer,
    RequestInstanceInfo,
    decode,
    encode,
)
from trtdisagg.transfer.runtime.agents.base import pool_regions
from trtdisagg.transfer.runtime.agents.nixl import NixlAgent

SECRET_TEXT = "e2e-cluster-secret-" + "0123456789abcdef"
SECRET = ClusterSecret.parse(SECRET_TEXT)
OTHER_SECRET = ClusterSecret.parse("another-cluster-" + "fedcba9876543210")


class Stranger(enum.Enum):
    PLAIN = "no CURVE at all"
    OTHER_CLUSTER = "CURVE with another cluster's secret"
    IMPOSTOR = "the server's public key, a random key, a member's label"


@contextlib.contextmanager
def dealer(endpoint: str, *, receive_timeout_ms: int = 10_000) -> Iterator[zmq.Socket[bytes]]:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, receive_timeout_ms)
    try:
        yield socket
    finally:
        socket.close(linger=0)


@contextlib.contextmanager
def member(endpoint: str, label: PeerLabel) -> Iterator[zmq.Socket[bytes]]:
    """A DEALER of the cluster, speaking for `label`."""
    with dealer(endpoint) as socket:
        configure_curve_client(socket, SECRET, label)
        socket.connect(endpoint)
        yield socket


@contextlib.contextmanager
def stranger(endpoint: str, kind: Stranger, claims: PeerLabel) -> Iterator[zmq.Socket[bytes]]:
    with dealer(endpoint) as socket:
        if kind is Stranger.OTHER_CLUSTER:
            configure_curve_client(socket, OTHER_SECRET, claims)
        elif kind is Stranger.IMPOSTOR:
            public, secret = zmq.curve_keypair()
            socket.setsockopt(zmq.CURVE_SERVERKEY, server_keypair(SECRET).public)
            socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
            socket.setsockopt(zmq.CURVE_SECRETKEY, secret)
            socket.setsockopt(zmq.METADATA, f"{LABEL_PROPERTY}:{claims.text}".encode())
        socket.connect(endpoint)
        yield socket


def offer(socket: zmq.Socket[bytes], kind: Stranger, message: Message) -> None:
    """Send as a stranger of `kind`. A refused handshake can leave the DEALER no pipe to queue on,
    and a send would then block for good: what cannot be queued is not sent, and that is the
    point. The impostor finishes its handshake, so its sends always queue."""
    flags = 0 if kind is Stranger.IMPOSTOR else zmq.NOBLOCK
    with contextlib.suppress(zmq.Again):
        socket.send(encode(message), flags)


def ask(socket: zmq.Socket[bytes], message: Message) -> Message:
    socket.send(encode(message))
    return decode(socket.recv())


def answers(socket: zmq.Socket[bytes], within_ms: int) -> list[Message]:
    """Whatever comes back on `socket` within `within_ms` (a stranger must get nothing)."""
    got = []
    while socket.poll(within_ms):
        got.append(decode(socket.recv()))
        within_ms = 100
    return got


def answers_to_each(sockets: Sequence[zmq.Socket[bytes]], within_ms: int) -> list[list[Message]]:
    """Whatever comes back on each of `sockets` within one shared window of `within_ms`: the
    silence owed to several strangers is waited for once, not once per stranger."""
    poller = zmq.Poller()
    for socket in sockets:
        poller.register(socket, zmq.POLLIN)
    got: list[list[Message]] = [[] for _ in sockets]
    deadline = time.monotonic() + within_ms / 1000
    while (left_s := deadline - time.monotonic()) > 0:
        for ready, _ in poller.poll(left_s * 1000):
            index = next(i for i, socket in enumerate(sockets) if socket is ready)
            got[index].append(decode(ready.recv()))
    return got


def instance_info(endpoint: str, label: PeerLabel) -> tuple[RankInfo, ...]:
    """What a member learns from a worker's control port: every rank of its instance."""
    with member(endpoint, label) as socket:
        reply = ask(socket, RequestInstanceInfo(protocol_version=PROTOCOL_VERSION))
    assert isinstance(reply, InstanceInfo), reply
    return reply.ranks


@attrs.define(eq=False)
class Intruder:
    """A gen instance of the cluster that is not the one a request was sent to: a NIXL agent
    and a zeroed pool shaped as a real gen's, and a control ROUTER (a CURVE server of the
    cluster, without ZAP: it takes whoever holds the secret) where ctx's answers come."""

    label: PeerLabel
    info: RankInfo
    pool: torch.Tensor
    agent: NixlAgent
    inbox: zmq.Socket[bytes]

    @classmethod
    def like(cls, gen: RankInfo, name: str) -> Intruder:
        group = gen.page_table.layer_groups[0]
        pool = torch.zeros(group.pool.total_bytes, dtype=torch.uint8)
        label = PeerLabel(instance_name=name, instance_rank=0)
        agent = NixlAgent(label.text, progress_thread=False)
        moved = attrs.evolve(group.pool, base_address=pool.data_ptr())
        table = attrs.evolve(gen.page_table, layer_groups=(attrs.evolve(group, pool=moved),))
        agent.register_memory(pool_regions(table))
        inbox = zmq.Context.instance().socket(zmq.ROUTER)
        inbox.setsockopt(zmq.LINGER, 0)
        keys = server_keypair(SECRET)
        inbox.setsockopt(zmq.CURVE_SERVER, 1)
        inbox.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        inbox.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        inbox.bind("tcp://127.0.0.1:*")
        endpoint = inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        info = attrs.evolve(
            gen, instance_name=name, agent_name=label.text, page_table=table,
            agent_metadata=agent.local_metadata(), control_endpoint=endpoint,
        )  # fmt: skip
        return cls(label=label, info=info, pool=pool, agent=agent, inbox=inbox)

    def received(self, within_ms: int) -> list[Message]:
        """What ctx sent to this instance's control port within `within_ms`."""
        got = []
        while self.inbox.poll(within_ms):
            got.append(decode(self.inbox.recv_multipart()[-1]))
            within_ms = 100
        return got

    def register(self, socket: zmq.Socket[bytes]) -> None:
        """REGISTER_PEER on a member's DEALER to a ctx rank; ctx must accept it."""
        ack = ask(socket, RegisterPeer(info=self.info))
        assert isinstance(ack, RegisterAck) and ack.accepted, ack

    def close(self) -> None:
        self.inbox.close(linger=0)
        self.agent.close()
