"""The disaggregated pair through the coordinator: client figures, and gen's decode rate per step.

Starts `python -m trtdisagg up CONFIG` (one ctx, one gen, the coordinator), runs
`bench_serving.py` through the coordinator at each --concurrency (closed loop, streaming, exact
lengths, `ignore_eos`), and reads gen's /metrics before and after each run:

* over the whole run: gen's tokens (its inter-token gaps plus one per request) / wall time;
* while gen had work: the same counters, sampled every 0.2 s, summed over the intervals that
  begin and end with a request running on gen: tokens per second, mean batch (tokens per step),
  busy (step device seconds per second; CUDA events around each step), and the share of the run
  gen had work. The closed loop's waves, the client's start and its warm-up leave gen idle at
  times; these figures leave that out.

Gen only decodes, so its tok/s at mean batch B is what the issue compares with an aggregated
worker's decode-only rate at batch B (`bench_engine.py --skip-http --concurrency B` with long
outputs gives that worker's TPOT at B: its decode-only rate is B / TPOT).

    python tools/bench_pair.py --config conf/gpu/one_h200.yaml --concurrency 16,64 \
        --input-len 512 --output-len 128

The result JSON goes to --result-json, else to $OUT/bench_pair.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

TOOLS = Path(__file__).resolve().parent
COUNTERS = {
    "steps": "trtdisagg_steps_total",
    "device_s": "trtdisagg_step_device_seconds_total",
    "gaps": "trtdisagg_inter_token_latency_seconds_count",
    "requests": "trtdisagg_e2e_request_latency_seconds_count",
    "running": "trtdisagg_requests_running",
}
SAMPLE_S = 0.2
Sample = tuple[float, dict[str, float]]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="an `up` YAML with one ctx and one gen")
    parser.add_argument("--concurrency", default="64", help="comma-separated closed-loop sizes")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-requests", type=int, default=0, help="per run (default 4c, >= 32)")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--result-json", type=Path, default=None)
    return parser


def counters(text: str) -> dict[str, float]:
    """The COUNTERS' values in a Prometheus text page (0 for one not there)."""
    found = {}
    for name, metric in COUNTERS.items():
        match = re.search(rf"^{re.escape(metric)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
        found[name] = float(match.group(1)) if match else 0.0
    return found


def _tokens(a: dict[str, float], b: dict[str, float]) -> float:
    return (b["gaps"] - a["gaps"]) + (b["requests"] - a["requests"])


def gen_figures(samples: list[Sample]) -> dict[str, float]:
    """Whole-run and while-working figures from gen's counters sampled over one run."""
    (t0, first), (t1, last) = samples[0], samples[-1]
    figures = {"gen_tok_s": _tokens(first, last) / (t1 - t0)}
    work_s = tokens = steps = device_s = 0.0
    for (ta, a), (tb, b) in itertools.pairwise(samples):
        if a["running"] >= 1 and b["running"] >= 1:
            work_s += tb - ta
            tokens += _tokens(a, b)
            steps += b["steps"] - a["steps"]
            device_s += b["device_s"] - a["device_s"]
    if work_s > 0 and steps > 0:
        figures |= {
            "working_share": work_s / (t1 - t0),
            "working_tok_s": tokens / work_s,
            "mean_batch": tokens / steps,
            "step_ms": 1000 * work_s / steps,
            "device_step_ms": 1000 * device_s / steps,
            "busy": device_s / work_s,
        }
    return figures


def sample_until(gen: str, done: threading.Event, samples: list[Sample]) -> None:
    with httpx.Client(trust_env=False, timeout=5) as client:
        while True:
            samples.append((time.monotonic(), counters(client.get(gen + "/metrics").text)))
            if done.wait(SAMPLE_S):
                samples.append((time.monotonic(), counters(client.get(gen + "/metrics").text)))
                return


def wait_healthy(url: str, timeout_s: float, cluster: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cluster.poll() is not None:
            raise SystemExit(f"the cluster exited with {cluster.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{url} not healthy within {timeout_s:g}s")


def run_one(args: argparse.Namespace, front: str, gen: str, concurrency: int) -> dict[str, Any]:
    n = args.num_requests or max(4 * concurrency, 32)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "serving.json"
        command = [
            sys.executable, str(TOOLS / "bench_serving.py"), "--base-url", front,
            "--concurrency", str(concurrency), "--num-requests", str(n),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--vocab-size", str(args.vocab_size), "--warmup", str(min(concurrency, 16)),
            "--no-progress", "--result-json", str(out),
        ]  # fmt: skip
        samples: list[Sample] = []
        done = threading.Event()
        sampler = threading.Thread(target=sample_until, args=(gen, done, samples))
        sampler.start()
        try:
            subprocess.run(command, check=True)
        finally:
            done.set()
            sampler.join()
        summary = json.loads(out.read_text())["summary"]
    client = next(iter(summary.values()))
    return {"concurrency": concurrency, "client": client, **gen_figures(samples)}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = yaml.safe_load(Path(args.config).read_text())
    host = config.get("host", "127.0.0.1")
    front = f"http://{host}:{config['coordinator']['port']}"
    gen = f"http://{host}:{config['gen'][0]['port']}"
    cluster = subprocess.Popen(
        [sys.executable, "-m", "trtdisagg", "up", args.config], start_new_session=True
    )
    runs = []
    try:
        wait_healthy(front, args.start_timeout, cluster)
        wait_healthy(gen, args.start_timeout, cluster)
        for c in (int(x) for x in args.concurrency.split(",")):
            run = run_one(args, front, gen, c)
            runs.append(run)
            client = run["client"]
            print(
                f"c={c}: client {client['output_throughput']:.1f} tok/s, TTFT p50 "
                f"{client['ttft_ms']['p50']:.2f} ms, TPOT p50 {client['tpot_ms']['p50']:.2f} ms | "
                f"gen {run['gen_tok_s']:.1f} tok/s over the run; while working "
                f"({run.get('working_share', 0):.2f} of it): {run.get('working_tok_s', 0):.1f} "
                f"tok/s at mean batch {run.get('mean_batch', 0):.1f}, step "
                f"{run.get('step_ms', 0):.2f} ms (device {run.get('device_step_ms', 0):.2f}), "
                f"busy {run.get('busy', 0):.2f}",
                flush=True,
            )
    finally:
        os.killpg(cluster.pid, signal.SIGINT)
        try:
            cluster.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(cluster.pid, signal.SIGKILL)
    path = args.result_json or (
        Path(os.environ["OUT"]) / "bench_pair.json" if "OUT" in os.environ else None
    )
    if path is not None:
        path.write_text(json.dumps({"config": args.config, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
