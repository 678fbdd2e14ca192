"""One goodput point: Poisson arrivals through bench_serving's machinery, in this process, while
every server's /metrics is scraped and this process's own loop is timed.

`measure` runs inside `trio.run`: it scrapes every process once, then runs the benchmark with two
watchers beside it (a scrape every `interval_s`; a 10 ms sleep timed over and over), waits for
the servers to go idle (so the next point starts on an empty cluster and the counters are
complete), and scrapes again. `point_of` turns the records and scrapes into a `Point`.
"""

from __future__ import annotations

from typing import Any

import _bench_common as bc
import attrs
import bench_serving as bs
import httpx
import trio
from _goodput_core import (
    Observed,
    Point,
    Workload,
    first_failure,
    indicators,
    prefill_s,
    violations,
)
from _goodput_metrics import Scrape, observe, parse_prometheus, total


@attrs.define(eq=False, kw_only=True)
class Watch:
    """Scrapes every process's /metrics, and times this process's own loop, while a point runs."""

    urls: dict[str, str]  # process name -> base url
    interval_s: float
    samples: list[dict[str, Scrape]] = attrs.Factory(list)
    client_lags_s: list[float] = attrs.Factory(list)
    errors: int = 0

    async def scrape(self, client: httpx.AsyncClient) -> dict[str, Scrape]:
        out = {}
        for name, url in self.urls.items():
            try:
                out[name] = parse_prometheus((await client.get(url + "/metrics")).text)
            except httpx.HTTPError:
                self.errors += 1
        return out

    async def sample_forever(self, client: httpx.AsyncClient) -> None:
        while True:
            self.samples.append(await self.scrape(client))
            await trio.sleep(self.interval_s)

    async def time_loop_forever(self, tick_s: float = 0.01) -> None:
        """How late this loop wakes: a busy client delays every token it times."""
        while True:
            start = trio.current_time()
            await trio.sleep(tick_s)
            self.client_lags_s.append(trio.current_time() - start - tick_s)

    async def wait_idle(self, client: httpx.AsyncClient, timeout_s: float) -> float | None:
        """Seconds until no process runs or queues a request; None if that took too long."""
        start = trio.current_time()
        with trio.move_on_after(timeout_s):
            while True:
                scrapes = await self.scrape(client)
                busy = sum(
                    (total(s, "trtdisagg_requests_running") or 0.0)
                    + (total(s, "trtdisagg_requests_waiting") or 0.0)
                    for s in scrapes.values()
                )
                if busy == 0 and len(scrapes) == len(self.urls):
                    return trio.current_time() - start
                await trio.sleep(0.25)
        return None


@attrs.frozen(kw_only=True)
class Measured:
    result: bs.RunResult
    observed: Observed


async def measure(config: bs.BenchConfig, watch: Watch, idle_timeout_s: float) -> Measured:
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        before = await watch.scrape(client)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.sample_forever, client)
            nursery.start_soon(watch.time_loop_forever)
            result = await bs.run_benchmark(config)
            nursery.cancel_scope.cancel()
        idle_after = await watch.wait_idle(client, idle_timeout_s)
        after = await watch.scrape(client)
    seen = observe(
        before=before,
        after=after,
        samples=watch.samples,
        client_lags_s=watch.client_lags_s,
        scrape_errors=watch.errors,
        idle_after_s=idle_after,
    )
    return Measured(result=result, observed=seen)


def point_of(
    workload: Workload,
    mode: str,
    rate: float,
    gpus: int,
    seed: int,
    run_id: str,
    measured: Measured,
) -> tuple[Point, bc.ClassSummary]:
    records = measured.result.records
    summary = bc.summarize(records, duration_s=measured.result.duration_s, slo=workload.slo)
    phases = {k: s.p90 for k, s in summary.phases_ms.items() if s.p90 is not None}
    prefills = [p for r in records if r.ok and (p := prefill_s(r.phases)) is not None]
    if prefills:
        phases["prefill_s"] = bc.percentile(prefills, 90) * 1e3

    def pct(stats: bc.LatencyStats) -> dict[str, float | None]:
        return {"p50": stats.p50, "p90": stats.p90, "p99": stats.p99}

    point = Point(
        workload=workload.name,
        mode=mode,
        rate=rate,
        gpus=gpus,
        seed=seed,
        duration_s=round(summary.duration_s, 3),
        requests=len(records),
        attainment=summary.goodput.fraction if summary.goodput else 0.0,
        violations=violations(records, workload.slo),
        ttft_ms=pct(summary.ttft_ms),
        tpot_ms=pct(summary.tpot_ms),
        output_throughput=round(summary.output_throughput, 1),
        phases_p90_ms=phases,
        observed=measured.observed,
        indicators=indicators(
            slo=workload.slo,
            rate=rate,
            phases_p90_ms=phases,
            tpot_p90_ms=summary.tpot_ms.p90,
            seen=measured.observed,
        ),
        first_error=first_failure(records),
        run=run_id,
    )
    return point, summary


def bench_config(
    url: str, workload: Workload, *, vocab: int, seed: int, label: str, **load: Any
) -> bs.BenchConfig:
    return bs.BenchConfig(
        base_url=url,
        model=None,
        input_len=workload.input_len,
        output_len=workload.output_len,
        vocab_size=vocab,
        seed=seed,
        request_timeout_s=workload.request_timeout_s,
        slo=workload.slo,
        perf_metrics=True,
        label=label,
        progress=False,
        **load,
    )
