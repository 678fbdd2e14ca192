"""When does a NIXL write's notification reach its target? A raw probe, no transceiver.

Why: the transceiver tells gen that its KV landed through the write's own notification. NIXL's
UCX backend sends that notification from the initiator's first `check_xfer_state` that finds
the write done (for a write still in flight when posted, as every GPU write is), not when the
bytes land. So ctx's polling, not the copy, decides when gen hears of a write, and
`CtxWrites.nudge` polls young writes before control leaves the transceiver.

Two `spawn`ed processes on one GPU (or two: `--gen-gpu`). ctx prepares one VRAM -> VRAM write of
each size, posts it, and then, by mode:
- `spin`: polls in a tight loop;
- `sleep20`: polls with `time.sleep(20e-6)` between polls (as bench_transfer's raw path);
- `late600`: busy-waits 0.6 ms without polling, then polls;
- `cold10ms`: sleeps 10 ms before the post (the CPU idles, as ctx's loop does during a
  prefill step), then polls in a tight loop.
gen polls `get_new_notifs` in a tight loop. Both stamp CLOCK_MONOTONIC; printed per size and
mode, the p50 of: the post call, the poll that saw DONE, and gen seeing the notification,
each after the post started. With `late600`, the notification arrives ~0.6 ms after the post
whatever the size: it waited for the poll.

    python tools/probe_notify_on_poll.py                 # cuda:0 -> cuda:0, 30 iterations
    python tools/probe_notify_on_poll.py --gen-gpu 1 --progress-thread off
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

from _bench_common import percentile

MODES = ("spin", "sleep20", "late600", "cold10ms")
SIZES_MIB = (128, 256, 1024)
WARMUP = 3


def _config(progress_thread: bool) -> Any:
    from nixl._api import nixl_agent_config

    return nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])


def _gen(conn: Connection, num_bytes: int, gpu: int, progress_thread: bool) -> None:
    import torch
    from nixl._api import nixl_agent

    buffer = torch.empty(num_bytes, dtype=torch.uint8, device=f"cuda:{gpu}")
    agent = nixl_agent("probe-gen", _config(progress_thread))
    agent.register_memory([(buffer.data_ptr(), num_bytes, gpu, "")], "VRAM")
    conn.send((agent.get_agent_metadata(), buffer.data_ptr()))
    agent.add_remote_agent(conn.recv())
    while conn.recv() == "arm":
        conn.send("armed")
        while not agent.get_new_notifs():
            pass
        conn.send(time.monotonic())


def _busy_until(deadline: float) -> None:
    while time.monotonic() < deadline:
        pass


def measure(iterations: int, gen_gpu: int, progress_thread: bool) -> dict[str, dict[str, float]]:
    """p50 (µs after the post started) of post return, DONE seen and notification seen."""
    import torch
    from nixl._api import nixl_agent

    num_bytes = max(SIZES_MIB) << 20
    context = mp.get_context("spawn")
    conn, child_conn = context.Pipe()
    child = context.Process(target=_gen, args=(child_conn, num_bytes, gen_gpu, progress_thread))
    child.start()
    source = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    agent = nixl_agent("probe-ctx", _config(progress_thread))
    agent.register_memory([(source.data_ptr(), num_bytes, 0, "")], "VRAM")
    metadata, target = conn.recv()
    raw_name = agent.add_remote_agent(metadata)
    remote = raw_name.decode() if isinstance(raw_name, bytes) else raw_name
    conn.send(agent.get_agent_metadata())
    out: dict[str, dict[str, float]] = {}
    try:
        for size_mib in SIZES_MIB:
            size = size_mib << 20
            rows: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in MODES}
            for iteration in range(WARMUP + iterations):
                for mode in MODES:
                    local = agent.get_xfer_descs([(source.data_ptr(), size, 0)], "VRAM")
                    far = agent.get_xfer_descs([(target, size, gen_gpu)], "VRAM")
                    handle = agent.initialize_xfer("WRITE", local, far, remote, b"probe")
                    conn.send("arm")
                    if conn.recv() != "armed":
                        raise RuntimeError("gen did not arm")
                    if mode == "cold10ms":
                        time.sleep(0.01)
                    else:
                        _busy_until(time.monotonic() + 0.002)
                    start = time.monotonic()
                    agent.transfer(handle)
                    posted = time.monotonic()
                    if mode == "late600":
                        _busy_until(start + 0.0006)
                    while (state := agent.check_xfer_state(handle)) == "PROC":
                        if mode == "sleep20":
                            time.sleep(20e-6)
                    done = time.monotonic()
                    if state != "DONE":
                        raise RuntimeError(f"write ended {state}")
                    seen = conn.recv()
                    agent.release_xfer_handle(handle)
                    if iteration >= WARMUP:
                        rows[mode].append((posted - start, done - start, seen - start))
            for mode, samples in rows.items():
                out[f"{size_mib} MiB {mode}"] = {
                    name: percentile([sample[i] for sample in samples], 50) * 1e6
                    for i, name in enumerate(("post_us", "done_us", "notified_us"))
                }
    finally:
        conn.send("stop")
        child.join(timeout=30)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--gen-gpu", type=int, default=0)
    parser.add_argument("--progress-thread", choices=("on", "off"), default="on")
    args = parser.parse_args()
    results = measure(args.iterations, args.gen_gpu, args.progress_thread == "on")
    print(f"cuda:0 -> cuda:{args.gen_gpu}, progress thread {args.progress_thread}, p50 in µs")
    print(f"{'case':<20} {'post':>8} {'DONE':>8} {'notified':>9}")
    for case, row in results.items():
        print(f"{case:<20} {row['post_us']:8.0f} {row['done_us']:8.0f} {row['notified_us']:9.0f}")


if __name__ == "__main__":
    main()
