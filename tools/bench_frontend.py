"""Front-end capacity of the coordinator, measured against fake workers that answer at once.

A real ctx worker on this 2-core machine spends far more CPU per `max_tokens: 1` request (a
forward step, tokenisation, its own HTTP) than the coordinator does, so a capacity run against
it measures the worker. Here the upstreams are `tests/fake_worker.py`'s `FakeWorker`s (the
worker's HTTP contract, no model) in their own processes, and the figure that matters is the
coordinator's own CPU time per request (user + system, from /proc, summed over the coordinator
and the processes it started), which contention on a shared machine inflates far less than wall
time. Its inverse is the rate one core of front end can sustain.

Per front-end layout (`--num-workers 1,2`), in one run: the same requests sent directly to the
fake ctx (whose own CPU per request is the anchor: a bare quart-trio + hypercorn server answering
from memory), then through the coordinator. Each request is
`max_tokens: 1`, answered by ctx alone (DESIGN.md §2: the coordinator finishes it from ctx's
answer and never posts the gen leg).

With `--stream-tokens N` each request instead streams N tokens: ctx's first, then a gen leg
that the coordinator relays token by token. The anchor is then the fake gen streaming the same
N tokens straight to the client, and the figures are per streamed token: the coordinator's
cost of relaying one (read, account, rewrite, write) against a bare server's of writing one.

    python tools/bench_frontend.py                       # 3000 requests, concurrency 64, 1 and 2
    python tools/bench_frontend.py --requests 500 --num-workers 1
    python tools/bench_frontend.py --requests 256 --warmup 64 --stream-tokens 256 --num-workers 1

The last line is `frontend_req_per_cpu_s=<x>` for the first layout (per token when streaming).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import httpx
import trio
import yaml

from trtdisagg.free_ports import free_port

# The fake workers are the tests' (tests/fake_worker.py), imported from the repository root.
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
START_TIMEOUT_S: Final = 60.0
PROMPT: Final = "The quick brown fox jumps over"


@attrs.frozen(kw_only=True)
class Run:
    label: str
    requests: int
    wall_s: float
    latencies_s: tuple[float, ...]
    cpu_s: float | None  # the front end's CPU time (None: direct, no front end)
    per_request: int = 1  # units counted per request: 1, or the tokens each one streams

    @property
    def units(self) -> int:
        return self.requests * self.per_request

    @property
    def req_per_s(self) -> float:
        return self.units / self.wall_s

    @property
    def cpu_ms_per_request(self) -> float | None:
        return None if self.cpu_s is None else 1e3 * self.cpu_s / self.units

    @property
    def req_per_cpu_s(self) -> float | None:
        return None if not self.cpu_s else self.units / self.cpu_s

    def percentile_ms(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return 1e3 * ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "requests": self.requests,
            "per_request": self.per_request,
            "wall_s": self.wall_s,
            "req_per_s": self.req_per_s,
            "p50_ms": self.percentile_ms(50),
            "p99_ms": self.percentile_ms(99),
            "cpu_s": self.cpu_s,
            "cpu_ms_per_request": self.cpu_ms_per_request,
            "req_per_cpu_s": self.req_per_cpu_s,
        }


def process_tree_cpu_s(root: int) -> float:
    """User + system seconds of `root` and every living descendant (from /proc)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after "(comm) "
        pid, ppid = int(entry), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime + stime
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += ticks.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total / CLK_TCK


def _fake_main(role: str, port: int) -> None:
    """A spawned child: one FakeWorker on `port` until killed."""
    from tests.fake_worker import FakeWorker, create_fake_app
    from trtdisagg.api.listen import bind_socket, serve_http

    async def main() -> None:
        sock = bind_socket("127.0.0.1", port, reuse_port=False)
        await serve_http(create_fake_app(FakeWorker(role=role)), sock)

    trio.run(main)


