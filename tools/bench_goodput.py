"""Goodput at SLO: the highest Poisson request rate at which 90 % of requests meet both their
TTFT and TPOT objectives, per GPU, for each serving mode on the same GPUs.

`run`: for each mode it starts the mode's cluster file (conf/gpu, chosen by --conf-set) with
`python -m trtdisagg up`, then for each workload warms the cluster up and measures one point per
rate: open-loop Poisson arrivals for --point-s seconds through bench_serving.py's machinery (in
this process), every request streamed with its server phase timings. The rates go up the list
until two points in a row fall below --stop-below, then --refine points bisect the bracket where
the curve crosses 90 %. While a point runs, every process's /metrics is scraped (queues, KV use,
KV write time, event-loop lag) and this process times its own loop, so each point says which
resource ran out first (`_goodput_core.indicators`). Modes:

  aggregated        two workers, each serving whole requests (the coordinator's aggregated mode)
  disagg            1 ctx + 1 gen, context-first
  generation_first  the same, the gen leg posted with the ctx leg
  conditional       the same, prompts up to 1024 uncached tokens served by gen alone

Workloads (--workloads): chat, prompt U(256, 2048), output U(64, 512), TTFT <= 2 s, TPOT <= 50
ms; long, prompt U(4k, 16k), output U(128, 512), TTFT <= 6 s, TPOT <= 50 ms. A request is
abandoned once it can no longer meet both SLOs (TTFT SLO + (longest output - 1) x TPOT SLO,
+ 5 s), which changes no request's verdict and bounds the drain after an overloaded point; the
table's err/ttft/tpot/both counts it late (on TTFT without a first token in time, else TPOT),
not as an error: errors are answers or connections that failed.

Rates are requests per second over the whole cluster (--rates 4,8,12 for every workload, or
--rates chat=4,8,12 --rates long=1,2). --budget bounds the whole run (a point that would not fit
is skipped, and says so), so a call fits the device tool's 10 minutes; split the work over calls
with --modes, --workloads and --rates, and merge the calls' summaries with `report`.

Files in --out (default $OUT, else ./goodput_out), rewritten after every point:
goodput_summary.json (every point, the max rate per mode and per GPU, the ratio to aggregated,
what saturates first), goodput_table.txt (the table printed last), goodput_<workload>.png (the
attainment curves) and goodput_points.tar.gz (each point's bench_serving result file, the
generated cluster files and the processes' logs).

    python3 tools/bench_goodput.py run --workloads chat --modes aggregated,disagg   # 2 x H200
    python tools/bench_goodput.py run --cpu-smoke --out /tmp/goodput               # tiny, CPU
    python tools/bench_goodput.py report --out docs/img/goodput call1/goodput_summary.json ...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import _bench_common as bc
import _goodput_report as report
import attrs
import bench_serving as bs
import trio
import yaml
from _goodput_core import CONF_SETS, WORKLOADS, Point, Workload, gpus_of, next_rate
from _goodput_point import Watch, bench_config, measure, point_of
from headline import nvidia_smi, running_cluster, server_infos, worker_urls

from trtdisagg.free_ports import free_port

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = REPO / "conf" / "gpu"
STOP_RESERVE_S = 20.0  # stopping a cluster, and writing the files
WARMUP_CONCURRENCY = 4


# ---- the cluster ----


def cluster_file(stem: str, args: argparse.Namespace, run_dir: Path) -> tuple[Path, dict[str, Any]]:
    """conf/gpu/<stem>.yaml with this run's log dir, model and (--cpu-smoke) CPU settings."""
    data = yaml.safe_load((CONF_DIR / f"{stem}.yaml").read_text())
    data = {k: v for k, v in data.items() if not str(k).startswith("x-")}
    data["log_dir"] = str(run_dir / "logs")
    data["health_timeout"] = args.start_timeout
    for worker in [*data.get("ctx", []), *data.get("gen", [])]:
        if args.model:
            worker["model"] = args.model
        if args.cpu_smoke:  # others' tests may hold the file's ports here
            worker.update(
                device="cpu", dtype="float32", max_seq_len=4096, cpu_threads=1, port=free_port()
            )
            worker["kv_cache_config"] = {"tokens_per_block": 16, "max_tokens": 32768}
            if "cache_transceiver_config" in worker:  # a progress thread would spin a core
                transfer = {**worker["cache_transceiver_config"], "nixl_progress_thread": False}
                worker["cache_transceiver_config"] = transfer
    if args.cpu_smoke:
        data["coordinator"]["port"] = free_port()
    path = run_dir / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, data


