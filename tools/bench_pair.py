"""The disaggregated pair through the coordinator: client figures, and gen's decode rate per step.

Starts `python -m trtdisagg up CONFIG` (one ctx, one gen, the coordinator), runs
`bench_serving.py` through the coordinator at each --concurrency (closed loop, streaming, exact
lengths, `ignore_eos`), and reads gen's /metrics before and after each run:

* gen tok/s: tokens gen produced (its inter-token gaps plus one per request) / the run's wall time;
* mean batch: those tokens / gen's steps; step ms: wall time / gen's steps;
* busy: gen's step device seconds / wall time (CUDA events around each step); device step ms
  and the tok/s while stepping: the same tokens over that device time.

Gen only decodes, so its tok/s at mean batch B is what the issue compares with an aggregated
worker's decode-only rate at batch B (`bench_engine.py --skip-http --concurrency B` with long
outputs gives that worker's TPOT at B: its decode-only rate is B / TPOT).

    python tools/bench_pair.py --config conf/gpu/one_h200.yaml --concurrency 16,64 \
        --input-len 512 --output-len 128

The result JSON goes to --result-json, else to $OUT/bench_pair.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
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
}


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


def gen_figures(
    before: dict[str, float], after: dict[str, float], wall_s: float
) -> dict[str, float]:
    delta = {k: after[k] - before[k] for k in COUNTERS}
    tokens = delta["gaps"] + delta["requests"]
    steps = max(delta["steps"], 1.0)
    return {
        "gen_tok_s": tokens / wall_s,
        "mean_batch": tokens / steps,
        "step_ms": 1000 * wall_s / steps,
        "busy": delta["device_s"] / wall_s,
        # While it steps: the device time of a step, and the rate at the mean batch
        "device_step_ms": 1000 * delta["device_s"] / steps,
        "stepping_tok_s": tokens / max(delta["device_s"], 1e-9),
    }


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
        before = counters(httpx.get(gen + "/metrics", trust_env=False).text)
        started = time.monotonic()
        subprocess.run(command, check=True)
        wall_s = time.monotonic() - started
        after = counters(httpx.get(gen + "/metrics", trust_env=False).text)
        summary = json.loads(out.read_text())["summary"]
    client = next(iter(summary.values()))
    return {"concurrency": concurrency, "client": client, **gen_figures(before, after, wall_s)}


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
                f"gen {run['gen_tok_s']:.1f} tok/s at mean batch {run['mean_batch']:.1f}, "
                f"step {run['step_ms']:.2f} ms (device {run['device_step_ms']:.2f} ms: "
                f"{run['stepping_tok_s']:.1f} tok/s while stepping), busy {run['busy']:.2f}",
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