async def _wait_healthy(client: httpx.AsyncClient, url: str) -> None:
    with trio.fail_after(START_TIMEOUT_S):
        while True:
            try:
                if (await client.get(url + "/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await trio.sleep(0.1)  # polling a server that is starting, bounded above


async def drive(
    url: str, *, requests: int, concurrency: int, warmup: int, stream_tokens: int = 0
) -> tuple[float, list[float]]:
    """`warmup` then `requests` completions with `max_tokens: 1`, or streams of
    `stream_tokens` tokens read to their end; (wall s, latencies s)."""
    from trtdisagg.coordinator.upstream import POOL_SHARDS, ShardedTransport

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # The coordinator's own client set-up: httpcore's single pool would make this client, not
    # the front end, the bottleneck (see ShardedTransport).
    transport = ShardedTransport(shards=POOL_SHARDS, limits=limits)
    body: dict[str, Any] = {"model": "fake", "prompt": PROMPT, "max_tokens": 1}
    if stream_tokens:
        body.update(max_tokens=stream_tokens, stream=True)
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, transport=transport, timeout=60) as client:

        async def one() -> None:
            if not stream_tokens:
                r = await client.post("/v1/completions", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")
                return
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:200]!r}")
                last = ""
                async for line in r.aiter_lines():
                    last = line or last
                if last != "data: [DONE]":
                    raise RuntimeError(f"{url}: a stream ended without [DONE]: {last[:200]}")

        async def worker(count: int, keep: bool) -> None:
            for _ in range(count):
                start = time.perf_counter()
                await one()
                if keep:
                    latencies.append(time.perf_counter() - start)

        async def phase(total: int, keep: bool) -> float:
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(concurrency):
                    nursery.start_soon(
                        worker, total // concurrency + (i < total % concurrency), keep
                    )
            return time.perf_counter() - start

        await phase(warmup, False)
        wall = await phase(requests, True)
    return wall, latencies


def _coordinator_config(path: Path, port: int, ctx: str, gen: str, num_workers: int) -> None:
    config = {
        "hostname": "127.0.0.1",
        "port": port,
        "num_workers": num_workers,
        "context_servers": {"urls": [ctx]},
        "generation_servers": {"urls": [gen]},
    }
    path.write_text(yaml.safe_dump(config))


async def measure(args: argparse.Namespace, workdir: Path) -> list[Run]:
    spawn = mp.get_context("spawn")
    ports = {role: free_port() for role in ("ctx", "gen")}
    fakes = [spawn.Process(target=_fake_main, args=(r, p), daemon=True) for r, p in ports.items()]
    for fake in fakes:
        fake.start()
    runs: list[Run] = []
    try:
        urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
        async with httpx.AsyncClient(timeout=5) as probe:
            for url in urls.values():
                await _wait_healthy(probe, url)
        tokens = args.stream_tokens
        load = {"requests": args.requests, "concurrency": args.concurrency, "warmup": args.warmup,
                "stream_tokens": tokens}  # fmt: skip
        per = max(1, tokens)
        # Streamed tokens come from gen: the anchor streams them from the fake gen directly.
        role = "gen" if tokens else "ctx"
        await drive(urls[role], **{**load, "requests": args.warmup, "warmup": 0})
        fake_pid = fakes[list(ports).index(role)].pid
        assert fake_pid is not None
        cpu_before = process_tree_cpu_s(fake_pid)
        wall, latencies = await drive(urls[role], **{**load, "warmup": 0})
        # The fake's own CPU: a bare quart-trio + hypercorn server answering from memory, the
        # floor any Python front end on this stack pays per request (or streamed token).
        cpu_s = process_tree_cpu_s(fake_pid) - cpu_before
        runs.append(Run(label=f"direct to the fake {role} (its CPU)", requests=args.requests,
                        wall_s=wall, latencies_s=tuple(latencies), cpu_s=cpu_s,
                        per_request=per))  # fmt: skip
        for num_workers in args.num_workers:
            port = free_port()
            config = workdir / f"coordinator-{num_workers}.yaml"
            _coordinator_config(config, port, urls["ctx"], urls["gen"], num_workers)
            log = (workdir / f"coordinator-{num_workers}.log").open("wb")
            command = [sys.executable, "-m", "trtdisagg", "coordinator", "--config", str(config)]
            if args.profile is not None:  # cProfile writes its file when the process exits
                out = args.profile / f"coordinator-{num_workers}.prof"
                command[1:1] = ["-m", "cProfile", "-o", str(out)]
            # A child process for the whole run; Popen returns at once (nothing to await).
            coordinator = subprocess.Popen(  # noqa: ASYNC220
                command, stdout=log, stderr=subprocess.STDOUT
            )
            try:
                url = f"http://127.0.0.1:{port}"
                async with httpx.AsyncClient(timeout=5) as probe:
                    await _wait_healthy(probe, url)
                await drive(url, **{**load, "requests": args.warmup, "warmup": 0})
                cpu_before = process_tree_cpu_s(coordinator.pid)
                wall, latencies = await drive(url, **{**load, "warmup": 0})
                cpu = process_tree_cpu_s(coordinator.pid) - cpu_before
                runs.append(Run(label=f"coordinator, num_workers {num_workers}",
                                requests=args.requests, wall_s=wall,
                                latencies_s=tuple(latencies), cpu_s=cpu,
                                per_request=per))  # fmt: skip
            except BaseException:
                log.flush()
                tail = (workdir / f"coordinator-{num_workers}.log").read_text().splitlines()[-20:]
                print("coordinator log (last lines):", *tail, sep="\n", file=sys.stderr)
                raise
            finally:
                coordinator.send_signal(signal.SIGINT)  # a clean stop (and cProfile's dump)
                await trio.to_thread.run_sync(coordinator.wait, 30)
                log.close()
    finally:
        for fake in fakes:
            fake.kill()
            fake.join(10)
    return runs