# ---- the run ----


@attrs.define(eq=False, kw_only=True)
class Run:
    """One invocation: its settings, its clock, and everything measured so far."""

    args: argparse.Namespace
    workloads: dict[str, Workload]
    rates: dict[str, tuple[float, ...]]
    work: Path
    out: Path
    deadline: float
    meta: dict[str, Any]
    points: list[Point] = attrs.Factory(list)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        doc = report.summary_document(self.points, workloads=self.workloads, runs=[self.meta])
        text = json.dumps(doc, indent=1) + "\n"
        (self.work / "goodput_summary.json").write_text(text)
        (self.out / "goodput_summary.json").write_text(text)
        table = report.table(self.points, doc["workloads"])
        (self.out / "goodput_table.txt").write_text(table + "\n")
        tmp = self.out / ".goodput_points.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(self.work, arcname="goodput")
        tmp.rename(self.out / "goodput_points.tar.gz")


@attrs.frozen(kw_only=True)
class Serving:
    """A running cluster of one mode, as a sweep sees it."""

    mode: str
    url: str  # the coordinator
    processes: dict[str, str]  # every process's base url, for /metrics: ctx-0, ..., coordinator
    gpus: int
    vocab: int
    run_dir: Path  # its point files go here
    entry: dict[str, Any]  # its part of the run's record


def sweep(run: Run, serving: Serving, workload: Workload) -> None:
    """Warm up, then measure the rates `next_rate` picks until it stops or the budget does."""
    args, mode, url, vocab = run.args, serving.mode, serving.url, serving.vocab
    base_seed = args.seed + 1_000_000 * list(WORKLOADS).index(workload.name)
    warm = bench_config(
        url,
        workload,
        vocab=vocab,
        seed=base_seed + 999_999,
        label="warmup",
        concurrency=WARMUP_CONCURRENCY,
        num_requests=args.warmup_requests,
    )
    t0 = time.monotonic()
    warm_result = trio.run(bs.run_benchmark, warm)
    failed = sum(not r.ok for r in warm_result.records)
    serving.entry.setdefault("warmup_s", {})[workload.name] = round(time.monotonic() - t0, 2)
    print(
        f"[{mode}/{workload.name}] warm-up: {len(warm_result.records)} requests, "
        f"{failed} failed, {time.monotonic() - t0:.1f} s",
        flush=True,
    )
    curve: list[tuple[float, float]] = []
    refine_left = args.refine
    planned = run.rates[workload.name]
    while (
        rate := next_rate(planned, curve, stop_below=args.stop_below, refine_left=refine_left)
    ) is not None:
        if rate not in planned:
            refine_left -= 1
        need = args.point_s + workload.request_timeout_s + STOP_RESERVE_S
        if run.left_s() < need:
            print(
                f"[{mode}/{workload.name}] rate {rate:g} skipped: {run.left_s():.0f} s left, "
                f"a point needs up to {need:.0f}",
                flush=True,
            )
            skipped = {"workload": workload.name, "rate": rate}
            serving.entry.setdefault("skipped", []).append(skipped)
            return
        seed = base_seed + round(rate * 1000)
        config = bench_config(
            url,
            workload,
            vocab=vocab,
            seed=seed,
            label=mode,
            request_rate=rate,
            num_requests=None,
            duration_s=args.point_s,
        )
        watch = Watch(urls=serving.processes, interval_s=args.sample_interval)
        measured = trio.run(measure, config, watch, args.idle_timeout)
        point, summary = point_of(
            workload, mode, rate, serving.gpus, seed, run.meta["run"], measured
        )
        doc = bc.result_document(
            tool="bench_goodput",
            label=mode,
            config=config.to_json(),
            summary={"all": summary},
            # Per-token gaps would make a point file tens of MB; the summary keeps their stats.
            records=[attrs.evolve(r, itl_s=()) for r in measured.result.records],
        )
        doc["goodput_point"] = report.unstructure_point(point)
        bc.write_result(serving.run_dir / f"{workload.name}_rate{rate:g}.json", doc)
        run.points.append(point)
        curve.append((rate, point.attainment))
        run.save()
        top = max(point.indicators.items(), key=lambda kv: kv[1], default=("-", 0.0))
        print(
            f"[{mode}/{workload.name}] rate {rate:g}: attainment {point.attainment:.1%} of "
            f"{point.requests}, TTFT p90 {point.ttft_ms['p90'] or 0:.0f} ms, TPOT p90 "
            f"{point.tpot_ms['p90'] or 0:.1f} ms, top {top[0]} {top[1]:.2f}",
            flush=True,
        )


