"""Round-trip time of one small message through our Trio messenger, against blocking pyzmq.

Both in one process on 127.0.0.1: a DEALER sends about 100 bytes, a ROUTER echoes them. The Trio
path is `open_router`/`open_dealer` (pumps, codec, inbox, scheduling rounds); the baseline is plain
blocking pyzmq with the echo on a thread. The difference is what our loop adds per hop.

    python tools/bench_messenger.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import trio
import zmq

from trtdisagg.transfer.protocol.wire import Cancel
from trtdisagg.transfer.runtime.messenger import open_dealer, open_router

PAYLOAD = b"x" * 100
MESSAGE = Cancel(key=1, instance_name="gen", instance_rank=0, reason="x" * 50)  # ~100 bytes


async def _trio_rtts(rounds: int) -> list[float]:
    async with open_router() as router, open_dealer(router.endpoint) as dealer:

        async def echo() -> None:
            while True:
                identity, message, _ = await router.receive_message()
                router.send_message_nowait(identity, message)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(echo)
            rtts = []
            for _ in range(rounds):
                start = time.perf_counter()
                await dealer.send_message(MESSAGE)
                await dealer.receive_message()
                rtts.append(time.perf_counter() - start)
            nursery.cancel_scope.cancel()
    return rtts


def _zmq_rtts(rounds: int) -> list[float]:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")

    def echo() -> None:
        for _ in range(rounds):
            router.send_multipart(router.recv_multipart())

    thread = threading.Thread(target=echo)
    thread.start()
    rtts = []
    for _ in range(rounds):
        start = time.perf_counter()
        dealer.send(PAYLOAD)
        dealer.recv()
        rtts.append(time.perf_counter() - start)
    thread.join()
    dealer.close(linger=0)
    router.close(linger=0)
    context.term()
    return rtts


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    ours = statistics.median(trio.run(_trio_rtts, args.rounds)) * 1e6
    plain = statistics.median(_zmq_rtts(args.rounds)) * 1e6
    print(f"trio messenger rtt p50 {ours:.1f} us; blocking pyzmq rtt p50 {plain:.1f} us")
    print(f"ratio_vs_pyzmq={ours / plain:.2f}")


if __name__ == "__main__":
    main()