def report(runs: Sequence[Run]) -> str:
    unit = "tok" if runs and runs[0].per_request > 1 else "req"
    lines = [
        f"{'path':<36}{unit + '/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'CPU ms/' + unit:>12}"
        f"{unit + '/CPU-s':>11}"
    ]
    for run in runs:
        cpu = run.cpu_ms_per_request
        per_cpu = run.req_per_cpu_s
        lines.append(
            f"{run.label:<36}{run.req_per_s:>9.1f}{run.percentile_ms(50):>9.2f}"
            f"{run.percentile_ms(99):>9.2f}{'-' if cpu is None else f'{cpu:.3f}':>12}"
            f"{'-' if per_cpu is None else f'{per_cpu:.0f}':>11}"
        )
    fronted = [r for r in runs[1:] if r.req_per_cpu_s is not None]
    if fronted and runs[0].cpu_ms_per_request and fronted[0].cpu_ms_per_request:
        ratio = fronted[0].cpu_ms_per_request / runs[0].cpu_ms_per_request
        what = "token" if unit == "tok" else "request"
        lines.append(f"front end CPU per {what} / bare server's: {ratio:.2f}")
    if fronted:
        lines.append(f"frontend_req_per_cpu_s={fronted[0].req_per_cpu_s:.1f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument(
        "--num-workers",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 2],
        help="comma-separated front-end layouts to measure (coordinator num_workers)",
    )
    parser.add_argument(
        "--stream-tokens",
        type=int,
        default=0,
        help="stream this many tokens per request (a relayed gen leg) instead of max_tokens 1",
    )
    parser.add_argument("--result-json", type=Path)
    parser.add_argument(
        "--profile", type=Path, help="run the coordinator under cProfile, dumps in this folder"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.requests < args.concurrency or min(args.num_workers) < 1:
        raise SystemExit("--requests must be at least --concurrency, and num_workers >= 1")
    with tempfile.TemporaryDirectory(prefix="bench_frontend_") as workdir:
        runs = trio.run(measure, args, Path(workdir))
    print(report(runs))
    if args.result_json is not None:
        config = {k: v for k, v in vars(args).items() if k not in ("result_json", "profile")}
        doc = {"tool": "bench_frontend", "config": config, "runs": [r.to_json() for r in runs]}
        args.result_json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
