"""KV transfer between two hosts (network namespaces) over TCP: real workers against raw NIXL.

    sudo env PYTHONPATH=$PWD .venv/bin/python tools/bench_netns_transfer.py [--tokens 1024,8192]

Needs root (it makes two network namespaces on a bridge, tests/netns.py, and removes them).
In one run, on the same two namespaces, with UCX on TCP (``UCX_TLS=tcp``, as between hosts):

  workers   a ctx and a gen worker (real processes, HTTP, ZMQ, NIXL), one per namespace, on a
            tiny-compute, KV-heavy model (`MODEL`: 16 KiB of KV per token, so 1k tokens move
            16 MiB and 8k 128 MiB). Per sample: ``context_only`` on ctx (the prompt is in ctx's
            prefix cache after the first one, so prefill is short), then ``generation_only`` on
            gen with ``return_perf_metrics``: gen's ``kv_transfer_s`` is its transceiver's time
            from asking ctx for the KV to the outcome (REQUEST_DATA, the write, the result and
            the notification), and ``kv_transfer_bytes`` what moved. gen keeps no prefix cache,
            so every sample moves the whole prompt's KV.
  raw NIXL  two processes (this script, ``--raw-peer``) in the same namespaces with one NIXL
            agent each and a registered buffer, doing the same transfer with nothing but NIXL:
            gen asks ctx for the bytes (a NIXL notification, as gen's REQUEST_DATA asks), ctx
            builds ONE descriptor of that byte count and posts it with a notification, and gen
            polls ``get_new_notifs`` until it comes (both poll every ``--raw-poll-us``; 0
            spins). Timed on gen from just before the ask to the notification seen, the span
            ``kv_transfer_s`` covers; ``raw_write_s`` in the JSON is ctx's post to that
            notification (the write alone, on the one CLOCK_MONOTONIC both namespaces share).

The samples alternate (which path goes first flips each time) after two warm-ups of each.
Printed: per prompt size, the median time and rate of each path, ``raw / workers`` (1.0: the
workers add nothing to a bare NIXL write; the target is 0.8 or more), and the NIXL descriptors
ctx posted per workers' transfer (from its ``trtdisagg_kv_transfer_descriptors_total``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Final

import httpx
import yaml

REPO = Path(__file__).resolve().parent.parent
UCX_ENV: Final = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
PORT: Final = 8001
# Wide KV, little compute: 8 layers x 8 kv heads x 32 dims x (K, V) x 4 bytes = 16 KiB a token.
MODEL: Final = {
    "num_layers": 8, "hidden_size": 256, "num_heads": 8, "num_kv_heads": 8,
    "intermediate_size": 512, "max_position_embeddings": 16384,
}  # fmt: skip


# ---- the raw NIXL peer (runs inside a namespace) ----


def raw_peer(side: str, size: int) -> None:
    """One NIXL agent and a registered buffer of `size` bytes, driven by JSON lines on stdin."""
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"raw-{side}", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    buffer = np.full(size, 7 if side == "ctx" else 0, dtype=np.uint8)
    address = buffer.ctypes.data
    agent.register_memory([(address, size, 0, "")], "DRAM")
    _say({"metadata": base64.b64encode(agent.get_agent_metadata()).decode(), "address": address})
    remote = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "peer":
            raw = agent.add_remote_agent(base64.b64decode(cmd["metadata"]))
            remote = raw.decode() if isinstance(raw, bytes) else raw
            remote_address = int(cmd["address"])
            _say({"ok": True})
        elif cmd["op"] == "serve":  # ctx: wait for gen's ask, then write what it asks for
            _say({"serving": True})
            pause = float(cmd["poll_s"])
            ask = _next_notif(agent, b"ask ", pause)
            _, notif, n = ask.decode().split()
            local = np.array([[address, int(n), 0]], dtype=np.uint64)
            target = np.array([[remote_address, int(n), 0]], dtype=np.uint64)
            handle = agent.initialize_xfer(
                "WRITE", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(target, "DRAM"),
                remote, notif.encode(),
            )  # fmt: skip
            posted = time.monotonic()
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                if pause:
                    time.sleep(pause)
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            _say({"posted": posted, "state": state})
        elif cmd["op"] == "fetch":  # gen: ask ctx for `bytes`, spin until their notification
            assert remote is not None
            asked = time.monotonic()
            agent.send_notif(remote, f"ask {cmd['notif']} {int(cmd['bytes'])}".encode())
            _next_notif(agent, cmd["notif"].encode(), float(cmd["poll_s"]))
            _say({"asked": asked, "seen": time.monotonic()})
        elif cmd["op"] == "check":  # gen: the bytes that landed are ctx's
            landed = int(cmd["bytes"])
            _say({"ok": bool((buffer[:landed] == 7).all())})
        elif cmd["op"] == "stop":
            return


def _next_notif(agent: Any, prefix: bytes, pause: float) -> bytes:
    """Poll `agent` until a notification that starts with `prefix` comes (every `pause` s)."""
    while True:
        for payloads in agent.get_new_notifs().values():
            for payload in payloads:
                if payload.startswith(prefix):
                    return bytes(payload)
        if pause:
            time.sleep(pause)


MARK: Final = "@bench "  # NIXL logs to stdout too: our lines are the marked ones


def _say(message: dict[str, Any]) -> None:
    print(MARK + json.dumps(message), flush=True)


# ---- the driver ----


class Peer:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def ask(self, message: dict[str, Any] | None = None) -> dict[str, Any]:
        stdin: IO[str] | None = self.proc.stdin
        stdout: IO[str] | None = self.proc.stdout
        assert stdin is not None and stdout is not None
        if message is not None:
            stdin.write(json.dumps(message) + "\n")
            stdin.flush()
        while True:
            line = stdout.readline()
            if not line:
                raise RuntimeError(f"raw peer exited with {self.proc.wait()}")
            if line.startswith(MARK):
                answer: dict[str, Any] = json.loads(line[len(MARK) :])
                return answer


def _worker_config(
    model: Path, address: str, *, reuse: bool, max_tokens: int, progress_thread: bool
) -> dict[str, Any]:
    return {
        "model": str(model), "host": "0.0.0.0", "advertise_host": address, "port": PORT,
        "max_num_tokens": 8192, "max_batch_size": 8,
        "kv_cache_config": {"tokens_per_block": 32, "max_tokens": max_tokens,
                            "enable_block_reuse": reuse},
        "cache_transceiver_config": {"backend": "NIXL", "nixl_progress_thread": progress_thread},
    }  # fmt: skip


@contextlib.contextmanager
def _processes(
    tmp: Path, net: Any, sizes: list[int], model: Path, progress_thread: bool
) -> Iterator[dict[str, Any]]:
    max_tokens = 2 * max(sizes) + 1024
    # Workers bound beyond loopback run their control plane secured (CURVE), as between hosts.
    env = {**UCX_ENV, "TRTDISAGG_CLUSTER_SECRET": secrets.token_urlsafe(32)}
    procs: list[subprocess.Popen[Any]] = []
    try:
        urls = {}
        for role in ("ctx", "gen"):
            host = net.hosts[role]
            config = _worker_config(
                model, host.address, reuse=role == "ctx", max_tokens=max_tokens,
                progress_thread=progress_thread,
            )  # fmt: skip
            path = tmp / f"{role}.yaml"
            path.write_text(yaml.safe_dump(config))
            log_path = tmp / f"{role}.log"
            procs.append(net.popen(role, [role, "--config", str(path)], log_path=log_path, env=env))
            urls[role] = f"http://{host.address}:{PORT}"
        size = max(sizes) * 16384 + (1 << 20)
        peers = {}
        for role in ("ctx", "gen"):
            command = ["ip", "netns", "exec", net.hosts[role].namespace, sys.executable,
                       __file__, "--raw-peer", role, "--raw-bytes", str(size)]  # fmt: skip
            proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                env={**os.environ, **UCX_ENV}, stderr=open(tmp / f"raw-{role}.log", "w"),  # noqa: SIM115
            )  # fmt: skip
            procs.append(proc)
            peers[role] = Peer(proc)
        hello = {role: peer.ask() for role, peer in peers.items()}
        peers["ctx"].ask({"op": "peer", **hello["gen"]})
        peers["gen"].ask({"op": "peer", **hello["ctx"]})
        with httpx.Client(timeout=5, trust_env=False) as client:
            deadline = time.monotonic() + 300
            for url in urls.values():
                while True:
                    try:
                        if client.get(url + "/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{url} not healthy; logs in {tmp}")
                    time.sleep(0.2)
        yield {"urls": urls, "peers": peers}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _workers_sample(
    client: httpx.Client, urls: dict[str, str], prompt: list[int]
) -> tuple[float, int]:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    ctx = client.post(
        urls["ctx"] + "/v1/completions",
        json={**body, "disaggregated_params": {"request_type": "context_only"}},
    )
    ctx.raise_for_status()
    answer = ctx.json()
    params = {**answer["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
    gen = client.post(
        urls["gen"] + "/v1/completions",
        json={**body, "prompt_token_ids": answer["prompt_token_ids"],
              "disaggregated_params": params, "return_perf_metrics": True},
    )  # fmt: skip
    gen.raise_for_status()
    perf = gen.json()["perf_metrics"]
    return float(perf["kv_transfer_s"]), int(perf["kv_transfer_bytes"])


def _descriptors(client: httpx.Client, ctx_url: str) -> float:
    """ctx's count of NIXL descriptors posted so far (`trtdisagg_kv_transfer_descriptors_total`)."""
    for line in client.get(ctx_url + "/metrics").text.splitlines():
        if line.startswith("trtdisagg_kv_transfer_descriptors_total "):
            return float(line.split()[1])
    raise RuntimeError("ctx's /metrics has no trtdisagg_kv_transfer_descriptors_total")


