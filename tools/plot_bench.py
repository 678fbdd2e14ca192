"""PNG plots from bench_serving / bench_hf_baseline result files.

Runs are grouped into lines by their "label" (`--label` of the bench; else the file name's stem),
so a sweep of runs labelled "aggregated" and one labelled "disaggregated" become two lines.

  latency_vs_concurrency.png   closed-loop runs: TTFT, TPOT, ITL, E2E (p50 solid, p90 dotted,
                               p99 dashed) and output throughput, against --concurrency
  mixed_tpot.png               mixed runs: short-class TPOT p50/p99 against the long-prompt rate
  mixed_ttft.png               mixed runs: TTFT p50/p99 of each class against the long-prompt rate
  goodput_vs_rate.png          runs with SLOs: goodput (req/s and fraction) against the request
                               rate (open loop) or the long-prompt rate (mixed)

A plot with no matching runs is skipped.

    python tools/plot_bench.py out/*.json --out-dir docs/img
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

from _bench_common import load_result

Doc = dict[str, Any]
Series = dict[str, list[tuple[float, float]]]  # label -> sorted (x, y) points

PCT_STYLE: Final = {"p50": "-", "p90": ":", "p99": "--"}


def label_of(doc: Doc, path: Path) -> str:
    return str(doc.get("label") or path.stem)


def is_closed_loop(doc: Doc) -> bool:
    c = doc["config"]
    return not c.get("mixed") and c.get("request_rate") is None and bool(c.get("concurrency"))


def is_mixed(doc: Doc) -> bool:
    return bool(doc["config"].get("mixed"))


def rate_of(doc: Doc) -> float | None:
    """The x of a rate plot: the long-prompt rate of a mixed run, else the request rate."""
    c = doc["config"]
    value = c.get("long_rate") if c.get("mixed") else c.get("request_rate")
    return None if value is None else float(value)


def stat(doc: Doc, cls: str, metric: str, key: str) -> float | None:
    """summary[cls][metric][key], e.g. stat(doc, "short", "tpot_ms", "p99"); None if absent."""
    node: Any = doc["summary"].get(cls)
    for part in (metric, key):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return None if node is None else float(node)


def stat_of(cls: str, metric: str, key: str) -> Callable[[Doc], float | None]:
    return lambda doc: stat(doc, cls, metric, key)


def series(
    labelled: Iterable[tuple[str, Doc]],
    x: Callable[[Doc], float | None],
    y: Callable[[Doc], float | None],
) -> Series:
    """Points per label, sorted by x; runs where x or y is missing are left out."""
    out: Series = {}
    for label, doc in labelled:
        xv, yv = x(doc), y(doc)
        if xv is not None and yv is not None:
            out.setdefault(label, []).append((xv, yv))
    return {label: sorted(points) for label, points in out.items()}


def _draw(ax: Any, data: Series, style: str, colors: dict[str, str], *, legend: bool) -> None:
    """One line per label in the label's color; only lines drawn with `legend` get an entry, so
    a legend lists runs and the figure's title explains the line styles."""
    for label, points in data.items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, style, marker="o", markersize=3, color=colors[label],
                label=label if legend else None)  # fmt: skip


def _colors(labels: Iterable[str]) -> dict[str, str]:
    cycle = [f"C{i}" for i in range(10)]
    return {label: cycle[i % len(cycle)] for i, label in enumerate(dict.fromkeys(labels))}