def run_mode(run: Run, mode: str) -> None:
    args = run.args
    stem = CONF_SETS[args.conf_set][mode]
    entry: dict[str, Any] = {"conf": stem}
    run.meta["modes"][mode] = entry
    first = min(w.request_timeout_s for w in run.workloads.values())
    need = args.start_reserve + args.point_s + first + STOP_RESERVE_S
    if run.left_s() < need:
        entry["error"] = (
            f"skipped: {run.left_s():.0f} s left, a start and one point need {need:.0f}"
        )
        print(f"[{mode}] {entry['error']}", flush=True)
        return
    run_dir = run.work / mode
    run_dir.mkdir(parents=True, exist_ok=True)
    path, data = cluster_file(stem, args, run_dir)
    gpus = gpus_of(data)
    url = f"http://{data.get('host', '127.0.0.1')}:{data['coordinator']['port']}"
    urls = worker_urls(data)
    entry.update(gpus=gpus, cluster_file=str(path.relative_to(run.work)))
    t0 = time.monotonic()
    with running_cluster(path, run_dir / "up.log", args.start_timeout, url) as pids:
        entry["start_s"] = round(time.monotonic() - t0, 2)
        entry["pids"] = pids
        entry["workers"] = server_infos(urls)
        print(f"[{mode}] up in {entry['start_s']:.1f} s ({stem}, {gpus} GPUs)", flush=True)
        serving = Serving(
            mode=mode,
            url=url,
            processes={**urls, "coordinator": url},
            gpus=gpus,
            vocab=min(w["vocab_size"] for w in entry["workers"].values()),
            run_dir=run_dir,
            entry=entry,
        )
        for workload in run.workloads.values():
            sweep(run, serving, workload)
    entry["total_s"] = round(time.monotonic() - t0, 2)


# ---- the command line ----


def parse_rates(
    values: Sequence[str], workloads: Mapping[str, Workload]
) -> dict[str, tuple[float, ...]]:
    """`--rates 1,2` for every workload, `--rates chat=1,2` for one; later ones win."""
    out = {name: w.rates for name, w in workloads.items()}
    for value in values:
        name, _, listed = value.rpartition("=")
        try:
            rates = tuple(sorted(float(r) for r in listed.split(",") if r))
        except ValueError:
            rates = ()
        if not rates or any(not 0 < r < float("inf") for r in rates):
            raise ValueError(f"--rates {value!r}: give positive rates, e.g. 1,2,4")
        for target in [name] if name else list(out):
            if target not in out:
                raise ValueError(f"--rates {value!r}: no workload {target!r} in this run")
            out[target] = rates
    return out


def smoke_workloads() -> dict[str, Workload]:
    """The CPU smoke's tiny lengths (the SLOs stay: the code paths are what it checks)."""
    L = bc.LengthRange
    return {
        "chat": attrs.evolve(
            WORKLOADS["chat"], input_len=L(16, 64), output_len=L(4, 12), rates=(2.0, 4.0)
        ),
        "long": attrs.evolve(
            WORKLOADS["long"], input_len=L(128, 256), output_len=L(4, 8), rates=(1.0, 2.0)
        ),
    }


