"""The messenger with a cluster secret, over real sockets (tcp on 127.0.0.1) under Trio: members'
messages carry the label they proved; a stranger's handshake and an impostor's messages are
refused and counted, and reach nothing; a dealer with another secret sees its link down.

Each test has its own zmq context, and runs its own ZAP task in it (one per context).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import trio
import zmq

from trtdisagg.security.keys import PeerLabel, client_keypair, server_keypair
from trtdisagg.security.secret import ClusterSecret
from trtdisagg.security.zap import serve_zap
from trtdisagg.transfer.protocol import wire
from trtdisagg.transfer.runtime.messenger import Router, open_dealer, open_router

SECRET = ClusterSecret.parse("messenger-test-cluster-secret")
OTHER = ClusterSecret.parse("another-cluster-s-secret-value")
GEN = PeerLabel(instance_name="gen-0123456789abcdef", instance_rank=0)

_Context = zmq.Context[zmq.Socket[bytes]]


def _cancel(key: int, name: str = GEN.instance_name) -> wire.Cancel:
    return wire.Cancel(key=key, instance_name=name, instance_rank=0)


@contextmanager
def zmq_context() -> Iterator[_Context]:
    context: _Context = zmq.Context()
    try:
        yield context
    finally:
        context.term()


@asynccontextmanager
async def secured_router(context: _Context) -> AsyncIterator[Router]:
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_zap, context)
        async with open_router(secret=SECRET, context=context) as router:
            yield router
        nursery.cancel_scope.cancel()


async def until(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():  # noqa: ASYNC110 (counters: no event to wait on)
            await trio.sleep(0.01)


async def test_a_member_s_messages_carry_the_label_it_proved() -> None:
    with zmq_context() as context:
        async with secured_router(context) as router:
            async with open_dealer(router.endpoint, secret=SECRET, label=GEN,
                                   context=context) as dealer:  # fmt: skip
                await dealer.send_message(_cancel(1))
                with trio.fail_after(10):
                    identity, message, peer = await router.receive_message()
                assert (message, peer) == (_cancel(1), GEN)
                router.send_message_nowait(identity, _cancel(2, "ctx"))
                with trio.fail_after(10):
                    assert await dealer.receive_message() == _cancel(2, "ctx")
            assert router.statistics().refused == 0


async def test_strangers_and_impostors_reach_nothing_and_are_counted() -> None:
    """A plain (NULL) dealer and one of another cluster never finish a handshake: their
    connections are refused and counted, and the latter's link reports down (logged once). A
    client that knows the server's public key but holds no member's key finishes it, and each of
    its messages is refused and counted; none of them is delivered."""
    links: list[bool] = []
    with zmq_context() as context:
        async with secured_router(context) as router:
            async with (
                open_dealer(router.endpoint, context=context) as plain,
                open_dealer(router.endpoint, secret=OTHER, label=GEN, context=context,
                            on_link=links.append) as other,
            ):  # fmt: skip
                for key in range(3):
                    await plain.send_message(_cancel(key))
                    await other.send_message(_cancel(key))
                await until(lambda: router.statistics().handshakes_refused >= 2 and links)
                assert links == [False]
            impostor = context.socket(zmq.DEALER)
            try:
                impostor.setsockopt(zmq.LINGER, 0)
                impostor.setsockopt(zmq.CURVE_SERVERKEY, server_keypair(SECRET).public)
                public, secret_key = zmq.curve_keypair()
                impostor.setsockopt(zmq.CURVE_PUBLICKEY, public)
                impostor.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
                impostor.setsockopt(zmq.METADATA, f"X-Label:{GEN.text}".encode())
                impostor.connect(router.endpoint)
                for key in range(5):
                    impostor.send(wire.encode(_cancel(key)))
                await until(lambda: router.statistics().refused == 5)
            finally:
                impostor.close(linger=0)
            # A member still gets through, and is the first message the router delivers.
            async with open_dealer(router.endpoint, secret=SECRET, label=GEN,
                                   context=context) as member:  # fmt: skip
                await member.send_message(_cancel(99))
                with trio.fail_after(10):
                    _identity, message, peer = await router.receive_message()
            assert (message, peer) == (_cancel(99), GEN)
            stats = router.statistics()
            assert (stats.refused, stats.bad_frames) == (5, 0)


async def test_a_key_that_matches_another_label_is_refused() -> None:
    """A member's key does not make it another member: the label must match the key."""
    with zmq_context() as context:
        async with secured_router(context) as router:
            liar = context.socket(zmq.DEALER)
            try:
                keys = client_keypair(SECRET, GEN)
                liar.setsockopt(zmq.LINGER, 0)
                liar.setsockopt(zmq.CURVE_SERVERKEY, server_keypair(SECRET).public)
                liar.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
                liar.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
                liar.setsockopt(zmq.METADATA, b"X-Label:ctx-fedcba9876543210#0")
                liar.connect(router.endpoint)
                liar.send(wire.encode(_cancel(1)))
                await until(lambda: router.statistics().refused == 1)
            finally:
                liar.close(linger=0)
            assert router.inbox.statistics().current_buffer_used == 0  # nothing delivered
