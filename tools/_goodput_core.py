"""The pure parts of the goodput sweep (`bench_goodput.py`): workloads, points, max rate, why.

Goodput at an SLO is the highest request rate at which a share `target` (0.9) of requests meets
both the TTFT and the TPOT objective. A sweep measures the SLO attainment at increasing Poisson
rates; `max_rate` reads the highest rate off the curve, interpolated between the last measured
point at or above the target and the first one below it. `ratio` compares two modes per GPU as an
interval, so a bound (a mode that never fell below the target) stays a bound.

Each point also carries *indicators*: measured pressures on one resource each, scaled so that
1.0 means that resource alone spends its share of the SLO (a queue that takes the whole TTFT
budget, a KV pool that is full, a front-end loop that stalls a token by a whole TPOT budget). The
first indicator to reach 1.0 as the rate grows names what saturates first.

No I/O here: `tests/unit/test_goodput.py` checks all of it on recorded numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Literal

import attrs
from _bench_common import LengthRange, RequestRecord, Slo

SCHEMA: Final = "trtdisagg.goodput/1"
TARGET: Final = 0.9
SATURATED: Final = 1.0
# A request still unanswered this long after the point where it could still meet both SLOs is
# abandoned: past TTFT SLO + (output - 1) x TPOT SLO it fails whatever happens next.
ABANDON_MARGIN_S: Final = 5.0


@attrs.frozen(kw_only=True)
class Workload:
    """One request mix and its SLOs; `rates` is the default sweep (req/s over the cluster)."""

    name: str
    input_len: LengthRange
    output_len: LengthRange
    slo: Slo
    rates: tuple[float, ...]

    @property
    def request_timeout_s(self) -> float:
        """Seconds after which a request can no longer meet both SLOs (plus a margin)."""
        assert self.slo.ttft_ms is not None and self.slo.tpot_ms is not None
        budget_ms = self.slo.ttft_ms + (self.output_len.hi - 1) * self.slo.tpot_ms
        return budget_ms / 1e3 + ABANDON_MARGIN_S


WORKLOADS: Final = {
    "chat": Workload(
        name="chat",
        input_len=LengthRange(256, 2048),
        output_len=LengthRange(64, 512),
        slo=Slo(ttft_ms=2000.0, tpot_ms=50.0),
        rates=(4.0, 8.0, 12.0, 16.0, 24.0, 32.0),
    ),
    "long": Workload(
        name="long",
        input_len=LengthRange(4096, 16384),
        output_len=LengthRange(128, 512),
        slo=Slo(ttft_ms=6000.0, tpot_ms=50.0),
        rates=(0.5, 1.0, 1.5, 2.0, 3.0, 4.0),
    ),
}

# The mode every other one is compared with.
BASELINE: Final = "aggregated"
# Mode name -> cluster file stem under conf/gpu, per set of files.
CONF_SETS: Final[Mapping[str, Mapping[str, str]]] = {
    "two_h200": {
        "aggregated": "two_h200_aggregated",
        "disagg": "two_h200_disagg",
        "generation_first": "two_h200_disagg_generation_first",
        "conditional": "two_h200_disagg_conditional",
    },
    "one_h200": {"aggregated": "one_h200_aggregated", "disagg": "one_h200"},
}


# ---- one point ----


@attrs.frozen(kw_only=True)
class Violations:
    """Shares of a point's requests: failed outright (`error`: the server's answer or the
    connection failed), or late on TTFT, TPOT or both. A request abandoned past its SLO budget
    (`Workload.request_timeout_s`) is late, not failed: on TTFT when its first token came after
    the TTFT SLO or never, else on TPOT (the rest then cannot have kept to it)."""

    error: float
    ttft: float
    tpot: float
    both: float


def violations(records: Sequence[RequestRecord], slo: Slo) -> Violations:
    n = len(records) or 1
    error = ttft = tpot = both = 0
    for r in records:
        if r.abandoned:
            first_late = r.ttft_s is None or (
                slo.ttft_ms is not None and r.ttft_s * 1e3 > slo.ttft_ms
            )
            ttft += first_late
            tpot += not first_late
            continue
        if not r.ok or r.ttft_s is None:
            error += 1
            continue
        late_first = slo.ttft_ms is not None and r.ttft_s * 1e3 > slo.ttft_ms
        t = r.tpot_s
        late_rest = slo.tpot_ms is not None and t is not None and t * 1e3 > slo.tpot_ms
        both += late_first and late_rest
        ttft += late_first and not late_rest
        tpot += late_rest and not late_first
    return Violations(error=error / n, ttft=ttft / n, tpot=tpot / n, both=both / n)


def first_failure(records: Sequence[RequestRecord]) -> str | None:
    """The first failed answer's error: an abandoned request's timeout is a late answer."""
    return next((r.error for r in records if not r.ok and not r.abandoned), None)


@attrs.frozen(kw_only=True)
class Observed:
    """What the servers' /metrics and the client's own loop showed during one point."""

    kv_peak_fraction: dict[str, float] = attrs.Factory(dict)  # worker -> peak held / total
    waiting_peak: dict[str, float] = attrs.Factory(dict)  # worker -> requests queued
    waiting_mean: dict[str, float] = attrs.Factory(dict)
    preemptions: dict[str, float] = attrs.Factory(dict)
    transfer_mean_ms: float | None = None  # one KV write, as ctx timed it
    transfer_p90_ms: float | None = None
    # How late each event loop woke from its sleeps ("coordinator", "ctx-0", ..., "client":
    # this process), {"p90": ms, "p99": ms}.
    loop_lag_ms: dict[str, dict[str, float]] = attrs.Factory(dict)
    local_prefill_share: float | None = None  # conditional disaggregation: served by gen alone
    scrape_errors: int = 0
    idle_after_s: float | None = None  # None: the servers were still busy when we gave up


@attrs.frozen(kw_only=True)
class Point:
    """One measured rate of one mode on one workload."""

    workload: str
    mode: str
    rate: float  # offered: Poisson arrivals per second over the whole cluster
    gpus: int
    seed: int
    duration_s: float
    requests: int
    attainment: float  # share of all requests (failed ones included) meeting both SLOs
    violations: Violations
    ttft_ms: dict[str, float | None]  # p50, p90, p99
    tpot_ms: dict[str, float | None]
    output_throughput: float
    phases_p90_ms: dict[str, float]  # server phases from perf_metrics ("ctx.queue_s", ...)
    observed: Observed
    indicators: dict[str, float]
    first_error: str | None = None
    run: str = ""  # which invocation measured it (its start time)

    @property
    def key(self) -> tuple[str, str, float]:
        return (self.workload, self.mode, self.rate)


RESOURCES: Final = {
    "ctx_queue": "ctx prefill queue",
    "prefill": "prefill time",
    "gen_queue": "gen admission queue",
    "transfer": "KV transfer",
    "ctx_kv": "ctx KV capacity",
    "gen_kv": "gen KV capacity",
    "decode": "decode (TPOT)",
    "front_end_queue": "front end queue",
    "front_end_lag": "front end loop lag",
    "client": "bench client",
}


def prefill_s(phases: Mapping[str, float]) -> float | None:
    """One request's prefill: ctx's, or gen's when gen served the request alone (no KV came).
    None when neither is known (generation_first: the coordinator relays no ctx phases)."""
    if "ctx.prefill_s" in phases:
        return phases["ctx.prefill_s"]
    if "kv_transfer_s" not in phases and "gen.kv_transfer_s" not in phases:
        return phases.get("gen.prefill_s")
    return None


def indicators(
    *,
    slo: Slo,
    rate: float,
    phases_p90_ms: Mapping[str, float],
    tpot_p90_ms: float | None,
    seen: Observed,
) -> dict[str, float]:
    """Each resource's pressure, 1.0 = at its limit; only those this point could measure.

    Against the TTFT SLO: the p90 of ctx's queue phase (`ctx_queue`; where the coordinator
    relays no ctx phases, the mean wait by Little's law: ctx's mean queue length over the rate of
    requests sent to ctx), of the prefill (`prefill`, see `prefill_s`), of one KV write as ctx
    timed it (`transfer`, from its histogram), of the coordinator's own queue
    (`front_end_queue`), and the mean wait for a gen slot (`gen_queue`, Little's law: the gen
    workers' mean queue length over the arrival rate; gen's queue phase also holds the KV
    transfer). Against the TPOT SLO: the p90 TPOT (`decode`), and how late the coordinator's
    and this client's loops wake at p90 (`front_end_lag`, `client`: that late, a loop delays
    tokens by a whole TPOT budget). KV pools (`ctx_kv`, `gen_kv`): the peak share of blocks
    held, 1.0 once a request was preempted for space.
    """
    ttft_ms, tpot_ms = slo.ttft_ms, slo.tpot_ms
    assert ttft_ms is not None and tpot_ms is not None
    out: dict[str, float] = {}

    def of_ttft(name: str, key: str) -> None:
        if key in phases_p90_ms:
            out[name] = phases_p90_ms[key] / ttft_ms

    def waited_ms(role: str, arrivals: float) -> float | None:
        queued = [n for w, n in seen.waiting_mean.items() if w.startswith(role + "-")]
        return sum(queued) / arrivals * 1e3 if queued and arrivals > 0 else None

    of_ttft("ctx_queue", "ctx.queue_s")
    if "ctx_queue" not in out:
        to_ctx = rate * (1.0 - (seen.local_prefill_share or 0.0))
        if (ctx_wait := waited_ms("ctx", to_ctx)) is not None:
            out["ctx_queue"] = ctx_wait / ttft_ms
    of_ttft("prefill", "prefill_s")
    if seen.transfer_p90_ms is not None:
        out["transfer"] = seen.transfer_p90_ms / ttft_ms
    of_ttft("front_end_queue", "coordinator_queue_s")
    if (gen_wait := waited_ms("gen", rate)) is not None:
        out["gen_queue"] = gen_wait / ttft_ms
    for role in ("ctx", "gen"):
        peaks = [f for w, f in seen.kv_peak_fraction.items() if w.startswith(role + "-")]
        if any(n > 0 for w, n in seen.preemptions.items() if w.startswith(role + "-")):
            peaks.append(1.0)  # a preemption is the pool running out
        if peaks:
            out[f"{role}_kv"] = max(peaks)
    if tpot_p90_ms is not None:
        out["decode"] = tpot_p90_ms / tpot_ms
    for name, process in (("front_end_lag", "coordinator"), ("client", "client")):
        lag = seen.loop_lag_ms.get(process, {}).get("p90")
        if lag is not None:
            out[name] = lag / tpot_ms
    return {k: round(v, 4) for k, v in out.items()}


def dominant(point: Point) -> tuple[str, float] | None:
    """The point's highest indicator."""
    if not point.indicators:
        return None
    name = max(point.indicators, key=lambda k: point.indicators[k])
    return name, point.indicators[name]


