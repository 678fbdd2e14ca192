"""The headline experiment: aggregated vs disaggregated serving of one model on the same GPUs.

For each mode (a cluster file in conf/gpu, started with `python -m trtdisagg up`), the script
warms the cluster up, then runs `tools/bench_serving.py --mixed` once per long-prompt rate: a
closed loop of short-prompt, long-output requests (decode-heavy) plus Poisson arrivals of long
prompts (prefill-heavy). While it runs it samples `nvidia-smi` (peak GPU memory per GPU and per
process) and every worker's /metrics (KV blocks in use, KV transfer bytes, seconds and
descriptors, preemptions).

    python3 tools/headline.py --out $OUT                     # the device run (2 x H200)
    python tools/headline.py --out /tmp/headline --cpu-smoke  # every code path, tiny, on CPU

Modes: `two_h200_aggregated` (one worker per GPU, each serving whole requests, behind the
coordinator's load balancer) and `two_h200_disagg` (ctx on GPU 0, gen on GPU 1); `one_h200`
(ctx and gen sharing GPU 0) runs too if named in --modes. `<mode>@generation_first` runs a mode
with the coordinator's `schedule_style` set (e.g. `--modes one_h200,one_h200@generation_first`
compares the two schedules on one GPU).

Two files go to --out: `headline.json` (the summary) and `headline.tar.gz` (every bench result
file, generated config and process log, from the scratch --work dir), both rewritten after
every point, so a run cut short still returns what it measured (and few files, for the device
tool's limit on what comes back).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from trtdisagg.free_ports import free_port

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "tools" / "bench_serving.py"
STOP_GRACE_S = 30.0


# ---- the cluster ----


def cluster_file(mode: str, args: argparse.Namespace, run_dir: Path) -> tuple[Path, dict[str, Any]]:
    """conf/gpu/<mode>.yaml with this run's model, log dir and (for --cpu-smoke) CPU settings.
    `<conf>@<schedule_style>` runs that file with the coordinator's schedule_style set."""
    name, _, style = mode.partition("@")
    data = yaml.safe_load((REPO / "conf" / "gpu" / f"{name}.yaml").read_text())
    if style:
        data["coordinator"]["schedule_style"] = style
    data = {k: v for k, v in data.items() if not str(k).startswith("x-")}
    data["log_dir"] = str(run_dir / "logs")
    data["health_timeout"] = args.start_timeout
    workers = [*data.get("ctx", []), *data.get("gen", [])]
    for worker in workers:
        worker["model"] = args.model
        if args.max_num_tokens:
            worker["max_num_tokens"] = args.max_num_tokens
        if args.cpu_smoke:
            worker.update(device="cpu", dtype="float32", max_seq_len=4096, cpu_threads=1)
            worker["kv_cache_config"] = {"tokens_per_block": 16, "max_tokens": 32768}
    coordinator = data["coordinator"]
    if args.cpu_smoke:  # the device machine runs nothing else; here, others' tests may
        coordinator["port"] = free_port()
        for worker in workers:
            worker["port"] = free_port()
    path = run_dir / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, data


@contextlib.contextmanager
def running_cluster(
    path: Path, log_path: Path, timeout: float, url: str
) -> Iterator[dict[str, int]]:
    """`up` in its own process group; yields {child name: pid} once the coordinator is healthy."""
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trtdisagg", "up", str(path)],
            stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                if proc.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"cluster exited with {proc.returncode}:\n{tail}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url + "/health").status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} not healthy after {timeout:g}s")
                time.sleep(0.25)
        text = log_path.read_text(errors="replace")
        yield {m[1]: int(m[2]) for m in re.finditer(r"started (\S+) \(pid (\d+)\)", text)}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


# ---- sampling: nvidia-smi and worker metrics ----


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled Prometheus samples (`name value`); labelled ones summed under their name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        with contextlib.suppress(ValueError):
            out[name] = out.get(name, 0.0) + float(value)
    return out


