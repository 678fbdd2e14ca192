"""The pure parts of the benchmark tools: workloads, request records, statistics, result files.

`bench_serving.py`, `bench_hf_baseline.py`, `soak.py` and `plot_bench.py` import this module (it
sits next to them, so a script run as `python tools/x.py` finds it on `sys.path[0]`). It imports
no trio, httpx or torch, so `tests/unit/test_bench_tools.py` checks it without servers.

Determinism: the requests of one class depend only on (seed, class name, length ranges, vocab
size) and are drawn one request at a time from one generator, so the first k of n requests are
the same as the k requests of a shorter run. Poisson arrival times are a separate stream of the
same seed, so changing the rate never changes the prompts. Both tools that send the same workload
(the HTTP bench and the HF baseline) call `iter_requests` with the same arguments and therefore
send the same token ids.

Result file (`SCHEMA`): {"schema", "tool", "label", "created", "config", "summary": {class:
ClassSummary}, "records": [RequestRecord], "rss": RssSummary | null}. Times in records are
seconds; times in summaries are milliseconds.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

import attrs
import numpy as np

SCHEMA: Final = "trtdisagg.bench/1"
PERCENTILES: Final = (50, 90, 99)
RSS_CHECKPOINT: Final = 100  # "RSS flat within 5% between requests 100 and the end"


@attrs.frozen
class LengthRange:
    """Token counts drawn uniformly from [lo, hi], both inclusive."""

    lo: int
    hi: int

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"length range needs 1 <= lo <= hi, got {self.lo}:{self.hi}")

    @classmethod
    def parse(cls, text: str, range_ratio: float = 0.0) -> LengthRange:
        """ "N" spread by `range_ratio` (N·(1-r) .. N·(1+r)), or an explicit "LO:HI"."""
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
        if ":" in text:
            first, last = text.split(":", 1)
            return cls(int(first), int(last))
        n = int(text)
        lo = max(1, math.floor(n * (1 - range_ratio)))
        return cls(lo, max(lo, math.ceil(n * (1 + range_ratio))))

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


@attrs.frozen(kw_only=True)
class RequestSpec:
    """One request to send: exact prompt token ids and the exact number of tokens to generate."""

    cls: str
    index: int
    prompt_ids: tuple[int, ...] = attrs.field(repr=lambda ids: f"<{len(ids)} ids>")
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.prompt_ids)


def _rng(seed: int, stream: str) -> np.random.Generator:
    # crc32, not hash(): str hashes are salted per process.
    return np.random.default_rng([seed, zlib.crc32(stream.encode())])


def iter_requests(
    cls: str, *, input_len: LengthRange, output_len: LengthRange, vocab_size: int, seed: int
) -> Iterator[RequestSpec]:
    """Endless random-token requests of class `cls`; prompt ids are uniform in [0, vocab_size)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    rng = _rng(seed, f"prompts/{cls}")
    for index in itertools.count():
        n_in = int(rng.integers(input_len.lo, input_len.hi + 1))
        n_out = int(rng.integers(output_len.lo, output_len.hi + 1))
        ids = rng.integers(0, vocab_size, size=n_in, dtype=np.int64)
        yield RequestSpec(cls=cls, index=index, prompt_ids=tuple(ids.tolist()), output_len=n_out)


def make_requests(
    cls: str, n: int, *, input_len: LengthRange, output_len: LengthRange, vocab_size: int, seed: int
) -> list[RequestSpec]:
    """The first `n` requests of `iter_requests(...)`."""
    it = iter_requests(
        cls, input_len=input_len, output_len=output_len, vocab_size=vocab_size, seed=seed
    )
    return list(itertools.islice(it, n))


def iter_poisson_arrivals(rate: float, *, seed: int, stream: str = "arrivals") -> Iterator[float]:
    """Endless send offsets (s) of Poisson arrivals at `rate` per second; the first is at 0."""
    if rate <= 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be positive and finite, got {rate}")
    rng = _rng(seed, stream)
    t = 0.0
    while True:
        yield t
        t += float(rng.exponential(1.0 / rate))


