"""One control message between two processes: a ZMQ DEALER -> ROUTER frame against a NIXL
notification (`send_notif`), the receiver spinning on both.

Why: what a control message would gain over a NIXL notification (REQUEST_DATA goes over ZMQ
only). The sender is this process, the receiver a `spawn`ed child that polls its ROUTER
(non-blocking) and its agent's notifications in one tight loop, so neither path waits on a
sleeping receiver. The two kinds alternate, one
message at a time after `--idle-ms` of quiet (as between a ctx's response and gen's request:
ZMQ's I/O threads have gone to sleep by then, and waking them is most of a ZMQ hop), each
carrying its send time (CLOCK_MONOTONIC, one host); the child records when it read it.
Printed: p50 and p90 of the one-way time of each kind, and of the sender's call. The last line
is `notif_vs_zmq_p50=<NIXL p50 / ZMQ p50>`.

    python tools/bench_control_hop.py                        # 300 messages, progress threads on
    python tools/bench_control_hop.py --nixl-progress-thread off
    python tools/bench_control_hop.py --idle-ms 0            # back to back: I/O threads awake
    python tools/bench_control_hop.py --payload-bytes 8300   # REQUEST_DATA of 1024 blocks

Without NIXL's progress thread the sender progresses its own worker between messages (so a
queued notification goes out), as the transceiver's polling does.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

from _bench_common import percentile


def _sent_at(payload: bytes) -> float:
    """The send time a message starts with (`_message`)."""
    return float(payload.split(b" ", 1)[0])


def _message(sent: float, payload_bytes: int) -> bytes:
    """The send time, padded to `payload_bytes` (a REQUEST_DATA of a long prompt carries 8
    bytes per block id)."""
    stamp = repr(sent).encode() + b" "
    return stamp + b"x" * max(0, payload_bytes - len(stamp))


def _receiver(conn: Connection, count: int, progress_thread: bool) -> None:
    import zmq
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("hop-rx", nixl_agent_config(enable_prog_thread=progress_thread))
    router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    conn.send((agent.get_agent_metadata(), port))
    agent.add_remote_agent(conn.recv())
    seen: list[tuple[str, float, float]] = []
    for _ in range(count):
        conn.send("armed")
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
                seen.append(("zmq", _sent_at(frames[-1]), time.monotonic()))
                break
            except zmq.Again:
                pass
            notifs = agent.get_new_notifs()
            if notifs:
                (payload,) = [p for payloads in notifs.values() for p in payloads]
                seen.append(("nixl", _sent_at(payload), time.monotonic()))
                break
    conn.send(seen)


def measure(
    count: int, warmup: int, progress_thread: bool, idle_s: float, payload_bytes: int = 0
) -> dict[str, list[float]]:
    import zmq
    from nixl._api import nixl_agent, nixl_agent_config

    parent, child = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(
        target=_receiver, args=(child, warmup + count, progress_thread)
    )
    process.start()
    try:
        metadata, port = parent.recv()
        agent = nixl_agent("hop-tx", nixl_agent_config(enable_prog_thread=progress_thread))
        parent.send(agent.get_agent_metadata())
        raw = agent.add_remote_agent(metadata)
        remote = raw.decode() if isinstance(raw, bytes) else raw
        agent.make_connection(remote)
        dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        calls: dict[str, list[float]] = {"zmq": [], "nixl": []}
        for i in range(warmup + count):
            while not parent.poll(0):  # the receiver is ready for the next one
                if not progress_thread:
                    agent.get_new_notifs()  # progress our worker: a queued message goes out
            parent.recv()
            time.sleep(idle_s)  # quiet, as between two requests (`--idle-ms`)
            kind = "nixl" if i % 2 else "zmq"
            sent = time.monotonic()
            message = _message(sent, payload_bytes)
            if kind == "zmq":
                dealer.send(message)
            else:
                agent.send_notif(remote, message)
            if i >= warmup:
                calls[kind].append(time.monotonic() - sent)
        while not parent.poll(0):
            if not progress_thread:
                agent.get_new_notifs()
        seen = parent.recv()
        process.join(30)
    finally:
        if process.is_alive():
            process.kill()
            process.join(10)
    hops: dict[str, list[float]] = {"zmq": [], "nixl": []}
    for kind, sent, read in seen[warmup:]:
        hops[kind].append(read - sent)
    return {"zmq hop": hops["zmq"], "nixl hop": hops["nixl"],
            "zmq send call": calls["zmq"], "nixl send call": calls["nixl"]}  # fmt: skip


def report(times: dict[str, list[float]]) -> str:
    lines = ["bench_control_hop: one-way time, receiver spinning on both"]
    for name, seconds in times.items():
        lines.append(
            f"  {name:16s} p50 {percentile(seconds, 50) * 1e6:7.1f} us   "
            f"p90 {percentile(seconds, 90) * 1e6:7.1f} us   n={len(seconds)}"
        )
    ratio = percentile(times["nixl hop"], 50) / percentile(times["zmq hop"], 50)
    lines.append(f"notif_vs_zmq_p50={ratio:.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=300, help="measured, half of each kind")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--nixl-progress-thread", choices=("on", "off"), default="on")
    parser.add_argument("--idle-ms", type=float, default=2.0, help="quiet before each message")
    parser.add_argument(
        "--payload-bytes", type=int, default=0, help="pad each message to this size"
    )
    args = parser.parse_args(argv)
    if args.messages < 2 or args.warmup < 0 or args.idle_ms < 0 or args.payload_bytes < 0:
        parser.error("--messages must be >= 2, --warmup, --idle-ms and --payload-bytes >= 0")
    on = args.nixl_progress_thread == "on"
    idle_s = args.idle_ms / 1000
    print(report(measure(args.messages, args.warmup, on, idle_s, args.payload_bytes)))


if __name__ == "__main__":
    main()
