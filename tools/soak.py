"""A long manual soak: mixed load for --duration seconds, then a leak check on every worker.

The load is bench_serving's mixed mode (a closed loop of short-prompt, long-output requests, or
Poisson arrivals of them with --short-rate, plus Poisson long-prompt requests) at a moderate
default rate, through --base-url (a coordinator, or one worker). After the load stops and drains,
each --worker-url's /metrics must show every KV block either free or held by the prefix cache:

    trtdisagg_kv_cache_free_blocks + trtdisagg_kv_cache_reusable_blocks
        == trtdisagg_kv_cache_total_blocks

(summed over label sets, i.e. over ranks). Blocks are released asynchronously, so the check polls
for up to --drain-timeout seconds before it reports a leak. Exit status 0 only when no request
failed and every worker passed.

    python tools/soak.py --base-url http://127.0.0.1:8000 \\
        --worker-url http://127.0.0.1:8001 --worker-url http://127.0.0.1:8002 --duration 1800
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import attrs
import httpx
import trio
from _bench_common import LengthRange, Slo
from bench_serving import BenchConfig, RunResult, report, run_benchmark

TOTAL: Final = "trtdisagg_kv_cache_total_blocks"
FREE: Final = "trtdisagg_kv_cache_free_blocks"
REUSABLE: Final = "trtdisagg_kv_cache_reusable_blocks"
RUNNING: Final = "trtdisagg_requests_running"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {metric name: value summed over its label sets}."""
    out: dict[str, float] = collections.defaultdict(float)
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            value = rest.rsplit("}", 1)[1].split()[0]
        else:
            name, value = line.split()[:2]
        out[name] += float(value)
    return dict(out)


@attrs.frozen(kw_only=True)
class BlockCheck:
    url: str
    total: float | None
    free: float | None
    reusable: float | None
    running: float | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        if self.error or self.total is None or self.free is None:
            return False
        return math.isclose(self.free + (self.reusable or 0.0), self.total) and not self.running

    def describe(self) -> str:
        if self.error:
            return f"{self.url}: FAIL ({self.error})"
        verdict = "ok" if self.ok else "LEAK"
        return (f"{self.url}: {verdict} free {self.free} + reusable {self.reusable} "
                f"vs total {self.total}, running {self.running}")  # fmt: skip


def check_blocks(url: str, metrics: dict[str, float]) -> BlockCheck:
    missing = [m for m in (TOTAL, FREE) if m not in metrics]
    return BlockCheck(
        url=url,
        total=metrics.get(TOTAL),
        free=metrics.get(FREE),
        reusable=metrics.get(REUSABLE),
        running=metrics.get(RUNNING),
        error=f"/metrics lacks {', '.join(missing)}" if missing else None,
    )


async def wait_blocks_released(client: httpx.AsyncClient, url: str, timeout_s: float) -> BlockCheck:
    """Poll `url`/metrics until its blocks balance or `timeout_s` passes; the last reading."""
    check = BlockCheck(url=url, total=None, free=None, reusable=None, running=None,
                       error="no reading")  # fmt: skip
    with trio.move_on_after(timeout_s):
        while True:
            try:
                response = await client.get(f"{url}/metrics", timeout=10.0)
                response.raise_for_status()
                check = check_blocks(url, parse_metrics(response.text))
            except httpx.HTTPError as error:
                check = attrs.evolve(check, error=f"{type(error).__name__}: {error}")
            if check.ok:
                return check
            # /metrics is a gauge snapshot with no change notification: polling is the only way.
            await trio.sleep(0.5)
    return check


async def soak(
    config: BenchConfig, workers: Sequence[str], drain_s: float
) -> tuple[RunResult, list[BlockCheck]]:
    """Run the load until its duration is over and it has drained, then check every worker."""
    result = await run_benchmark(config)
    async with httpx.AsyncClient(trust_env=False) as client:
        checks = [await wait_blocks_released(client, url, drain_s) for url in workers]
    return result, checks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--worker-url",
        action="append",
        default=[],
        help="a worker whose /metrics to check (repeat); default --base-url",
    )
    p.add_argument("--model")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--short-input-len", default="64")
    p.add_argument("--short-output-len", default="128")
    p.add_argument("--short-concurrency", type=int, default=2)
    p.add_argument(
        "--short-rate", type=float, help="short requests per second (default: a closed loop)"
    )
    p.add_argument("--long-input-len", default="512:2048", help='"N" or "LO:HI"')
    p.add_argument("--long-output-len", default="16")
    p.add_argument("--long-rate", type=float, default=0.2, help="long-prompt requests per second")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to wait for the blocks to balance after the load")  # fmt: skip
    p.add_argument("--sample-rss-pid", type=int, help="sample this PID's VmRSS per request")
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--label", default="soak")
    p.add_argument("--result-json", type=Path)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = BenchConfig(
        base_url=args.base_url.rstrip("/"), model=args.model, vocab_size=args.vocab_size,
        seed=args.seed, num_requests=None, duration_s=args.duration,
        request_timeout_s=args.request_timeout, mixed=True,
        slo=Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms),
        short_input_len=LengthRange.parse(args.short_input_len),
        short_output_len=LengthRange.parse(args.short_output_len),
        short_concurrency=args.short_concurrency, short_rate=args.short_rate,
        long_input_len=LengthRange.parse(args.long_input_len),
        long_output_len=LengthRange.parse(args.long_output_len), long_rate=args.long_rate,
        rss_pid=args.sample_rss_pid, label=args.label, progress=not args.no_progress,
    )  # fmt: skip
    workers = [u.rstrip("/") for u in args.worker_url] or [config.base_url]
    try:
        result, checks = trio.run(soak, config, workers, args.drain_timeout)
    except (httpx.HTTPError, trio.TooSlowError) as error:
        print(f"soak: cannot reach {config.base_url}: {error!r}", file=sys.stderr)
        return 2
    status = report(config, result, tool="soak", result_json=args.result_json)
    failures = collections.Counter(r.error for r in result.records if not r.ok)
    print(f"failed requests: {sum(failures.values())}")
    for message, count in failures.most_common(10):
        print(f"  {count:>6} x {message}")
    print("KV blocks after drain:")
    for check in checks:
        print(f"  {check.describe()}")
    return 1 if status or not all(c.ok for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