def poisson_arrivals(n: int, rate: float, *, seed: int, stream: str = "arrivals") -> list[float]:
    """The first `n` offsets of `iter_poisson_arrivals(...)`."""
    return list(itertools.islice(iter_poisson_arrivals(rate, seed=seed, stream=stream), n))


def tpot(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (out - 1); None for out <= 1."""
    if output_tokens <= 1:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


@attrs.frozen(kw_only=True)
class RequestRecord:
    """What happened to one request. `start_s` is the send time relative to the run's start."""

    cls: str
    index: int
    input_len: int
    output_len: int  # requested
    ok: bool
    start_s: float
    error: str | None = None
    # The client gave up on it after its timeout; `ttft_s` is kept when its first token came.
    abandoned: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: tuple[float, ...] = ()
    prompt_tokens: int | None = None  # from usage
    output_tokens: int = 0  # from usage when the server sent it, else counted
    # Server-side phase timings (`--perf-metrics`): perf_metrics flattened, "ctx.queue_s" etc.
    phases: dict[str, float] = attrs.Factory(dict)

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None:
            return None
        return tpot(self.e2e_s, self.ttft_s, self.output_tokens)

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["itl_s"] = [round(x, 6) for x in self.itl_s]
        out["tpot_s"] = self.tpot_s
        return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@attrs.frozen(kw_only=True)
class LatencyStats:
    """Milliseconds. Every field is None when there were no samples."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> LatencyStats:
        if not values:
            return cls(count=0, mean=None, p50=None, p90=None, p99=None, max=None)
        ms = [v * 1e3 for v in values]
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(count=len(ms), mean=sum(ms) / len(ms), p50=p50, p90=p90, p99=p99, max=max(ms))


@attrs.frozen(kw_only=True)
class Slo:
    """Per-request service-level objectives in milliseconds; None means unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def active(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met_by(self, record: RequestRecord) -> bool:
        """A failed request never meets an SLO; a one-token answer has no TPOT to violate."""
        if not record.ok or record.ttft_s is None:
            return False
        if self.ttft_ms is not None and record.ttft_s * 1e3 > self.ttft_ms:
            return False
        t = record.tpot_s
        return self.tpot_ms is None or t is None or t * 1e3 <= self.tpot_ms


@attrs.frozen(kw_only=True)
class Goodput:
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    good: int
    fraction: float  # of all measured requests, failed ones included
    rate: float  # good requests per second of the run


def goodput(records: Sequence[RequestRecord], slo: Slo, duration_s: float) -> Goodput:
    good = sum(slo.met_by(r) for r in records)
    return Goodput(
        slo_ttft_ms=slo.ttft_ms,
        slo_tpot_ms=slo.tpot_ms,
        good=good,
        fraction=good / len(records) if records else 0.0,
        rate=good / duration_s if duration_s > 0 else 0.0,
    )


@attrs.frozen(kw_only=True)
class ClassSummary:
    """Aggregates over one request class of one run. Throughputs are per second of `duration_s`."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    output_len_mismatch: int  # completed requests whose token count differs from the request
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    goodput: Goodput | None
    first_error: str | None
    phases_ms: dict[str, LatencyStats] = attrs.Factory(dict)


def summarize(records: Sequence[RequestRecord], *, duration_s: float, slo: Slo) -> ClassSummary:
    """Statistics of `records` (one class, warm-up excluded) over a run of `duration_s`."""
    done = [r for r in records if r.ok]
    errors = [r.error for r in records if not r.ok]
    n_in = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in done)
    n_out = sum(r.output_tokens for r in done)

    def per_s(x: float) -> float:
        return x / duration_s if duration_s > 0 else 0.0

    return ClassSummary(
        completed=len(done),
        failed=len(errors),
        duration_s=duration_s,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=per_s(len(done)),
        input_throughput=per_s(n_in),
        output_throughput=per_s(n_out),
        total_token_throughput=per_s(n_in + n_out),
        output_len_mismatch=sum(r.output_tokens != r.output_len for r in done),
        ttft_ms=LatencyStats.of_seconds([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=LatencyStats.of_seconds([t for r in done if (t := r.tpot_s) is not None]),
        itl_ms=LatencyStats.of_seconds([x for r in done for x in r.itl_s]),
        e2e_ms=LatencyStats.of_seconds([r.e2e_s for r in done if r.e2e_s is not None]),
        goodput=goodput(records, slo, duration_s) if slo.active else None,
        first_error=errors[0] if errors else None,
        phases_ms={
            name: LatencyStats.of_seconds([r.phases[name] for r in done if name in r.phases])
            for name in dict.fromkeys(n for r in done for n in r.phases)
        },
    )


def flatten_phases(perf: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """A perf_metrics object as {"ctx_s": .., "ctx.queue_s": ..}: every number ending in _s."""
    out: dict[str, float] = {}
    for key, value in perf.items():
        if isinstance(value, Mapping):
            out.update(flatten_phases(value, f"{prefix}{key}."))
        elif isinstance(value, int | float) and not isinstance(value, bool) and key.endswith("_s"):
            out[prefix + key] = float(value)
    return out


def summarize_by_class(
    records: Sequence[RequestRecord], *, duration_s: float, slo: Slo
) -> dict[str, ClassSummary]:
    """One summary per class in first-seen order, plus "all" when there is more than one class."""
    classes = list(dict.fromkeys(r.cls for r in records))
    out = {
        c: summarize([r for r in records if r.cls == c], duration_s=duration_s, slo=slo)
        for c in classes
    }
    if len(classes) != 1:
        out["all"] = summarize(records, duration_s=duration_s, slo=slo)
    return out


def read_rss_kib(pid: int) -> int:
    """VmRSS of `pid` in KiB, from /proc/PID/status (a procfs read: microseconds, never blocks)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"/proc/{pid}/status has no VmRSS line (a zombie or kernel thread?)")


@attrs.frozen(kw_only=True)
class RssSummary:
    pid: int
    start_kib: int | None  # before the first request
    peak_kib: int | None
    at_checkpoint_kib: int | None  # after the RSS_CHECKPOINT-th completed request
    end_kib: int | None
    growth_checkpoint_to_end: float | None  # (end - checkpoint) / checkpoint
    samples: tuple[tuple[int, int], ...]  # (completed requests, KiB), warm-up included


def summarize_rss(pid: int, samples: Sequence[tuple[int, int]]) -> RssSummary:
    at_cp = next((kib for n, kib in samples if n == RSS_CHECKPOINT), None)
    end = samples[-1][1] if samples else None
    growth = (end - at_cp) / at_cp if at_cp and end is not None else None
    return RssSummary(
        pid=pid,
        start_kib=next((kib for n, kib in samples if n == 0), None),
        peak_kib=max((kib for _, kib in samples), default=None),
        at_checkpoint_kib=at_cp,
        end_kib=end,
        growth_checkpoint_to_end=growth,
        samples=tuple(samples),
    )


def result_document(
    *,
    tool: str,
    label: str,
    config: Mapping[str, Any],
    summary: Mapping[str, ClassSummary],
    records: Iterable[RequestRecord],
    rss: RssSummary | None = None,
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "tool": tool,
        "label": label,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": dict(config),
        "summary": {name: attrs.asdict(s) for name, s in summary.items()},
        "records": [r.to_json() for r in records],
        "rss": None if rss is None else attrs.asdict(rss),
    }


def write_result(path: Path, document: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")


def load_result(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {doc.get('schema')!r}, expected {SCHEMA!r}")
    return doc


_COLUMNS: Final = ("mean", "p50", "p90", "p99", "max")


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_summary(title: str, summary: Mapping[str, ClassSummary]) -> str:
    """The human-readable table printed on stdout."""
    lines = [f"{f' {title} ':=^64}"]
    for name, s in summary.items():
        if len(summary) > 1:
            lines.append(f"{f' class: {name} ':-^64}")
        lines += [
            f"{'requests completed / failed':<34}{s.completed} / {s.failed}",
            f"{'duration (s)':<34}{s.duration_s:.2f}",
            f"{'input / output tokens':<34}{s.total_input_tokens} / {s.total_output_tokens}",
            f"{'request throughput (req/s)':<34}{s.request_throughput:.2f}",
            f"{'output throughput (tok/s)':<34}{s.output_throughput:.1f}",
            f"{'total throughput (tok/s)':<34}{s.total_token_throughput:.1f}",
        ]
        if s.output_len_mismatch:
            lines.append(f"{'output length != requested':<34}{s.output_len_mismatch} requests")
        if s.goodput is not None:
            g = s.goodput
            slo = f"TTFT <= {_fmt(g.slo_ttft_ms, 0)} ms, TPOT <= {_fmt(g.slo_tpot_ms, 0)} ms"
            lines.append(f"{'goodput':<34}{g.fraction:.1%}, {g.rate:.2f} req/s ({slo})")
        lines.append(f"{'latency (ms)':<14}" + "".join(f"{h:>10}" for h in _COLUMNS))
        rows = (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2E", s.e2e_ms))
        for key, stats in rows:
            cells = (stats.mean, stats.p50, stats.p90, stats.p99, stats.max)
            lines.append(f"{key:<14}" + "".join(f"{_fmt(c):>10}" for c in cells))
        if s.phases_ms:
            lines.append("server phases (ms, from perf_metrics)")
            for key, stats in s.phases_ms.items():
                cells = (stats.mean, stats.p50, stats.p90, stats.p99, stats.max)
                lines.append(f"  {key:<22}" + "".join(f"{_fmt(c):>10}" for c in cells))
        if s.first_error:
            lines.append(f"first error: {s.first_error}")
    lines.append("=" * 64)
    return "\n".join(lines)


@attrs.define(eq=False, kw_only=True)
class ProgressBar:
    """A one-line text progress bar on stderr; elsewhere a line per tenth of the run or per 10 s.

    `total` counts requests; None means the run ends on time (`duration_s`) instead.
    """

    total: int | None
    duration_s: float | None = None
    label: str = ""
    stream: TextIO = attrs.field(factory=lambda: sys.stderr)
    width: int = 30
    _start: float = attrs.field(init=False, factory=time.monotonic)
    _last_draw: float = attrs.field(init=False, default=0.0)
    _last_tenth: int = attrs.field(init=False, default=-1)
    _last_done: int = attrs.field(init=False, default=-1)

    def fraction(self, done: int, now: float) -> float:
        if self.total:
            return min(1.0, done / self.total)
        if self.duration_s:
            return min(1.0, (now - self._start) / self.duration_s)
        return 0.0

    def render(self, done: int, failed: int, now: float) -> str:
        frac = self.fraction(done, now)
        filled = int(frac * self.width)
        elapsed = now - self._start
        rate = done / elapsed if elapsed > 0 else 0.0
        of = f"/{self.total}" if self.total else ""
        return (
            f"{self.label}[{'#' * filled}{'.' * (self.width - filled)}] {done}{of} done, "
            f"{failed} failed, {rate:.2f} req/s, {elapsed:.1f}s"
        )

    def update(self, done: int, failed: int, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.stream.isatty():
            if force or now - self._last_draw >= 0.1:
                self._last_draw = now
                self.stream.write("\r" + self.render(done, failed, now) + "\x1b[K")
                self.stream.flush()
            return
        tenth = int(self.fraction(done, now) * 10)
        if force or tenth > self._last_tenth or now - self._last_draw >= 10.0:
            self._last_tenth = max(tenth, self._last_tenth)
            self._last_draw = now
            self._last_done = done
            self.stream.write(self.render(done, failed, now) + "\n")
            self.stream.flush()

    def close(self, done: int, failed: int) -> None:
        if not self.stream.isatty():
            if done != self._last_done:
                self.update(done, failed, force=True)
            return
        self.update(done, failed, force=True)
        self.stream.write("\n")
        self.stream.flush()