def cmd_run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    if args.cpu_smoke:
        args.model = "tiny"
        args.point_s, args.warmup_requests = min(args.point_s, 3.0), min(args.warmup_requests, 2)
        args.refine, args.start_reserve, args.sample_interval = 0, 20.0, 0.25
    known = smoke_workloads() if args.cpu_smoke else dict(WORKLOADS)
    names = [w for w in args.workloads.split(",") if w]
    modes = [m for m in args.modes.split(",") if m]
    files = CONF_SETS[args.conf_set]
    unknown = [w for w in names if w not in known] + [m for m in modes if m not in files]
    if unknown or not names or not modes:
        print(
            f"bench_goodput: no workload or mode {unknown} (modes of {args.conf_set}: "
            f"{', '.join(files)}; workloads: {', '.join(known)})",
            file=sys.stderr,
        )
        return 2
    workloads = {w: known[w] for w in names}
    try:
        rates = parse_rates(args.rates, workloads)
    except ValueError as error:
        print(f"bench_goodput: {error}", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="goodput-"))
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "run": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv[1:],
        "settings": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"
        },
        "rates": rates,
        "gpus": nvidia_smi("index,name,memory.total,driver_version", "gpu"),
        "modes": {},
    }
    run = Run(
        args=args,
        workloads=workloads,
        rates=rates,
        work=work,
        out=args.out,
        deadline=start + args.budget,
        meta=meta,
    )
    run.save()
    status = 0
    for mode in modes:
        try:
            run_mode(run, mode)
        except Exception as error:  # keep what the other modes measure
            status = 1
            run.meta["modes"].setdefault(mode, {})["error"] = f"{type(error).__name__}: {error}"
            print(f"[{mode}] failed: {type(error).__name__}: {error}", flush=True)
        run.save()
    run.meta["wall_s"] = round(time.monotonic() - start, 1)
    run.save()
    if args.work is None:  # a scratch dir of our own: the tarball in --out holds all of it
        shutil.rmtree(work, ignore_errors=True)
    slos = report.workload_json(workloads)
    for path in report.plot(run.points, slos, args.out):
        print(f"wrote {path}", file=sys.stderr)
    print(report.table(run.points, slos))
    return 1 if not run.points else status


def cmd_report(args: argparse.Namespace) -> int:
    docs = [json.loads(p.read_text()) for p in args.summaries]
    try:
        points = report.merge(report.points_of(d) for d in docs)
    except (ValueError, KeyError) as error:
        print(f"bench_goodput report: {error}", file=sys.stderr)
        return 2
    slos: dict[str, Any] = {}
    for d in docs:
        slos.update(report.workloads_of(d))
    args.out.mkdir(parents=True, exist_ok=True)
    doc = report.summary_document(points, workloads={}, runs=[r for d in docs for r in d["runs"]])
    doc["workloads"] = slos
    (args.out / "goodput_summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = report.table(points, slos)
    (args.out / "goodput_table.txt").write_text(text + "\n")
    for path in report.plot(points, slos, args.out):
        print(f"wrote {path}", file=sys.stderr)
    print(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(required=True)
    default_out = Path(os.environ.get("OUT") or "goodput_out")
    r = sub.add_parser("run", help="measure (see above)")
    r.set_defaults(func=cmd_run)
    r.add_argument("--out", type=Path, default=default_out)
    r.add_argument(
        "--work", type=Path, help="scratch for points and logs (default: a temp dir, removed)"
    )
    r.add_argument("--conf-set", choices=sorted(CONF_SETS), default="two_h200")
    r.add_argument("--modes", default="aggregated,disagg,generation_first,conditional")
    r.add_argument("--workloads", default="chat,long")
    r.add_argument("--rates", action="append", default=[], help='"R1,R2,.." or "WORKLOAD=R1,.."')
    r.add_argument("--point-s", type=float, default=45.0, help="seconds of arrivals per point")
    r.add_argument("--warmup-requests", type=int, default=8)
    r.add_argument(
        "--stop-below",
        type=float,
        default=0.75,
        help="a sweep stops after two points in a row below this attainment",
    )
    r.add_argument("--refine", type=int, default=1, help="bisecting points after the sweep")
    r.add_argument("--budget", type=float, default=570.0, help="seconds for the whole run")
    r.add_argument("--start-timeout", type=float, default=300.0)
    r.add_argument(
        "--start-reserve",
        type=float,
        default=90.0,
        help="seconds a cluster start is assumed to take when planning the budget",
    )
    r.add_argument(
        "--idle-timeout",
        type=float,
        default=30.0,
        help="seconds to wait after a point for the servers to go idle",
    )
    r.add_argument("--sample-interval", type=float, default=0.5, help="/metrics scrape period")
    r.add_argument("--model", help="override every worker's model")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny model on CPU, tiny lengths, 3 s points: checks the code paths",
    )
    rep = sub.add_parser("report", help="merge run summaries: table, plots, summary")
    rep.set_defaults(func=cmd_report)
    rep.add_argument("summaries", nargs="+", type=Path, help="goodput_summary.json files")
    rep.add_argument("--out", type=Path, default=default_out)
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