def first_saturated(points: Sequence[Point]) -> tuple[str, float] | None:
    """(indicator, rate): the first indicator at or above 1.0 going up in rate (the larger one
    when several cross at the same rate); None when none does."""
    for p in sorted(points, key=lambda p: p.rate):
        hot = {k: v for k, v in p.indicators.items() if v >= SATURATED}
        if hot:
            return max(hot, key=lambda k: hot[k]), p.rate
    return None


# ---- the curve ----


Bound = Literal["interpolated", "at_least", "below_lowest", "none"]


@attrs.frozen(kw_only=True)
class MaxRate:
    """The highest rate meeting the target, read off one attainment curve.

    interpolated: between `last_good` (measured, >= target) and `first_bad` (< target);
    at_least: every point met the target, `rate` is the highest measured;
    below_lowest: the lowest measured rate (`first_bad`) already missed it, `rate` is None;
    none: no point. Points above `first_bad` that meet the target again are ignored (the first
    crossing counts: a curve that dips and recovers is noise or a warm-up effect, and the
    conservative reading is the honest one); `recovers` says whether that happened.
    """

    rate: float | None
    bound: Bound
    last_good: float | None = None
    first_bad: float | None = None
    recovers: bool = False

    def interval(self) -> tuple[float, float]:
        """Where the true maximum rate lies, as far as the points tell."""
        if self.bound == "interpolated":
            assert self.rate is not None
            return self.rate, self.rate
        if self.bound == "at_least":
            assert self.rate is not None
            return self.rate, math.inf
        if self.bound == "below_lowest":
            assert self.first_bad is not None
            return 0.0, self.first_bad
        return 0.0, math.inf

    def per(self, gpus: int) -> MaxRate:
        def scale(x: float | None) -> float | None:
            return None if x is None else x / gpus

        return attrs.evolve(
            self,
            rate=scale(self.rate),
            last_good=scale(self.last_good),
            first_bad=scale(self.first_bad),
        )