def _finish(fig: Any, axes: Sequence[Any], path: Path, styles: str = "") -> Path:
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        if ax.has_data():
            ax.legend(fontsize=7)
    if styles:
        fig.suptitle(styles, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def plot_concurrency(plt: Any, runs: list[tuple[str, Doc]], out: Path) -> Path | None:
    runs = [(lb, d) for lb, d in runs if is_closed_loop(d) and "all" in d["summary"]]
    if not runs:
        return None
    colors = _colors(lb for lb, _ in runs)
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    flat = list(axes.flat)

    def conc(d: Doc) -> float:
        return float(d["config"]["concurrency"])

    for ax, metric, title in zip(flat, ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"),
                                 ("TTFT", "TPOT", "ITL", "E2E")):  # fmt: skip
        for pct, style in PCT_STYLE.items():
            data = series(runs, conc, stat_of("all", metric, pct))
            _draw(ax, data, style, colors, legend=pct == "p50")
        ax.set(title=f"{title} (ms)", xlabel="concurrency", ylabel="ms")
    tput = series(runs, conc, lambda d: float(d["summary"]["all"]["output_throughput"]))
    _draw(flat[4], tput, "-", colors, legend=True)
    flat[4].set(title="output throughput", xlabel="concurrency", ylabel="tokens/s")
    rps = series(runs, conc, lambda d: float(d["summary"]["all"]["request_throughput"]))
    _draw(flat[5], rps, "-", colors, legend=True)
    flat[5].set(title="request throughput", xlabel="concurrency", ylabel="requests/s")
    xs = [conc(d) for _, d in runs]
    if max(xs) >= 4 * min(xs):  # a doubling sweep reads best on a log2 axis
        from matplotlib.ticker import ScalarFormatter

        for ax in flat:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(set(xs)))
            ax.xaxis.set_major_formatter(ScalarFormatter())
    styles = "latency: p50 solid, p90 dotted, p99 dashed"
    return _finish(fig, flat, out / "latency_vs_concurrency.png", styles)


def plot_mixed(plt: Any, runs: list[tuple[str, Doc]], out: Path) -> list[Path]:
    runs = [(lb, d) for lb, d in runs if is_mixed(d)]
    if not runs:
        return []
    colors = _colors(lb for lb, _ in runs)
    fig, ax = plt.subplots(figsize=(7, 5))
    for pct in ("p50", "p99"):
        data = series(runs, rate_of, stat_of("short", "tpot_ms", pct))
        _draw(ax, data, PCT_STYLE[pct], colors, legend=pct == "p50")
    ax.set(title="short requests: TPOT vs long-prompt load", xlabel="long-prompt rate (req/s)",
           ylabel="TPOT (ms)")  # fmt: skip
    styles = "p50 solid, p99 dashed"
    paths = [_finish(fig, [ax], out / "mixed_tpot.png", styles)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, cls in zip(axes, ("short", "long")):
        for pct in ("p50", "p99"):
            data = series(runs, rate_of, stat_of(cls, "ttft_ms", pct))
            _draw(ax, data, PCT_STYLE[pct], colors, legend=pct == "p50")
        ax.set(title=f"{cls} requests: TTFT", xlabel="long-prompt rate (req/s)", ylabel="ms")
    paths.append(_finish(fig, list(axes), out / "mixed_ttft.png", styles))
    return paths


def plot_goodput(plt: Any, runs: list[tuple[str, Doc]], out: Path) -> Path | None:
    # A label may hold both open-loop and mixed runs: their x axes mean different rates.
    runs = [(f"{lb} (mixed)" if is_mixed(d) else lb, d) for lb, d in runs if rate_of(d) is not None]
    rate = series(runs, rate_of, stat_of("all", "goodput", "rate"))
    if not rate:
        return None
    frac = series(runs, rate_of, stat_of("all", "goodput", "fraction"))
    colors = _colors(rate)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    _draw(axes[0], rate, "-", colors, legend=True)
    _draw(axes[1], frac, "-", colors, legend=True)
    xlabel = "request rate, or long-prompt rate for mixed runs (req/s)"
    axes[0].set(title="goodput (requests meeting every SLO)", xlabel=xlabel, ylabel="req/s")
    axes[1].set(title="SLO attainment", xlabel=xlabel, ylabel="fraction", ylim=(0, 1.05))
    return _finish(fig, list(axes), out / "goodput_vs_rate.png")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("results", nargs="+", type=Path, help="result JSON files")
    p.add_argument("--out-dir", type=Path, default=Path("docs/img"))
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for path in args.results:
        doc = load_result(path)
        runs.append((label_of(doc, path), doc))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    written = [
        plot_concurrency(plt, runs, args.out_dir),
        *plot_mixed(plt, runs, args.out_dir),
        plot_goodput(plt, runs, args.out_dir),
    ]
    made = [path for path in written if path is not None]
    for path in made:
        print(path)
    if not made:
        print("plot_bench: no run matched any plot", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
