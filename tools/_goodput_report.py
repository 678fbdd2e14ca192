"""The goodput summary: points of one or several runs merged, results per mode, table, plots.

`summary_document` is what `bench_goodput.py` writes as goodput_summary.json after every point;
`points_of` reads one back, so `bench_goodput.py report` can merge the summaries of runs split
over several device calls (a later point of the same workload, mode and rate replaces an
earlier one). Everything but `plot` is pure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import cattrs
from _goodput_core import (
    BASELINE,
    RESOURCES,
    SCHEMA,
    TARGET,
    MaxRate,
    Point,
    Ratio,
    Workload,
    dominant,
    first_saturated,
    max_rate,
    ratio,
)

_converter = cattrs.Converter()


@attrs.frozen(kw_only=True)
class ModeResult:
    mode: str
    gpus: int
    rates: tuple[float, ...]  # measured, ascending
    max_rate: MaxRate  # req/s over the cluster
    per_gpu: MaxRate
    vs_baseline: Ratio | None  # per GPU, this mode / the baseline mode
    saturates_first: tuple[str, float] | None  # (indicator, rate)


def merge(runs: Iterable[Iterable[Point]]) -> list[Point]:
    """All points, a later one replacing an earlier one of the same workload, mode and rate."""
    out: dict[tuple[str, str, float], Point] = {}
    for points in runs:
        for p in points:
            out[p.key] = p
    return sorted(out.values(), key=lambda p: (p.workload, p.mode, p.rate))


def results(points: Sequence[Point], target: float = TARGET) -> dict[str, dict[str, ModeResult]]:
    """workload -> mode -> its result; modes in the order first seen."""
    out: dict[str, dict[str, ModeResult]] = {}
    for workload in dict.fromkeys(p.workload for p in points):
        mine = [p for p in points if p.workload == workload]
        per_mode: dict[str, ModeResult] = {}
        for mode in dict.fromkeys(p.mode for p in mine):
            curve = sorted((p for p in mine if p.mode == mode), key=lambda p: p.rate)
            gpus = max(p.gpus for p in curve)
            found = max_rate(((p.rate, p.attainment) for p in curve), target)
            per_mode[mode] = ModeResult(
                mode=mode,
                gpus=gpus,
                rates=tuple(p.rate for p in curve),
                max_rate=found,
                per_gpu=found.per(gpus),
                vs_baseline=None,
                saturates_first=first_saturated(curve),
            )
        base = per_mode.get(BASELINE)
        if base is not None:
            for mode, r in per_mode.items():
                if mode != BASELINE:
                    per_mode[mode] = attrs.evolve(r, vs_baseline=ratio(r.per_gpu, base.per_gpu))
        out[workload] = per_mode
    return out


def unstructure_point(point: Point) -> dict[str, Any]:
    out: dict[str, Any] = _converter.unstructure(point)
    return out


def workload_json(workloads: Mapping[str, Workload]) -> dict[str, dict[str, Any]]:
    """What the table and the plots need of each workload (its lengths and SLOs)."""
    return {
        name: {
            "input_len": str(w.input_len),
            "output_len": str(w.output_len),
            "slo_ttft_ms": w.slo.ttft_ms,
            "slo_tpot_ms": w.slo.tpot_ms,
        }
        for name, w in workloads.items()
    }


def _ratio_json(r: Ratio | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {"text": str(r), "lo": r.lo, "hi": None if math.isinf(r.hi) else r.hi}


def summary_document(
    points: Sequence[Point],
    *,
    workloads: Mapping[str, Workload],
    runs: Sequence[Mapping[str, Any]],
    target: float = TARGET,
) -> dict[str, Any]:
    found = results(points, target)
    return {
        "schema": SCHEMA,
        "target": target,
        "runs": list(runs),
        "workloads": workload_json(workloads),
        "results": {
            workload: {
                mode: {
                    "gpus": r.gpus,
                    "rates": list(r.rates),
                    "max_rate": attrs.asdict(r.max_rate),
                    "max_rate_per_gpu": attrs.asdict(r.per_gpu),
                    f"per_gpu_vs_{BASELINE}": _ratio_json(r.vs_baseline),
                    "saturates_first": _saturation_json(r.saturates_first),
                }
                for mode, r in per_mode.items()
            }
            for workload, per_mode in found.items()
        },
        "points": [unstructure_point(p) for p in points],
    }


def _saturation_json(found: tuple[str, float] | None) -> dict[str, Any] | None:
    if found is None:
        return None
    name, rate = found
    return {"indicator": name, "resource": RESOURCES.get(name, name), "rate": rate}


def points_of(document: Mapping[str, Any]) -> list[Point]:
    if document.get("schema") != SCHEMA:
        raise ValueError(f"not a goodput summary: schema {document.get('schema')!r}")
    return [_converter.structure(p, Point) for p in document["points"]]


def workloads_of(document: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(document.get("workloads", {}))


# ---- the table ----


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _rate_text(m: MaxRate) -> str:
    if m.bound == "at_least":
        return f">= {_num(m.rate)}"
    if m.bound == "below_lowest":
        return f"< {_num(m.first_bad)}"
    return _num(m.rate)


def table(points: Sequence[Point], slos: Mapping[str, Mapping[str, Any]]) -> str:
    """Per workload: the result per mode, then every point."""
    lines: list[str] = []
    for workload, per_mode in results(points).items():
        slo = slos.get(workload, {})
        lines.append(
            f"== {workload}: TTFT <= {_num(slo.get('slo_ttft_ms'), 0)} ms, TPOT <= "
            f"{_num(slo.get('slo_tpot_ms'), 0)} ms; max rate with >= {TARGET:.0%} meeting both"
        )
        lines.append(
            f"{'mode':<18}{'GPUs':>5}{'req/s':>10}{'per GPU':>10}{'measured':>10}"
            f"{'vs ' + BASELINE:>16}  saturates first"
        )
        for mode, r in per_mode.items():
            sat = r.saturates_first
            why = "-" if sat is None else f"{RESOURCES.get(sat[0], sat[0])} at {sat[1]:g}"
            vs = "-" if r.vs_baseline is None else str(r.vs_baseline)
            lines.append(
                f"{mode:<18}{r.gpus:>5}{_rate_text(r.max_rate):>10}{_rate_text(r.per_gpu):>10}"
                f"{_num(r.max_rate.last_good):>10}{vs:>16}  {why}"
            )
        lines.append(
            f"{'mode':<18}{'rate':>7}{'attain':>8}{'TTFT p90':>10}{'TPOT p90':>10}"
            f"{'n':>6}  {'err/ttft/tpot/both':<20}top indicator"
        )
        for p in (p for p in points if p.workload == workload):
            v = p.violations
            misses = f"{v.error:.0%}/{v.ttft:.0%}/{v.tpot:.0%}/{v.both:.0%}"
            top = dominant(p)
            top_text = "-" if top is None else f"{top[0]} {top[1]:.2f}"
            lines.append(
                f"{p.mode:<18}{p.rate:>7g}{p.attainment:>8.0%}{_num(p.ttft_ms.get('p90'), 0):>10}"
                f"{_num(p.tpot_ms.get('p90'), 1):>10}{p.requests:>6}  {misses:<20}{top_text}"
            )
    return "\n".join(lines)


# ---- plots ----


def plot(
    points: Sequence[Point], slos: Mapping[str, Mapping[str, Any]], out_dir: Path
) -> list[Path]:
    """goodput_<workload>.png: SLO attainment against the rate per GPU, one line per mode, the
    target and each mode's max rate marked; beside it p90 TTFT and TPOT as shares of their
    SLOs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for workload, per_mode in results(points).items():
        fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
        slo = slos.get(workload, {})
        for i, (mode, r) in enumerate(per_mode.items()):
            color = f"C{i % 10}"
            curve = sorted(
                (p for p in points if p.workload == workload and p.mode == mode),
                key=lambda p: p.rate,
            )
            xs = [p.rate / r.gpus for p in curve]
            left.plot(xs, [p.attainment for p in curve], "-o", ms=4, color=color, label=mode)
            if r.per_gpu.bound == "interpolated" and r.per_gpu.rate is not None:
                left.axvline(r.per_gpu.rate, color=color, ls=":", lw=1)
            for key, style, metric in (
                ("slo_ttft_ms", "-o", "ttft_ms"),
                ("slo_tpot_ms", "--s", "tpot_ms"),
            ):
                bound = slo.get(key)
                pairs = [(x, getattr(p, metric).get("p90")) for x, p in zip(xs, curve)]
                shown = [(x, y / bound) for x, y in pairs if y is not None and bound]
                if shown:
                    right.plot(
                        *zip(*shown), style, ms=3, color=color, label=f"{mode} {metric[:4].upper()}"
                    )
        left.axhline(TARGET, color="k", ls="--", lw=1)
        left.set(
            title=f"{workload}: SLO attainment (dotted: max rate at {TARGET:.0%})",
            xlabel="request rate per GPU (req/s)",
            ylabel="share meeting both SLOs",
            ylim=(0, 1.05),
        )
        right.axhline(1.0, color="k", ls="--", lw=1)
        right.set(
            title="p90 latency / SLO (TTFT solid, TPOT dashed)",
            xlabel="request rate per GPU (req/s)",
            ylabel="share of the SLO",
        )
        right.set_yscale("log")
        for ax in (left, right):
            ax.grid(True, alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"goodput_{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
