"""Messenger over real sockets on 127.0.0.1, under trio (pytest-trio's trio_mode)."""

from __future__ import annotations

import contextlib

import attrs
import trio
import zmq

from tests.procs import free_port
from trtdisagg.transfer.protocol import wire
from trtdisagg.transfer.runtime.messenger import Router, open_dealer, open_router


async def _echo(router: Router, *, task_status: trio.TaskStatus[None]) -> None:
    task_status.started()
    while True:
        identity, message, _peer = await router.receive_message()
        router.send_message_nowait(identity, message)


def _cancel(key: int, name: str = "gen") -> wire.Cancel:
    return wire.Cancel(key=key, instance_name=name, instance_rank=0)


async def test_request_reply_with_several_dealers() -> None:
    async with open_router() as router, trio.open_nursery() as nursery:
        assert router.endpoint.startswith("tcp://127.0.0.1:")
        await nursery.start(_echo, router)

        async def client(name: str) -> None:
            async with open_dealer(router.endpoint) as dealer:
                for key in range(200):
                    await dealer.send_message(_cancel(key, name))
                    with trio.fail_after(10):
                        assert await dealer.receive_message() == _cancel(key, name)

        with trio.fail_after(60):
            async with trio.open_nursery() as clients:
                for i in range(4):
                    clients.start_soon(client, f"gen{i}")
        assert router.statistics().bad_frames == 0
        nursery.cancel_scope.cancel()


async def test_garbage_frames_are_counted_and_dropped() -> None:
    async with open_router() as router, trio.open_nursery() as nursery:
        await nursery.start(_echo, router)
        raw: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        try:
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(router.endpoint)
            raw.send_multipart([b"one", b"two"], flags=zmq.NOBLOCK)  # wrong frame count
            raw.send_multipart([b"\xc1 not msgpack"], flags=zmq.NOBLOCK)  # undecodable
            raw.send_multipart([wire.encode(_cancel(42))], flags=zmq.NOBLOCK)  # real
            with trio.fail_after(10):
                while not raw.poll(0):  # noqa: ASYNC110 (a raw zmq socket has no trio event)
                    await trio.sleep(0.005)
            assert wire.decode(raw.recv(flags=zmq.NOBLOCK)) == _cancel(42)
        finally:
            raw.close(linger=0)
        assert router.statistics().bad_frames == 2
        nursery.cancel_scope.cancel()


async def test_dealer_counts_garbage_from_its_router() -> None:
    raw: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        raw.setsockopt(zmq.LINGER, 0)
        port = raw.bind_to_random_port("tcp://127.0.0.1")
        async with open_dealer(f"tcp://127.0.0.1:{port}") as dealer:
            await dealer.send_message(_cancel(5))
            with trio.fail_after(10):
                while not raw.poll(0):  # noqa: ASYNC110 (a raw zmq socket has no trio event)
                    await trio.sleep(0.005)
            identity, payload = raw.recv_multipart(flags=zmq.NOBLOCK)
            assert wire.decode(payload) == _cancel(5)
            raw.send_multipart([identity, b"\x93garbage"], flags=zmq.NOBLOCK)
            raw.send_multipart([identity, wire.encode(_cancel(1))], flags=zmq.NOBLOCK)
            with trio.fail_after(10):
                assert await dealer.receive_message() == _cancel(1)
            assert dealer.statistics().bad_frames == 1
    finally:
        raw.close(linger=0)


async def test_an_unsecured_router_proves_nobody() -> None:
    async with open_router() as router, open_dealer(router.endpoint) as dealer:
        await dealer.send_message(_cancel(3))
        with trio.fail_after(10):
            _identity, message, peer = await router.receive_message()
        assert (message, peer) == (_cancel(3), None)


async def test_reply_to_a_gone_peer_is_unroutable() -> None:
    async with open_router() as router:
        router.send_message_nowait(b"nobody", _cancel(0))
        with trio.fail_after(10):
            while router.statistics().unroutable == 0:  # noqa: ASYNC110 (a counter)
                await trio.sleep(0.005)
        # and the router still serves
        async with open_dealer(router.endpoint) as dealer:
            await dealer.send_message(_cancel(1))
            with trio.fail_after(10):
                assert (await router.receive_message())[1] == _cancel(1)


async def test_backpressure_keeps_order_and_loses_nothing() -> None:
    count, padding = 3000, "x" * 4096
    async with (
        open_router(queue_size=8, high_water_mark=4) as router,
        open_dealer(router.endpoint, queue_size=8, high_water_mark=4) as dealer,
    ):

        async def produce() -> None:
            for i in range(count):
                await dealer.send_message(attrs.evolve(_cancel(i), reason=padding))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce)
                for i in range(count):
                    if i % 500 == 0:
                        await trio.sleep(0.05)  # a slow consumer: the inbox fills up
                    _, message, _ = await router.receive_message()
                    assert isinstance(message, wire.Cancel) and message.key == i


async def test_body_exception_is_not_wrapped() -> None:
    class Boom(Exception):
        pass

    try:
        async with open_router():
            raise Boom
    except Boom:
        pass