def nvidia_smi(query: str, kind: str) -> list[list[str]]:
    try:
        text = subprocess.run(
            ["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]


class Sampler:
    """A thread sampling GPU memory and the workers' KV use until `stop()`; peaks per window."""

    def __init__(self, worker_urls: dict[str, str], interval: float = 0.5) -> None:
        self.worker_urls = worker_urls
        self.interval = interval
        self.gpu_peak_mib: dict[str, float] = {}
        self.pid_peak_mib: dict[str, float] = {}
        self.used_blocks_peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def reset(self) -> dict[str, dict[str, float]]:
        """The peaks since the last reset, and start a new window."""
        out = {
            "gpu_memory_used_mib": dict(self.gpu_peak_mib),
            "process_memory_mib": dict(self.pid_peak_mib),
            "kv_blocks_used_peak": dict(self.used_blocks_peak),
        }
        self.gpu_peak_mib, self.pid_peak_mib, self.used_blocks_peak = {}, {}, {}
        return out

    def _run(self) -> None:
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while not self._stop.wait(self.interval):
                for index, mib in nvidia_smi("index,memory.used", "gpu"):
                    with contextlib.suppress(ValueError):
                        key = f"gpu{index}"
                        self.gpu_peak_mib[key] = max(self.gpu_peak_mib.get(key, 0), float(mib))
                for pid, mib in nvidia_smi("pid,used_memory", "compute-apps"):
                    with contextlib.suppress(ValueError):
                        self.pid_peak_mib[pid] = max(self.pid_peak_mib.get(pid, 0), float(mib))
                for name, url in self.worker_urls.items():
                    with contextlib.suppress(httpx.HTTPError):
                        m = parse_metrics(client.get(url + "/metrics").text)
                        # Held by requests; blocks kept only as prefix cache are evictable.
                        held = (
                            m["trtdisagg_kv_cache_total_blocks"]
                            - m["trtdisagg_kv_cache_free_blocks"]
                            - m.get("trtdisagg_kv_cache_reusable_blocks", 0.0)
                        )
                        self.used_blocks_peak[name] = max(self.used_blocks_peak.get(name, 0), held)


def worker_urls(data: dict[str, Any]) -> dict[str, str]:
    host = data.get("host", "127.0.0.1")
    return {
        f"{role}-{i}": f"http://{host}:{worker['port']}"
        for role in ("ctx", "gen")
        for i, worker in enumerate(data.get(role, []))
    }


def snapshot(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        return {n: parse_metrics(client.get(url + "/metrics").text) for n, url in urls.items()}


def transfer_delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, Any]:
    keys = {
        "bytes": "trtdisagg_kv_transfer_bytes_total",
        "descriptors": "trtdisagg_kv_transfer_descriptors_total",
        "seconds_sum": "trtdisagg_kv_transfer_seconds_sum",
        "transfers": "trtdisagg_kv_transfer_seconds_count",
        "failures": "trtdisagg_kv_transfer_failures_total",
        "preemptions": "trtdisagg_preemptions_total",
    }
    out: dict[str, Any] = {}
    for name in after:
        out[name] = {k: after[name].get(m, 0.0) - before[name].get(m, 0.0) for k, m in keys.items()}
        d = out[name]
        if d["transfers"]:
            d["mean_transfer_ms"] = 1e3 * d["seconds_sum"] / d["transfers"]
            d["mean_bytes"] = d["bytes"] / d["transfers"]
            if d["seconds_sum"] > 0:
                d["gb_per_s"] = d["bytes"] / d["seconds_sum"] / 1e9
    return out


def server_infos(urls: dict[str, str]) -> dict[str, Any]:
    out = {}
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        for name, url in urls.items():
            info = client.get(url + "/server_info").json()
            metrics = parse_metrics(client.get(url + "/metrics").text)
            blocks = metrics.get("trtdisagg_kv_cache_total_blocks", 0.0)
            config = json.loads((Path(info["model_path"]) / "config.json").read_text())
            q_heads = config["num_attention_heads"]
            heads = config.get("num_key_value_heads") or q_heads
            head_dim = config.get("head_dim") or config["hidden_size"] // q_heads
            element = 2 if info["dtype"] in ("bfloat16", "float16") else 4
            kv_per_token = 2 * config["num_hidden_layers"] * heads * head_dim * element
            out[name] = {
                "model": info["model"],
                "dtype": info["dtype"],
                "kv_blocks": int(blocks),
                "tokens_per_block": info["tokens_per_block"],
                "pool_tokens": int(blocks) * info["tokens_per_block"],
                "kv_bytes_per_token": kv_per_token,
                "pool_gib": blocks * info["tokens_per_block"] * kv_per_token / 2**30,
                "vocab_size": config["vocab_size"],
            }
    return out


# ---- one benchmark point ----


def bench(
    args: argparse.Namespace, url: str, label: str, rate: float, duration: float, out: Path,
    vocab: int, log: Path, seed: int,
) -> dict[str, Any] | None:  # fmt: skip
    """One bench_serving --mixed run. Each run of a mode gets its own seed: prompts depend only
    on the seed, and a repeated prompt would be served from the prefix cache."""
    cmd = [
        sys.executable, str(BENCH), "--base-url", url, "--mixed", "--label", label,
        "--long-rate", str(rate), "--num-requests", "0", "--duration", str(duration),
        "--short-concurrency", str(args.short_concurrency),
        "--short-input-len", args.short_input, "--short-output-len", args.short_output,
        "--long-input-len", args.long_input, "--long-output-len", args.long_output,
        "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
        "--vocab-size", str(vocab), "--seed", str(seed),
        "--request-timeout", str(args.request_timeout), "--no-progress",
        "--result-json", str(out),
    ]  # fmt: skip
    with open(log, "ab") as f:
        f.write(f"\n$ {' '.join(cmd)}\n".encode())
        f.flush()
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, check=False)
    if not out.is_file():
        return None
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def point_summary(doc: dict[str, Any]) -> dict[str, Any]:
    def pick(cls: str) -> dict[str, Any]:
        s = doc["summary"].get(cls)
        if s is None:
            return {}
        row = {
            "completed": s["completed"],
            "failed": s["failed"],
            "request_throughput": s["request_throughput"],
            "output_throughput": s["output_throughput"],
            "first_error": s["first_error"],
        }
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            for q in ("p50", "p90", "p99", "max"):
                row[f"{metric[:-3]}_{q}_ms"] = s[metric][q]
        if s.get("goodput"):
            row["goodput_fraction"] = s["goodput"]["fraction"]
            row["goodput_rate"] = s["goodput"]["rate"]
        return row

    return {cls: pick(cls) for cls in ("short", "long", "all")}


# ---- the run ----


def pack(work: Path, out: Path) -> None:
    tmp = out / ".headline.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(work, arcname="headline")
    tmp.rename(out / "headline.tar.gz")


def write_summary(report: dict[str, Any], work: Path, out: Path) -> None:
    text = json.dumps(report, indent=1) + "\n"
    (work / "headline.json").write_text(text)
    (out / "headline.json").write_text(text)
    pack(work, out)


def run_mode(
    mode: str, args: argparse.Namespace, work: Path, out: Path, report: dict[str, Any],
    deadline: float,
) -> None:  # fmt: skip
    run_dir = work / mode
    run_dir.mkdir(parents=True, exist_ok=True)
    path, data = cluster_file(mode, args, run_dir)
    coordinator = data["coordinator"]
    url = f"http://{data.get('host', '127.0.0.1')}:{coordinator['port']}"
    urls = worker_urls(data)
    entry: dict[str, Any] = {"points": [], "cluster_file": str(path.relative_to(work))}
    report["modes"][mode] = entry
    t0 = time.monotonic()
    bench_log = run_dir / "bench.log"
    with running_cluster(path, run_dir / "up.log", args.start_timeout, url) as pids:
        entry["start_s"] = time.monotonic() - t0
        entry["pids"] = pids
        entry["workers"] = server_infos(urls)
        vocab = min(w["vocab_size"] for w in entry["workers"].values())
        print(f"[{mode}] up in {entry['start_s']:.1f} s: {entry['workers']}", flush=True)
        sampler = Sampler(urls).start()
        try:
            t1 = time.monotonic()
            warm = run_dir / "warmup.json"
            rate = min(max(args.rates), 1.0)
            bench(args, url, f"{mode}-warmup", rate, args.warmup_s, warm, vocab, bench_log,
                  seed=args.seed + 1000)  # fmt: skip
            entry["warmup_s"] = time.monotonic() - t1
            entry["warmup_peaks"] = sampler.reset()
            write_summary(report, work, out)
            for index, rate in enumerate(args.rates):
                need = args.duration + args.drain_allowance + 10.0  # + stopping the cluster
                if time.monotonic() + need > deadline:
                    print(f"[{mode}] skipping rate {rate}: out of time budget", flush=True)
                    entry["points"].append({"rate": rate, "skipped": "time budget"})
                    continue
                before = snapshot(urls)
                result = run_dir / f"{args.label_of[mode]}_rate{rate:g}.json"
                t2 = time.monotonic()
                doc = bench(args, url, args.label_of[mode], rate, args.duration, result, vocab,
                            bench_log, seed=args.seed + index)  # fmt: skip
                point: dict[str, Any] = {"rate": rate, "wall_s": time.monotonic() - t2}
                point["transfer"] = transfer_delta(before, snapshot(urls))
                point["peaks"] = sampler.reset()
                if doc is None:
                    point["error"] = "bench_serving wrote no result (see bench.log)"
                else:
                    point["result_file"] = str(result.relative_to(work))
                    point["duration_s"] = doc["summary"]["all"]["duration_s"]
                    point["summary"] = point_summary(doc)
                entry["points"].append(point)
                write_summary(report, work, out)
                print(f"[{mode}] rate {rate:g}: {json.dumps(point.get('summary', point))[:600]}",
                      flush=True)  # fmt: skip
        finally:
            sampler.stop()
    entry["total_s"] = time.monotonic() - t0
    write_summary(report, work, out)


def table(report: dict[str, Any]) -> str:
    w = max([22, *(len(mode) + 1 for mode in report["modes"])])
    lines = [
        f"{'mode':<{w}}{'rate':>6}{'TPOT p50':>10}{'TPOT p99':>10}{'ITL p99':>10}"
        f"{'TTFT s p50':>11}{'TTFT s p99':>11}{'TTFT l p50':>11}{'TTFT l p99':>11}"
        f"{'good s':>8}{'n s/l':>9}"
    ]

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.1f}"

    for mode, entry in report["modes"].items():
        for p in entry["points"]:
            s = p.get("summary")
            if s is None:
                lines.append(f"{mode:<{w}}{p['rate']:>6g}  {p.get('skipped') or p.get('error')}")
                continue
            sh, lo = s["short"], s["long"]
            good = sh.get("goodput_fraction")
            lines.append(
                f"{mode:<{w}}{p['rate']:>6g}{f(sh.get('tpot_p50_ms')):>10}"
                f"{f(sh.get('tpot_p99_ms')):>10}{f(sh.get('itl_p99_ms')):>10}"
                f"{f(sh.get('ttft_p50_ms')):>11}{f(sh.get('ttft_p99_ms')):>11}"
                f"{f(lo.get('ttft_p50_ms')):>11}{f(lo.get('ttft_p99_ms')):>11}"
                f"{'-' if good is None else f'{good:.0%}':>8}"
                f"{sh.get('completed', 0):>5}/{lo.get('completed', 0)}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="summary and tarball go here")
    p.add_argument("--work", type=Path, help="scratch (default: a temp dir outside --out)")
    p.add_argument("--model", default="synthetic:llama3-8b")
    p.add_argument("--modes", default="two_h200_aggregated,two_h200_disagg")
    p.add_argument("--rates", default="0.5,1,2", help="long-prompt requests per second")
    p.add_argument("--duration", type=float, default=55.0, help="seconds of issuing per point")
    p.add_argument("--warmup-s", type=float, default=8.0)
    p.add_argument("--budget", type=float, default=570.0, help="seconds for the whole run")
    p.add_argument("--drain-allowance", type=float, default=15.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--short-concurrency", type=int, default=16)
    p.add_argument("--short-input", default="128")
    p.add_argument("--short-output", default="256")
    p.add_argument("--long-input", default="4096:16384")
    p.add_argument("--long-output", default="16")
    p.add_argument("--max-num-tokens", type=int, help="override the workers' step budget")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--request-timeout", type=float, default=180.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny model on CPU, short lengths and durations: checks the code paths",
    )
    args = p.parse_args(argv)  # fmt: skip
    start = time.monotonic()
    deadline = start + args.budget
    if args.cpu_smoke:
        args.model = "tiny"
        args.duration, args.warmup_s = min(args.duration, 6.0), min(args.warmup_s, 3.0)
        args.short_concurrency = min(args.short_concurrency, 4)
        args.short_input, args.short_output = "16", "24"
        args.long_input, args.long_output = "256:1024", "4"
        args.max_num_tokens = args.max_num_tokens or 256
        args.rates = "0.5,1"
    args.rates = [float(r) for r in args.rates.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    args.label_of = {m: "aggregated" if "aggregated" in m else "disaggregated" for m in modes}
    if len(set(args.label_of.values())) < len(modes):
        args.label_of = {m: m for m in modes}
    work = args.work or Path(tempfile.mkdtemp(prefix="headline-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv[1:],
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
        "gpus": nvidia_smi("index,name,memory.total,driver_version", "gpu"),
        "modes": {},
    }
    write_summary(report, work, args.out)
    status = 0
    for mode in modes:
        try:
            run_mode(mode, args, work, args.out, report, deadline)
        except Exception as error:  # keep what the other modes measure
            status = 1
            report["modes"].setdefault(mode, {})["error"] = f"{type(error).__name__}: {error}"
            print(f"[{mode}] failed: {error}", flush=True)
        write_summary(report, work, args.out)
    report["wall_s"] = time.monotonic() - start
    write_summary(report, work, args.out)
    print(table(report))
    if any("error" in p for e in report["modes"].values() for p in e.get("points", [])):
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