def max_rate(curve: Iterable[tuple[float, float]], target: float = TARGET) -> MaxRate:
    """`curve`: (rate, attainment) points, any order."""
    points = sorted(curve)
    if not points:
        return MaxRate(rate=None, bound="none")
    bad = next((i for i, (_, a) in enumerate(points) if a < target), None)
    if bad is None:
        return MaxRate(rate=points[-1][0], bound="at_least", last_good=points[-1][0])
    recovers = any(a >= target for _, a in points[bad + 1 :])
    r_bad, a_bad = points[bad]
    if bad == 0:
        return MaxRate(rate=None, bound="below_lowest", first_bad=r_bad, recovers=recovers)
    r_good, a_good = points[bad - 1]
    rate = r_good + (a_good - target) / (a_good - a_bad) * (r_bad - r_good)
    return MaxRate(
        rate=rate, bound="interpolated", last_good=r_good, first_bad=r_bad, recovers=recovers
    )


@attrs.frozen(kw_only=True)
class Ratio:
    """num / den of two max rates as an interval [lo, hi]; lo == hi when both were
    interpolated."""

    lo: float
    hi: float

    def __str__(self) -> str:
        if self.lo == self.hi:
            return f"{self.lo:.2f}"
        if math.isinf(self.hi):
            return f">= {self.lo:.2f}" if self.lo > 0 else "unknown"
        if self.lo == 0:
            return f"<= {self.hi:.2f}"
        return f"{self.lo:.2f}..{self.hi:.2f}"


