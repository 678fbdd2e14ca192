"""A 60-second soak in CI: mixed load through the coordinator, then a leak check (acceptance 7).

1 ctx + 1 gen (tiny model, NIXL transceiver) behind a coordinator: the session's shared cluster
(`tests/e2e/conftest.py`). The load is tools/soak.py's (bench_serving's mixed mode: Poisson arrivals
of short-prompt streams and of long-prompt requests) at a moderate rate, in two phases: 15 s of
warm-up, then 45 s. Required: no failed request in either phase; afterwards every KV block of
both workers is free or held by the prefix cache (soak.py's check); and no process's resident
memory grows during the second phase by more than allocator warm-up explains.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from tests.edges import Cluster

# tools/ holds scripts that import each other as top-level modules (see test_bench_tools.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import soak
from _bench_common import LengthRange, read_rss_kib
from bench_serving import BenchConfig, RunResult, run_benchmark

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WARMUP_S = 15.0
MEASURED_S = 45.0
# Allocator pools, torch caches and prometheus histograms grow in steps for a while; a leak grows
# with every request. The measured phase sends about 470 requests (and its steps are counted in
# thousands): a per-request leak of 150 KiB, or a per-step one of 16 KiB, would pass 64 MiB.
# Short outputs keep the request count up at a fraction of the CPU that long streams cost, so that
# the suite's other tests keep a core meanwhile.
RSS_SLACK_KIB = 64 * 1024
RSS_SLACK_FRACTION = 0.15


@pytest.fixture(scope="module")
def cluster(shared_cluster: tuple[Cluster, httpx.Client]) -> Cluster:
    """The session's shared cluster (its coordinator's request_timeout is 60 s): whatever the
    modules before this one left held is a leak this test finds too."""
    return shared_cluster[0]


def _load(cluster: Cluster, seconds: float, seed: int) -> BenchConfig:
    assert cluster.coordinator is not None
    return BenchConfig(
        base_url=cluster.coordinator.url, model=None, vocab_size=500, seed=seed,
        num_requests=None, duration_s=seconds, request_timeout_s=60.0, mixed=True,
        short_input_len=LengthRange.parse("8:64"), short_output_len=LengthRange.parse("4:16"),
        short_concurrency=3, short_rate=10.0, long_input_len=LengthRange.parse("200:900"),
        long_output_len=LengthRange.parse("2:16"), long_rate=0.5,
        label="ci-soak", progress=False,
    )  # fmt: skip


def _failures(result: RunResult) -> list[str]:
    return [f"{r.cls}#{r.index}: {r.error}" for r in result.records if not r.ok]


def _rss(cluster: Cluster) -> dict[str, int]:
    return {server.url: read_rss_kib(server.proc.pid) for server in cluster.servers}


async def test_mixed_load_for_a_minute_fails_nothing_and_leaks_nothing(cluster: Cluster) -> None:
    warmup = await run_benchmark(_load(cluster, WARMUP_S, seed=1))
    assert not _failures(warmup), _failures(warmup)[:10]
    after_warmup = _rss(cluster)

    workers = [server.url for server in cluster.workers]
    result, checks = await soak.soak(_load(cluster, MEASURED_S, seed=2), workers, drain_s=30.0)
    assert not _failures(result), _failures(result)[:10]
    by_class = {cls: sum(r.cls == cls for r in result.records) for cls in ("short", "long")}
    assert by_class["short"] >= 200 and by_class["long"] >= 5, by_class  # the load did run
    for check in checks:
        assert check.ok, check.describe()

    after = _rss(cluster)
    for url, start in after_warmup.items():
        allowed = start + max(RSS_SLACK_KIB, int(start * RSS_SLACK_FRACTION))
        assert after[url] <= allowed, f"{url}: RSS {start} KiB -> {after[url]} KiB"
    for server in cluster.servers:
        assert server.alive(), server.log()[-4000:]
    summary = {url: (after_warmup[url] // 1024, after[url] // 1024) for url in after}
    print(f"requests {by_class}, RSS MiB after warm-up -> end: {summary}")