async def test_a_peer_that_never_reads_does_not_block_the_others() -> None:
    """ROUTER replies to a peer whose zmq queue is full are dropped and counted, not queued in
    front of every other peer's (a control-plane denial of service otherwise)."""
    async with open_router(high_water_mark=50) as router, trio.open_nursery() as nursery:
        await nursery.start(_echo, router)
        hog: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        try:
            hog.setsockopt(zmq.LINGER, 0)
            hog.setsockopt(zmq.RCVHWM, 50)
            hog.setsockopt(zmq.RCVBUF, 4096)
            hog.connect(router.endpoint)
            payload = wire.encode(_cancel(1, "hog" * 2000))  # ~6 kB: kernel buffers fill fast
            with trio.fail_after(20):
                for _ in range(3000):
                    while True:
                        try:
                            hog.send(payload, flags=zmq.NOBLOCK)
                            break
                        except zmq.Again:
                            await trio.sleep(0.001)  # the router drains its side
                while router.statistics().overflowed == 0:  # noqa: ASYNC110 (no event to wait on)
                    await trio.sleep(0.01)
            async with open_dealer(router.endpoint) as dealer:
                with trio.fail_after(5):
                    await dealer.send_message(_cancel(7, "polite"))
                    assert await dealer.receive_message() == _cancel(7, "polite")
        finally:
            hog.close(linger=0)
        assert router.statistics().overflowed > 0
        nursery.cancel_scope.cancel()


async def _serve(bind: str, stop: trio.Event, *, task_status: trio.TaskStatus[Router]) -> None:
    """A ROUTER bound at `bind` until `stop` (then its socket closes, as at a process's end)."""
    async with open_router(bind=bind) as router:
        task_status.started(router)
        await stop.wait()


class _Links:
    """What a dealer's `on_link` reported, in order."""

    def __init__(self) -> None:
        self.seen: list[bool] = []
        self._changed = trio.Event()

    def __call__(self, up: bool) -> None:
        self.seen.append(up)
        self._changed.set()
        self._changed = trio.Event()

    async def until(self, count: int) -> None:
        with trio.fail_after(10):
            while len(self.seen) < count:
                await self._changed.wait()


async def test_a_dealer_reports_its_link_going_down_and_up() -> None:
    """`on_link` says when the ROUTER's socket closes (its process ended) and when a ROUTER
    is back at that endpoint; zmq's reconnect attempts in between are no news."""
    links = _Links()
    on_link, until = links, links.until
    async with trio.open_nursery() as nursery:
        first, second = trio.Event(), trio.Event()
        router = await nursery.start(_serve, _unused_endpoint(), first)  # re-bound below
        async with open_dealer(router.endpoint, on_link=on_link) as dealer:
            await until(1)
            await dealer.send_message(_cancel(1))  # the link carries messages
            assert (await router.receive_message())[1] == _cancel(1)
            first.set()
            await until(2)
            await nursery.start(_serve, router.endpoint, second)  # back on the same port
            await until(3)
            second.set()
            await until(4)
    assert links.seen == [True, False, True, False]


def _unused_endpoint() -> str:
    """An endpoint nobody listens on. Below the ephemeral range: on an ephemeral port a connect
    to 127.0.0.1 can be given that same port as its own and connect to itself (or another
    process's client holds it), and the link comes up with no peer."""
    return f"tcp://127.0.0.1:{free_port()}"


async def test_a_dealer_whose_peer_never_listened_reports_its_link_down_once() -> None:
    """A peer that ended before we first connected to it: the connect is refused, and that is
    the only word of it (no connection ever drops). Said once, not at every retry; up once a
    ROUTER listens there."""
    endpoint = _unused_endpoint()
    links = _Links()
    async with trio.open_nursery() as nursery, open_dealer(endpoint, on_link=links):
        await links.until(1)
        assert links.seen == [False]
        with trio.move_on_after(0.5):  # zmq retries every 0.1 s: several refusals
            await links.until(2)
        assert links.seen == [False]
        stop = trio.Event()
        await nursery.start(_serve, endpoint, stop)
        await links.until(2)
        assert links.seen == [False, True]
        stop.set()


async def test_dealers_opened_as_others_close_all_watch_their_links() -> None:
    """Each dealer's link monitor has an endpoint of its own. pyzmq names one after the
    socket's descriptor, which a new socket reuses at once while zmq still holds the closed
    socket's monitor name: opening the dealer failed ("Address already in use"), and took the
    transceiver down with it. Here every name pyzmq could pick is taken on purpose."""
    async with open_router() as router:
        squatter = zmq.Context.instance().socket(zmq.PAIR)
        for fd in range(4096):
            squatter.bind(f"inproc://monitor.s-{fd}")
        try:
            for _ in range(5):
                links = _Links()
                async with open_dealer(router.endpoint, on_link=links):
                    await links.until(1)
                assert links.seen == [True]
        finally:
            squatter.close(linger=0)


async def test_dealers_to_a_dead_peer_closed_in_bulk_leave_the_process_s_sockets_working() -> None:
    """zmq sends a socket's link events from its I/O thread, and blocks there until they can go.
    A dealer to a peer that ended keeps retrying, and each retry is an event: one that came
    while the dealer closed, after its monitor's reader had closed, blocked the I/O thread for
    good, and every socket of the process stopped moving (a ctx dropping the dealers of gens
    that ended, then every transfer after timing out). Here batches of such dealers close
    while they retry, and a request still gets its answer after each batch."""
    dead = _unused_endpoint()
    async with open_router() as router, trio.open_nursery() as nursery:
        await nursery.start(_echo, router)
        async with open_dealer(router.endpoint) as probe:
            for batch in range(8):
                async with contextlib.AsyncExitStack() as stack:
                    links = [_Links() for _ in range(40)]
                    for on_link in links:
                        await stack.enter_async_context(open_dealer(dead, on_link=on_link))
                    for on_link in links:
                        await on_link.until(1)  # refused once: retrying from here on
                    await trio.sleep(0.15 + 0.02 * batch)  # (a retry every 0.1 s; not a sync)
                await probe.send_message(_cancel(batch))
                with trio.fail_after(5):
                    assert await probe.receive_message() == _cancel(batch)
        nursery.cancel_scope.cancel()
