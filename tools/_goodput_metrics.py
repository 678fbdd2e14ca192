"""Prometheus text from the servers' /metrics, and what one goodput point saw in it. Pure.

`bench_goodput.py` scrapes every process (workers "ctx-0", "gen-1", ..., and "coordinator")
before, during and after each point; `observe` turns the scrapes into the point's `Observed`:
peak KV use and queue depth per worker, preemptions, mean KV write time, the event loops' lag
(p99, from the histogram's buckets) and the share of requests gen served alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from _goodput_core import Observed

# ---- Prometheus text ----

Scrape = dict[str, dict[str, float]]  # metric name -> {label text: value}

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LE = re.compile(r'le="([^"]*)"')


def parse_prometheus(text: str) -> Scrape:
    out: Scrape = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m[3])
        except ValueError:
            continue
        out.setdefault(m[1], {})[m[2] or ""] = value
    return out


def total(scrape: Scrape, name: str) -> float | None:
    series = scrape.get(name)
    return None if series is None else sum(series.values())


def delta(after: Scrape, before: Scrape) -> Scrape:
    """Counter and histogram increments between two scrapes of one process."""
    return {
        name: {k: v - before.get(name, {}).get(k, 0.0) for k, v in series.items()}
        for name, series in after.items()
    }


def histogram_quantile(scrape: Scrape, name: str, q: float) -> float | None:
    """The q-quantile of histogram `name` (its `_bucket` series), interpolated inside the
    bucket as Prometheus does; a quantile in the +Inf bucket reads as the last finite bound.
    Labels other than `le` are summed over."""
    cumulative: dict[float, float] = {}
    for labels, value in scrape.get(name + "_bucket", {}).items():
        m = _LE.search(labels)
        if m is not None:
            le = float(m[1])
            cumulative[le] = cumulative.get(le, 0.0) + value
    bounds = sorted(cumulative.items())
    if not bounds or bounds[-1][1] <= 0:
        return None
    rank = q * bounds[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in bounds:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


# ---- what the servers showed ----


def observe(
    *,
    before: Mapping[str, Scrape],
    after: Mapping[str, Scrape],
    samples: Sequence[Mapping[str, Scrape]],
    client_lags_s: Sequence[float],
    scrape_errors: int = 0,
    idle_after_s: float | None = None,
) -> Observed:
    """One point's `Observed` from scrapes of every process ("ctx-0", "gen-1", "coordinator")
    taken before it, during it (`samples`) and after it, and the client's own loop lags."""
    workers = [p for p in after if p != "coordinator"]
    kv_peak: dict[str, float] = {}
    waiting_peak: dict[str, float] = {}
    waiting_sum: dict[str, float] = {}
    waiting_n: dict[str, int] = {}
    for sample in samples:
        for w in workers:
            s = sample.get(w)
            if s is None:
                continue
            blocks = total(s, "trtdisagg_kv_cache_total_blocks")
            free = total(s, "trtdisagg_kv_cache_free_blocks")
            if blocks and free is not None:
                # Blocks kept only as prefix cache are evictable: not pressure.
                held = blocks - free - (total(s, "trtdisagg_kv_cache_reusable_blocks") or 0.0)
                kv_peak[w] = max(kv_peak.get(w, 0.0), held / blocks)
            waiting = total(s, "trtdisagg_requests_waiting")
            if waiting is not None:
                waiting_peak[w] = max(waiting_peak.get(w, 0.0), waiting)
                waiting_sum[w] = waiting_sum.get(w, 0.0) + waiting
                waiting_n[w] = waiting_n.get(w, 0) + 1
    moved = {p: delta(after[p], before.get(p, {})) for p in after}
    preemptions = {
        w: v for w in workers if (v := total(moved[w], "trtdisagg_preemptions_total")) is not None
    }
    writes: Scrape = {}  # every worker's KV write-time histogram, summed
    for w in workers:
        for name, series in moved[w].items():
            if name.startswith("trtdisagg_kv_transfer_seconds"):
                into = writes.setdefault(name, {})
                for labels, value in series.items():
                    into[labels] = into.get(labels, 0.0) + value
    seconds = total(writes, "trtdisagg_kv_transfer_seconds_sum") or 0.0
    count = total(writes, "trtdisagg_kv_transfer_seconds_count") or 0.0
    write_p90 = histogram_quantile(writes, "trtdisagg_kv_transfer_seconds", 0.9)
    lag_ms: dict[str, dict[str, float]] = {}
    for process, scrape in moved.items():
        quantiles = {
            f"p{round(q * 100)}": histogram_quantile(scrape, "trtdisagg_event_loop_lag_seconds", q)
            for q in (0.9, 0.99)
        }
        if all(v is not None for v in quantiles.values()):
            lag_ms[process] = {k: round(v * 1e3, 3) for k, v in quantiles.items() if v is not None}
    if client_lags_s:
        ordered = sorted(client_lags_s)
        lag_ms["client"] = {
            f"p{round(q * 100)}": round(ordered[int(q * (len(ordered) - 1))] * 1e3, 3)
            for q in (0.9, 0.99)
        }
    coordinator = moved.get("coordinator", {})
    local = total(coordinator, "trtdisagg_coordinator_local_prefill_total")
    finished = total(coordinator, "trtdisagg_requests_total")
    return Observed(
        kv_peak_fraction={w: round(f, 4) for w, f in kv_peak.items()},
        waiting_peak=waiting_peak,
        waiting_mean={w: round(s / waiting_n[w], 3) for w, s in waiting_sum.items()},
        preemptions=preemptions,
        transfer_mean_ms=round(1e3 * seconds / count, 3) if count else None,
        transfer_p90_ms=None if write_p90 is None else round(write_p90 * 1e3, 3),
        loop_lag_ms=lag_ms,
        local_prefill_share=round(local / finished, 4) if local is not None and finished else None,
        scrape_errors=scrape_errors,
        idle_after_s=idle_after_s,
    )