def ratio(num: MaxRate, den: MaxRate) -> Ratio:
    """Per-GPU rates in, the interval of num / den out (0 / 0 counts as unknown)."""
    n_lo, n_hi = num.interval()
    d_lo, d_hi = den.interval()

    def div(a: float, b: float, *, when_zero: float) -> float:
        if b == 0:
            return when_zero
        return 0.0 if math.isinf(b) and not math.isinf(a) else a / b

    lo = div(n_lo, d_hi, when_zero=0.0)
    hi = div(n_hi, d_lo, when_zero=math.inf)
    return Ratio(lo=0.0 if math.isnan(lo) else lo, hi=math.inf if math.isnan(hi) else hi)


def sweep_done(attainments: Sequence[float], *, stop_below: float, in_a_row: int = 2) -> bool:
    """A mode's sweep stops once its last `in_a_row` points all fell below `stop_below`."""
    tail = attainments[-in_a_row:]
    return len(tail) == in_a_row and all(a < stop_below for a in tail)


def refine_rate(
    curve: Iterable[tuple[float, float]], target: float = TARGET, *, min_step: float = 0.1
) -> float | None:
    """A rate halfway into the bracket where the curve first crosses `target`, or None when
    there is no bracket or it is already narrower than `min_step` of its upper end."""
    found = max_rate(curve, target)
    if found.bound != "interpolated":
        return None
    assert found.last_good is not None and found.first_bad is not None
    if found.first_bad - found.last_good <= min_step * found.first_bad:
        return None
    return round((found.last_good + found.first_bad) / 2, 3)


def gpus_of(cluster: Mapping[str, object]) -> int:
    """GPUs a cluster file's workers use: each takes cuda_device .. + TP x PP - 1."""
    used: set[int] = set()
    for role in ("ctx", "gen"):
        workers = cluster.get(role) or []
        assert isinstance(workers, list)
        for w in workers:
            ranks = int(w.get("tensor_parallel_size", 1)) * int(w.get("pipeline_parallel_size", 1))
            first = int(w.get("cuda_device", 0))
            used.update(range(first, first + ranks))
    return max(1, len(used))


def next_rate(
    planned: Sequence[float],
    curve: Sequence[tuple[float, float]],
    *,
    stop_below: float,
    refine_left: int,
    target: float = TARGET,
) -> float | None:
    """The next rate to measure, given the (rate, attainment) points measured so far in order:
    the planned rates in increasing order until two in a row fall below `stop_below`, then up to
    `refine_left` points bisecting the bracket where the curve crosses `target`."""
    listed = sorted(set(planned))
    done = {r for r, _ in curve}
    on_list = [a for r, a in sorted(curve) if r in listed]
    if not sweep_done(on_list, stop_below=stop_below):
        top = max(done, default=-math.inf)
        ahead = [r for r in listed if r > top and r not in done]
        if ahead:
            return ahead[0]
    if refine_left <= 0:
        return None
    rate = refine_rate(curve, target)
    return None if rate is None or rate in done else rate
