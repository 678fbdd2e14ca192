"""The pure parts of tools/bench_goodput.py: the max rate read off an attainment curve, the ratio
of two modes as an interval, the sweep's stopping and refining, the servers' /metrics (rendered
by the package's own metric classes) turned into what a point saw, the indicators that say what
saturates first, and the summary's round trip through JSON for `report`."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))  # scripts, not a package

import _goodput_core as core
import _goodput_metrics as gm
import _goodput_report as report
import bench_goodput
from _bench_common import LengthRange, RequestRecord

from trtdisagg.coordinator.metrics import CoordinatorMetrics
from trtdisagg.launcher import plan_cluster
from trtdisagg.metrics import WorkerMetrics
from trtdisagg.transfer.runtime.collector import (
    TransceiverStatistics,
    TransferCollector,
    WriteTally,
)

TOOLS = Path(__file__).resolve().parents[2] / "tools"
GPU_CONF = TOOLS.parent / "conf" / "gpu"
CHAT_SLO = core.WORKLOADS["chat"].slo


# ---- the max rate ----


def test_max_rate_interpolates_between_the_last_good_and_the_first_bad_point() -> None:
    # 0.95 at 8, 0.75 at 12: 0.9 is a quarter of the way down, so at 9.
    found = core.max_rate([(12.0, 0.75), (4.0, 1.0), (8.0, 0.95), (16.0, 0.2)])
    assert found.bound == "interpolated"
    assert found.rate == pytest.approx(9.0)
    assert (found.last_good, found.first_bad, found.recovers) == (8.0, 12.0, False)
    assert found.interval() == (pytest.approx(9.0), pytest.approx(9.0))


def test_max_rate_takes_the_first_crossing_and_says_when_the_curve_recovers() -> None:
    found = core.max_rate([(1.0, 0.99), (2.0, 0.8), (3.0, 0.93), (4.0, 0.1)])
    assert (found.last_good, found.first_bad) == (1.0, 2.0)
    assert found.rate == pytest.approx(1.0 + 0.09 / 0.19)
    assert found.recovers


def test_max_rate_bounds_when_the_curve_never_crosses() -> None:
    never_bad = core.max_rate([(1.0, 0.95), (2.0, 0.9)])  # exactly at the target is good
    assert (never_bad.bound, never_bad.rate) == ("at_least", 2.0)
    assert never_bad.interval() == (2.0, math.inf)
    never_good = core.max_rate([(1.0, 0.5), (2.0, 0.3)])
    assert (never_good.bound, never_good.rate, never_good.first_bad) == ("below_lowest", None, 1.0)
    assert never_good.interval() == (0.0, 1.0)
    assert core.max_rate([]).bound == "none"


def test_max_rate_per_gpu_divides_every_rate() -> None:
    found = core.max_rate([(8.0, 0.95), (12.0, 0.75)]).per(2)
    assert (found.rate, found.last_good, found.first_bad) == (
        pytest.approx(4.5),
        4.0,
        6.0,
    )


def test_ratio_keeps_bounds_as_bounds() -> None:
    exact = core.MaxRate(rate=6.0, bound="interpolated")
    other = core.MaxRate(rate=4.0, bound="interpolated")
    assert str(core.ratio(exact, other)) == "1.50"
    at_least = core.MaxRate(rate=6.0, bound="at_least")
    assert str(core.ratio(at_least, other)) == ">= 1.50"
    assert str(core.ratio(other, at_least)) == "<= 0.67"
    below = core.MaxRate(rate=None, bound="below_lowest", first_bad=2.0)
    assert str(core.ratio(below, other)) == "<= 0.50"
    assert str(core.ratio(exact, below)) == ">= 3.00"
    assert str(core.ratio(at_least, at_least)) == "unknown"
    assert str(core.ratio(below, below)) == "unknown"


# ---- the sweep ----


def test_next_rate_climbs_until_two_points_in_a_row_fall_well_below() -> None:
    planned = [8.0, 2.0, 4.0, 6.0, 10.0]
    curve: list[tuple[float, float]] = []
    attainment = {2.0: 1.0, 4.0: 0.95, 6.0: 0.7, 8.0: 0.4, 5.0: 0.85, 4.5: 0.9}
    seen = []
    refine_left = 2
    while (
        rate := core.next_rate(planned, curve, stop_below=0.75, refine_left=refine_left)
    ) is not None:
        if rate not in planned:
            refine_left -= 1
        seen.append(rate)
        curve.append((rate, attainment[rate]))
    # 6 and 8 both below 0.75: 10 is never measured; then the bracket 4..6 is halved.
    assert seen[:4] == [2.0, 4.0, 6.0, 8.0]
    assert seen[4] == 5.0
    # After 5 (0.85), the bracket is 4..5; its midpoint is the second refinement.
    assert seen[5:] == [4.5]


def test_next_rate_one_point_below_is_not_enough_to_stop() -> None:
    curve = [(1.0, 0.5), (2.0, 0.95)]
    assert core.next_rate([1.0, 2.0, 3.0], curve, stop_below=0.75, refine_left=0) == 3.0
    assert not core.sweep_done([0.5, 0.95], stop_below=0.75)
    assert core.sweep_done([0.95, 0.5, 0.6], stop_below=0.75)


def test_refine_stops_when_the_bracket_is_narrow_or_absent() -> None:
    assert core.refine_rate([(4.0, 0.95), (8.0, 0.5)]) == 6.0
    assert core.refine_rate([(9.5, 0.95), (10.0, 0.5)]) is None  # 5% of 10 < min_step
    assert core.refine_rate([(4.0, 0.95), (8.0, 0.92)]) is None
    assert core.next_rate([4.0], [(4.0, 0.95)], stop_below=0.75, refine_left=3) is None


def test_a_request_is_abandoned_only_once_it_cannot_meet_both_slos() -> None:
    chat = core.WORKLOADS["chat"]
    # 2 s TTFT + 511 tokens x 50 ms, + the margin.
    assert chat.request_timeout_s == pytest.approx(2.0 + 511 * 0.05 + core.ABANDON_MARGIN_S)
    assert core.WORKLOADS["long"].input_len == LengthRange(4096, 16384)


def record(ttft: float | None, e2e: float = 1.0, out: int = 11, ok: bool = True) -> RequestRecord:
    return RequestRecord(cls="all", index=0, input_len=8, output_len=out, ok=ok, start_s=0.0,
                         ttft_s=ttft, e2e_s=e2e, output_tokens=out)  # fmt: skip


def test_violations_split_the_misses_by_cause() -> None:
    records = [
        record(0.1, e2e=0.2),  # TPOT 10 ms: good
        record(3.0, e2e=3.1),  # TTFT late
        record(0.1, e2e=1.1),  # TPOT 100 ms
        record(3.0, e2e=4.0),  # both
        record(None, ok=False),
    ]
    v = core.violations(records, CHAT_SLO)
    assert (v.error, v.ttft, v.tpot, v.both) == (0.2, 0.2, 0.2, 0.2)


def test_a_request_abandoned_past_its_budget_is_late_not_failed() -> None:
    def abandoned(ttft: float | None) -> RequestRecord:
        return attrs.evolve(record(ttft, ok=False), abandoned=True, error="timeout after 7.55s")

    # no first token, a late one (TTFT); the first in time, the rest too slow (TPOT)
    records = [abandoned(None), abandoned(2.5), abandoned(0.1), record(None, ok=False)]
    v = core.violations(records, CHAT_SLO)
    assert (v.error, v.ttft, v.tpot, v.both) == (0.25, 0.5, 0.25, 0.0)
    failed = attrs.evolve(records[3], error="HTTP 500: boom")
    assert core.first_failure([*records[:3], failed]) == "HTTP 500: boom"
    assert core.first_failure(records[:3]) is None


# ---- /metrics ----


def test_histogram_quantile_interpolates_in_the_bucket_of_the_package_histogram() -> None:
    metrics = WorkerMetrics.create()
    for _ in range(90):
        metrics.event_loop_lag.observe(0.0005)  # bucket le=0.001
    for _ in range(10):
        metrics.event_loop_lag.observe(0.02)  # bucket le=0.025
    scrape = gm.parse_prometheus(metrics.render().decode())
    name = "trtdisagg_event_loop_lag_seconds"
    assert gm.histogram_quantile(scrape, name, 0.9) == pytest.approx(0.001)
    # rank 95 of 100: half-way through the 10 in (0.01, 0.025].
    assert gm.histogram_quantile(scrape, name, 0.95) == pytest.approx(0.0175)
    metrics.event_loop_lag.observe(60.0)  # past the last bound: reads as that bound
    later = gm.parse_prometheus(metrics.render().decode())
    assert gm.histogram_quantile(gm.delta(later, scrape), name, 0.99) == 5.0
    assert gm.histogram_quantile({}, name, 0.5) is None


def worker_text(*, total_blocks: int, free: int, reusable: int = 0, waiting: int = 0,
                preempted: int = 0, writes: tuple[float, ...] = ()) -> str:  # fmt: skip
    m = WorkerMetrics.create()
    m.kv_total_blocks.set(total_blocks)
    m.kv_free_blocks.set(free)
    m.kv_reusable_blocks.set(reusable)
    m.requests_waiting.set(waiting)
    m.preemptions.inc(preempted)
    tally = WriteTally()  # the transfer metrics come from the transceiver's collector
    for seconds in writes:
        tally.count(1, 1, seconds, "gen-0#0")
    idle = TransceiverStatistics(rendezvous=0, senders=0, receivers=0, bad_frames=0)
    m.registry.register(TransferCollector(lambda: idle, tally))
    return m.render().decode()


def test_observe_reads_kv_use_queues_preemptions_writes_and_local_share() -> None:
    idle = {
        "ctx-0": gm.parse_prometheus(worker_text(total_blocks=100, free=100)),
        "gen-0": gm.parse_prometheus(worker_text(total_blocks=200, free=200)),
        "coordinator": gm.parse_prometheus(CoordinatorMetrics.create().render().decode()),
    }
    coordinator = CoordinatorMetrics.create()
    for _ in range(3):
        coordinator.finished("ok")
    coordinator.local_prefill.inc()
    samples = [
        {
            "ctx-0": gm.parse_prometheus(worker_text(total_blocks=100, free=60, waiting=4)),
            # Reusable blocks are prefix cache: evictable, not held.
            "gen-0": gm.parse_prometheus(worker_text(total_blocks=200, free=20, reusable=80)),
        },
        {
            "ctx-0": gm.parse_prometheus(worker_text(total_blocks=100, free=90, waiting=2)),
            "gen-0": gm.parse_prometheus(worker_text(total_blocks=200, free=150)),
        },
    ]
    after = {
        "ctx-0": gm.parse_prometheus(
            worker_text(total_blocks=100, free=100, writes=(0.004, 0.004, 0.004, 0.02))
        ),
        "gen-0": gm.parse_prometheus(worker_text(total_blocks=200, free=200, preempted=2)),
        "coordinator": gm.parse_prometheus(coordinator.render().decode()),
    }
    seen = gm.observe(before=idle, after=after, samples=samples, client_lags_s=[0.001] * 9 + [0.1])
    assert seen.kv_peak_fraction == {"ctx-0": 0.4, "gen-0": 0.5}
    assert (seen.waiting_peak["ctx-0"], seen.waiting_mean["ctx-0"]) == (4.0, 3.0)
    assert seen.preemptions == {"ctx-0": 0.0, "gen-0": 2.0}
    assert seen.transfer_mean_ms == pytest.approx(8.0)
    assert seen.transfer_p90_ms is not None and 5.0 < seen.transfer_p90_ms <= 25.0
    assert seen.local_prefill_share == pytest.approx(1 / 3, abs=1e-4)
    assert seen.loop_lag_ms["client"] == {"p90": 1.0, "p99": 1.0}


# ---- indicators ----


def test_indicators_scale_each_resource_to_its_share_of_the_slo() -> None:
    seen = core.Observed(
        kv_peak_fraction={"ctx-0": 0.2, "gen-0": 0.5},
        waiting_mean={"ctx-0": 3.0, "gen-0": 2.0},
        preemptions={"gen-0": 0.0},
        transfer_p90_ms=100.0,
        loop_lag_ms={"coordinator": {"p90": 25.0}, "client": {"p90": 5.0}},
    )
    phases = {"ctx.queue_s": 1000.0, "prefill_s": 500.0, "coordinator_queue_s": 20.0}
    out = core.indicators(slo=CHAT_SLO, rate=4.0, phases_p90_ms=phases, tpot_p90_ms=60.0,
                          seen=seen)  # fmt: skip
    assert out == {
        "ctx_queue": 0.5,  # p90 of ctx's queue phase / 2 s
        "prefill": 0.25,
        "transfer": 0.05,
        "front_end_queue": 0.01,
        "gen_queue": 0.25,  # Little: 2 queued / 4 req/s = 0.5 s of 2 s
        "ctx_kv": 0.2,
        "gen_kv": 0.5,
        "decode": 1.2,
        "front_end_lag": 0.5,
        "client": 0.1,
    }
    # Without ctx's phases (generation_first), ctx's queue comes from its gauge, over the
    # requests that went to ctx; a preemption marks the pool as full.
    seen = attrs.evolve(seen, local_prefill_share=0.5, preemptions={"gen-0": 1.0})
    out = core.indicators(slo=CHAT_SLO, rate=4.0, phases_p90_ms={}, tpot_p90_ms=None, seen=seen)
    assert out["ctx_queue"] == 0.75  # 3 queued / 2 req/s = 1.5 s of 2 s
    assert out["gen_kv"] == 1.0
    assert "decode" not in out and "prefill" not in out


def test_prefill_is_ctx_s_or_gen_s_when_gen_served_alone() -> None:
    assert (
        core.prefill_s({"ctx.prefill_s": 0.2, "gen.prefill_s": 0.0, "kv_transfer_s": 0.01}) == 0.2
    )
    assert core.prefill_s({"gen.prefill_s": 0.3}) == 0.3
    assert core.prefill_s({"gen.prefill_s": 0.0, "kv_transfer_s": 0.01}) is None


def point(mode: str, rate: float, attainment: float, **indicators: float) -> core.Point:
    return core.Point(
        workload="chat", mode=mode, rate=rate, gpus=2, seed=0, duration_s=45.0, requests=100,
        attainment=attainment, violations=core.Violations(error=0, ttft=0, tpot=0, both=0),
        ttft_ms={"p50": 1.0, "p90": 2.0, "p99": None}, tpot_ms={"p50": 1.0, "p90": 2.0, "p99": 3.0},
        output_throughput=1.0, phases_p90_ms={}, observed=core.Observed(), indicators=indicators,
    )  # fmt: skip


def test_first_saturated_is_the_first_indicator_over_one_going_up_in_rate() -> None:
    points = [
        point("disagg", 8.0, 0.5, ctx_queue=1.4, decode=1.1),
        point("disagg", 4.0, 0.95, ctx_queue=0.3, decode=0.4),
        point("disagg", 6.0, 0.8, ctx_queue=0.9, gen_kv=1.0),
    ]
    assert core.first_saturated(points) == ("gen_kv", 6.0)
    assert core.first_saturated(points[1:2]) is None
    assert core.dominant(points[0]) == ("ctx_queue", 1.4)


# ---- the summary ----


def test_summary_round_trips_and_report_merges_later_points_over_earlier() -> None:
    first = [
        point("aggregated", 4.0, 1.0),
        point("aggregated", 8.0, 0.8),
        point("disagg", 4.0, 1.0),
    ]
    second = [point("disagg", 8.0, 0.95, decode=1.2), point("disagg", 12.0, 0.5),
              point("aggregated", 8.0, 0.6)]  # fmt: skip
    workloads = {"chat": core.WORKLOADS["chat"]}
    docs = [report.summary_document(ps, workloads=workloads, runs=[{"run": n}])
            for n, ps in (("a", first), ("b", second))]  # fmt: skip
    loaded = [report.points_of(d) for d in docs]
    assert loaded[0] == first
    merged = report.merge(loaded)
    assert [(p.mode, p.rate, p.attainment) for p in merged] == [
        ("aggregated", 4.0, 1.0),
        ("aggregated", 8.0, 0.6),  # the later run's
        ("disagg", 4.0, 1.0),
        ("disagg", 8.0, 0.95),
        ("disagg", 12.0, 0.5),
    ]
    found = report.results(merged)["chat"]
    # aggregated: 1.0 at 4, 0.6 at 8 -> 0.9 at 5; disagg: 0.95 at 8, 0.5 at 12 -> 0.9 at 8.44.
    assert found["aggregated"].max_rate.rate == pytest.approx(5.0)
    assert found["disagg"].per_gpu.rate == pytest.approx((8 + 0.05 / 0.45 * 4) / 2)
    assert found["disagg"].vs_baseline is not None
    assert found["disagg"].vs_baseline.lo == pytest.approx((8 + 0.05 / 0.45 * 4) / 5.0)
    assert found["disagg"].saturates_first == ("decode", 8.0)
    doc = report.summary_document(merged, workloads=workloads, runs=[])
    assert doc["results"]["chat"]["disagg"]["per_gpu_vs_aggregated"]["text"] == "1.69"
    text = report.table(merged, doc["workloads"])
    assert "decode (TPOT) at 8" in text and "TTFT <= 2000 ms" in text
    with pytest.raises(ValueError, match="not a goodput summary"):
        report.points_of({"schema": "trtdisagg.bench/1"})


# ---- the command line and the cluster files ----


def test_rates_apply_to_every_workload_or_to_one() -> None:
    workloads = dict(core.WORKLOADS)
    rates = bench_goodput.parse_rates(["1,2", "long=0.5,0.25"], workloads)
    assert rates == {"chat": (1.0, 2.0), "long": (0.25, 0.5)}
    assert bench_goodput.parse_rates([], workloads)["chat"] == core.WORKLOADS["chat"].rates
    for bad in ("chat=", "0,1", "other=1", "chat=fast", "inf"):
        with pytest.raises(ValueError, match="--rates"):
            bench_goodput.parse_rates([bad], workloads)


@pytest.mark.parametrize(
    ("conf_set", "mode"), [(s, m) for s, modes in core.CONF_SETS.items() for m in modes]
)
def test_every_mode_has_a_valid_cluster_file_of_its_shape(conf_set: str, mode: str) -> None:
    name = core.CONF_SETS[conf_set][mode]
    data: dict[str, Any] = yaml.safe_load((GPU_CONF / f"{name}.yaml").read_text())
    plan_cluster(data, source=name, root=GPU_CONF)
    assert core.gpus_of(data) == (2 if conf_set == "two_h200" else 1)
    assert bool(data["ctx"]) == (mode != "aggregated")
    conditional = data["coordinator"].get("conditional_disagg_config")
    assert (conditional is not None) == (mode in ("aggregated", "conditional"))
    style = data["coordinator"].get("schedule_style", "context_first")
    assert style == ("generation_first" if mode == "generation_first" else "context_first")


def test_gpus_of_counts_every_rank() -> None:
    workers = {"ctx": [{"cuda_device": 0, "tensor_parallel_size": 2}],
               "gen": [{"cuda_device": 2, "pipeline_parallel_size": 2}]}  # fmt: skip
    assert core.gpus_of(workers) == 4
    assert core.gpus_of({"ctx": [], "gen": [{}]}) == 1


@pytest.mark.parametrize("module", ["_goodput_core", "_goodput_metrics", "_goodput_report"])
def test_the_pure_parts_import_no_io_machinery(module: str) -> None:
    # A fresh interpreter: in this one, the tests above imported trio and httpx already.
    code = (
        f"import sys; sys.path.insert(0, {str(TOOLS)!r}); import {module}; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'trio', 'httpx', 'torch', "
        "'matplotlib'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