def _raw_sample(
    peers: dict[str, Peer], num_bytes: int, index: int, poll_s: float
) -> tuple[float, float]:
    """gen asks ctx for `num_bytes` (a NIXL notification), ctx writes them with a notification:
    (gen's ask to the write's notification seen, ctx's post to that notification)."""
    notif = f"raw-{index}"
    peers["ctx"].ask({"op": "serve", "poll_s": poll_s})  # answers as it starts polling
    fetch = peers["gen"].ask({"op": "fetch", "notif": notif, "bytes": num_bytes, "poll_s": poll_s})
    write = peers["ctx"].ask()
    if write["state"] != "DONE":
        raise RuntimeError(f"raw write failed: {write}")
    return fetch["seen"] - fetch["asked"], fetch["seen"] - write["posted"]


def run(
    sizes: list[int], iterations: int, tmp: Path, poll_s: float, progress_thread: bool
) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from tests.netns import network
    from trtdisagg.model.tiny import TinySpec, ensure_tiny_checkpoint

    model = ensure_tiny_checkpoint(spec=TinySpec(**MODEL))  # type: ignore[arg-type]
    results: dict[str, Any] = {
        "model": MODEL, "iterations": iterations, "raw_poll_s": poll_s,
        "nixl_progress_thread": progress_thread, "sizes": {},
    }  # fmt: skip
    with (
        network(["ctx", "gen"]) as net,
        _processes(tmp, net, sizes, model, progress_thread) as running,
    ):
        urls, peers = running["urls"], running["peers"]
        with httpx.Client(timeout=600, trust_env=False) as client:
            index = 0
            for tokens in sizes:
                prompt = [(i * 37 + tokens) % 500 + 3 for i in range(tokens)]
                workers_s, raw_s, raw_write_s = [], [], []
                num_bytes, descriptors = 0, 0.0
                for i in range(iterations + 2):
                    order = ("workers", "raw") if i % 2 == 0 else ("raw", "workers")
                    for path in order:
                        index += 1
                        if path == "workers":
                            before = _descriptors(client, urls["ctx"])
                            seconds, num_bytes = _workers_sample(client, urls, prompt)
                            if i >= 2:
                                workers_s.append(seconds)
                                descriptors += _descriptors(client, urls["ctx"]) - before
                        elif num_bytes:
                            seconds, write_s = _raw_sample(peers, num_bytes, index, poll_s)
                            if i >= 2:
                                raw_s.append(seconds)
                                raw_write_s.append(write_s)
                assert peers["gen"].ask({"op": "check", "bytes": num_bytes})["ok"]
                workers, raw = statistics.median(workers_s), statistics.median(raw_s)
                results["sizes"][tokens] = {
                    "bytes": num_bytes,
                    "workers_s": workers_s, "raw_s": raw_s, "raw_write_s": raw_write_s,
                    "workers_median_s": workers, "raw_median_s": raw,
                    "raw_write_median_s": statistics.median(raw_write_s),
                    "workers_gb_s": num_bytes / workers / 1e9, "raw_gb_s": num_bytes / raw / 1e9,
                    "ratio_raw_over_workers": raw / workers,
                    "workers_descriptors_per_transfer": descriptors / len(workers_s),
                }  # fmt: skip
        for peer in peers.values():
            peer.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
            peer.proc.stdin.flush()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", default="1024,8192", help="prompt sizes, comma-separated")
    p.add_argument("--iterations", type=int, default=8, help="measured samples per path and size")
    p.add_argument(
        "--raw-poll-us", type=float, default=50.0,
        help="raw NIXL: pause between polls (default: the workers' pump period; 0: spin; on a "
        "small CPU host spinning on both sides takes the cores the kernel's TCP needs)",
    )  # fmt: skip
    p.add_argument(
        "--nixl-progress-thread", action=argparse.BooleanOptionalAction, default=False,
        help="the workers' cache_transceiver_config.nixl_progress_thread (default off, as in "
        "conf/ for CPU hosts; UCX on TCP moves data only while someone progresses it)",
    )  # fmt: skip
    out = Path("bench_results/netns_transfer")
    p.add_argument("--out", type=Path, default=out, help="logs, JSON (git-ignores bench_results/)")
    p.add_argument("--raw-peer", choices=["ctx", "gen"], help=argparse.SUPPRESS)
    p.add_argument("--raw-bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.raw_peer:
        raw_peer(args.raw_peer, args.raw_bytes)
        return 0
    if os.geteuid() != 0:
        print("needs root: it makes network namespaces (ip netns)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(t) for t in args.tokens.split(",")]
    results = run(
        sizes, args.iterations, args.out, args.raw_poll_us / 1e6, args.nixl_progress_thread
    )
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"{'tokens':>7} {'KV MiB':>8} {'workers ms':>11} {'raw ms':>8} {'raw write ms':>13} "
          f"{'workers GB/s':>13} {'raw GB/s':>9} {'raw/workers':>12} "
          f"{'descriptors':>12}")  # fmt: skip
    for tokens, r in results["sizes"].items():
        print(f"{tokens:>7} {r['bytes'] / 2**20:>8.1f} {r['workers_median_s'] * 1e3:>11.2f} "
              f"{r['raw_median_s'] * 1e3:>8.2f} {r['raw_write_median_s'] * 1e3:>13.2f} "
              f"{r['workers_gb_s']:>13.3f} {r['raw_gb_s']:>9.3f} "
              f"{r['ratio_raw_over_workers']:>12.3f} "
              f"{r['workers_descriptors_per_transfer']:>12.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
