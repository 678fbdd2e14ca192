"""The offline engine and the HTTP worker on the same workload, in one run, side by side.

Both run the same worker config (a YAML file, or --model/--device/--dtype) on random token-id
prompts of exact lengths, greedy, `ignore_eos`, closed loop at each --concurrency:

* offline: `trtdisagg.LLM`'s engine in a child process, clients submitting straight to its
  executor (no HTTP); first, one prompt's prefill forward (and that of each --prefill-lens) and
  one decode step at batch 1 are timed alone, and on CUDA the HBM bandwidth (decode floor) and
  the bf16 matmul rate (prefill TFLOP/s count 2 x matmul parameters x tokens + attention);
* http: `python -m trtdisagg ctx` with the same config, bench_serving's streaming client
  (`return_token_ids`, `stream_options.include_usage`).

Per run: output tok/s, TTFT and TPOT p50/p99, and the device's busy fraction over the steady
part (first request's end to last submission): the step device-time counter
(`trtdisagg_step_device_seconds_total`: CUDA events around each step's forward and sampling; on
CPU the forward's wall time) divided by wall time, read in-process offline and from /metrics
over HTTP. Also per run, from the step counters' increase: the mean device time of a decode-only
step and of a step that computed prompt tokens (`trtdisagg_prefill_steps_total`), and the share
of device time in the latter. Ratios printed last: HTTP / offline throughput, TTFT p50 at
concurrency 1 / (prefill + decode step), TPOT p50 at concurrency 1 / decode floor (CUDA) and /
decode step.

    python tools/bench_engine.py --config conf/gpu/worker.yaml --concurrency 1,16,64 \\
        --input-len 512 --output-len 128 --prefill-lens 8192
    python tools/bench_engine.py --model tiny --concurrency 1,32 --input-len 128 --output-len 128

The result JSON goes to --result-json, else to $OUT/bench_engine.json when $OUT is set; the HTTP
worker's log to --worker-log, else to
$OUT/bench_engine_worker.log when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import trio
import yaml
from _bench_common import (
    LengthRange,
    RequestRecord,
    Slo,
    make_requests,
    summarize,
    write_result,
)

from trtdisagg.free_ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", type=Path, help="a worker YAML file (its port is ignored)")
    p.add_argument("--model", help="overrides the config's model (tiny, synthetic:llama3-8b, dir)")
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=YAML",
        help="another worker config key, e.g. --set async_scheduling=false",
    )  # fmt: skip
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated closed-loop sizes")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, help="per concurrency (default: max(12c, 16))")
    p.add_argument("--warmup", type=int, default=2, help="requests per concurrency, unmeasured")
    p.add_argument("--vocab-size", type=int, default=512, help="prompt ids uniform in [0, V)")
    p.add_argument(
        "--prefill-lens", default="",
        help="more prompt lengths whose prefill forward is probed alone, e.g. 8192",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--label", default="")
    p.add_argument("--result-json", type=Path)
    p.add_argument(
        "--worker-log", type=Path,
        help="the HTTP worker's log (default: $OUT/bench_engine_worker.log when OUT is set)",
    )  # fmt: skip
    p.add_argument("--phase", choices=["offline"], help=argparse.SUPPRESS)
    p.add_argument("--phase-out", type=Path, help=argparse.SUPPRESS)
    return p


def worker_config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {}
    if args.config is not None:
        loaded = yaml.safe_load(args.config.read_text()) or {}
        config.update(loaded)
    for key in ("model", "device", "dtype"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    for item in args.set:
        key, _, value = item.partition("=")
        config[key] = yaml.safe_load(value)
    config.setdefault("model", "tiny")
    config.pop("port", None)
    config.pop("cluster", None)
    config.pop("cache_transceiver_config", None)  # one worker, no disaggregated legs
    return config


def workload(args: argparse.Namespace, concurrency: int) -> tuple[list[Any], list[Any]]:
    # 12 waves: the first (requests in step) and the last (a batch that drains) weigh little.
    n = args.num_requests or max(12 * concurrency, 16)
    lengths = dict(
        input_len=LengthRange(args.input_len, args.input_len),
        output_len=LengthRange(args.output_len, args.output_len),
        vocab_size=args.vocab_size,
    )
    warm = make_requests("warmup", args.warmup, seed=args.seed + 1, **lengths)
    # A prompt set of its own per concurrency: with block reuse on, a run would otherwise find
    # the prompts of the run before it in the prefix cache and skip their prefills.
    measured = make_requests("all", n, seed=args.seed + concurrency, **lengths)
    return warm, measured


def concurrencies(args: argparse.Namespace) -> list[int]:
    return [int(c) for c in args.concurrency.split(",") if c]


STEP_COUNTERS = {
    "steps": "trtdisagg_steps_total",
    "device_s": "trtdisagg_step_device_seconds_total",
    "prefill_steps": "trtdisagg_prefill_steps_total",
    "prefill_device_s": "trtdisagg_prefill_step_device_seconds_total",
}


def parse_counters(metrics_text: str) -> dict[str, float]:
    """STEP_COUNTERS' values in a /metrics page (0 for one it lacks)."""
    values = dict.fromkeys(STEP_COUNTERS, 0.0)
    names = {name: key for key, name in STEP_COUNTERS.items()}
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[names[name]] = float(value)
    return values


def step_times(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean device ms of decode-only steps and of steps with prompt tokens between two counter
    readings, and the latter's share of the device time."""
    d = {key: after[key] - before[key] for key in STEP_COUNTERS}
    decode_steps = d["steps"] - d["prefill_steps"]
    decode_s = d["device_s"] - d["prefill_device_s"]
    return {
        "decode_steps": decode_steps,
        "prefill_steps": d["prefill_steps"],
        "decode_step_ms": 1e3 * decode_s / decode_steps if decode_steps else None,
        "prefill_step_ms": 1e3 * d["prefill_device_s"] / d["prefill_steps"]
        if d["prefill_steps"]
        else None,
        "prefill_share": d["prefill_device_s"] / d["device_s"] if d["device_s"] else None,
    }


def summary(
    records: Sequence[RequestRecord],
    busy: float | None,
    steps: dict[str, float | None] | None = None,
) -> dict[str, Any]:
    starts = [r.start_s for r in records]
    ends = [r.start_s + (r.e2e_s or 0.0) for r in records]
    duration = max(ends) - min(starts) if records else 0.0
    s = summarize(records, duration_s=duration, slo=Slo())
    return {
        "completed": s.completed,
        "failed": s.failed,
        "first_error": s.first_error,
        "duration_s": duration,
        "output_tok_s": s.output_throughput,
        "ttft_ms": {"p50": s.ttft_ms.p50, "p99": s.ttft_ms.p99},
        "tpot_ms": {"p50": s.tpot_ms.p50, "p99": s.tpot_ms.p99},
        "device_busy": busy,
        "steps": steps or {},
    }


# ---- offline (child process) ----


def run_offline_phase(args: argparse.Namespace) -> dict[str, Any]:
    from _engine_offline import offline_loop, probe_device, probe_steps

    from trtdisagg.offline import LLM

    config = worker_config(args)
    model = config.pop("model")
    started = time.perf_counter()
    llm = LLM(model, **config)
    out: dict[str, Any] = {"build_s": time.perf_counter() - started}
    vocab = min(args.vocab_size, llm.tokenizer.vocab_size)
    lens = [int(n) for n in args.prefill_lens.split(",") if n]
    probes = probe_steps(llm, args.input_len, vocab, prefill_lens=lens)
    out["probes"] = probes | probe_device(llm, args.input_len)
    registry = llm.executor.metrics.registry

    def counters() -> dict[str, float]:
        return {k: registry.get_sample_value(n) or 0.0 for k, n in STEP_COUNTERS.items()}

    runs = {}
    for c in concurrencies(args):
        warm, measured = workload(args, c)
        trio.run(offline_loop, llm, warm, min(c, len(warm)))
        before = counters()
        records, timeline = trio.run(offline_loop, llm, measured, c)
        runs[str(c)] = summary(records, timeline.busy(), step_times(before, counters()))
    out["runs"] = runs
    return out


def offline(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "offline.json"
        cmd = [sys.executable, __file__, *argv, "--phase", "offline", "--phase-out", str(path)]
        subprocess.run(cmd, check=True, cwd=ROOT)
        result: dict[str, Any] = json.loads(path.read_text())
        return result


# ---- http ----


def started_at(t0: float) -> Callable[[], float]:
    """A run's start, for `make_sender` (which reads it when it stamps a record)."""
    return lambda: t0


async def http_runs(args: argparse.Namespace, url: str) -> dict[str, Any]:
    from _engine_offline import closed_loop
    from bench_serving import BenchConfig, load_client, make_sender

    runs = {}
    async with load_client(url) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def counters() -> dict[str, float]:
            return parse_counters((await client.get("/metrics")).text)

        async def device_seconds() -> float:
            return (await counters())["device_s"]

        for c in concurrencies(args):
            config = BenchConfig(base_url=url, model=model, concurrency=c, progress=False)
            warm, measured = workload(args, c)
            send = make_sender(client, config, model, started_at(time.perf_counter()))
            await closed_loop(send, warm, min(c, len(warm)), device_seconds, every_s=1.0)
            before = await counters()
            send = make_sender(client, config, model, started_at(time.perf_counter()))
            records, timeline = await closed_loop(send, measured, c, device_seconds, every_s=0.25)
            steps = step_times(before, await counters())
            runs[str(c)] = summary(records, timeline.busy(), steps)
    return runs


def http(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "worker.yaml"
        config_path.write_text(yaml.safe_dump({**worker_config(args), "port": port}))
        log_path = args.worker_log or Path(tmp) / "worker.log"
        if args.worker_log is None and os.environ.get("OUT"):
            log_path = Path(os.environ["OUT"]) / "bench_engine_worker.log"
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        with open(log_path, "wb") as log:
            worker = subprocess.Popen(
                [sys.executable, "-m", "trtdisagg", "ctx", "--config", str(config_path)],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 1800
            while True:
                if worker.poll() is not None:
                    raise SystemExit(f"worker exited:\n{log_path.read_text()[-3000:]}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("worker not healthy after 30 minutes")
                time.sleep(0.5)  # polling a starting server
            return trio.run(http_runs, args, url)
        finally:
            worker.terminate()
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()


# ---- report ----


def ratios(result: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    off, web = result.get("offline", {}), result.get("http", {})
    for c, run in web.items():
        base = off.get("runs", {}).get(c)
        if base and base["output_tok_s"]:
            out[f"http/offline tok/s, c={c}"] = run["output_tok_s"] / base["output_tok_s"]
    probes = off.get("probes", {})
    for mode, runs in (("http", web), ("offline", off.get("runs", {}))):
        one = runs.get("1")
        if not one or not probes:
            continue
        if one["ttft_ms"]["p50"] is not None:
            bound = probes["prefill_ms"] + probes["decode_ms"]
            out[f"{mode} TTFT p50 / (prefill + decode step), c=1"] = one["ttft_ms"]["p50"] / bound
        if one["tpot_ms"]["p50"] is not None:
            out[f"{mode} TPOT p50 / decode step, c=1"] = one["tpot_ms"]["p50"] / probes["decode_ms"]
            if "decode_floor_ms" in probes:
                floor = probes["decode_floor_ms"]
                out[f"{mode} TPOT p50 / HBM floor, c=1"] = one["tpot_ms"]["p50"] / floor
    matmul = probes.get("bf16_matmul_tflops")
    for name, value in probes.items():
        if matmul and name.startswith("prefill") and name.endswith("_tflops"):
            out[f"{name[: -len('_tflops')]} / bf16 matmul rate"] = value / matmul
    return out


def table(result: dict[str, Any]) -> str:
    def cell(x: float | None, digits: int = 1) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    lines = [
        f"bench_engine {result['label']}  model={result['config'].get('model')} "
        f"in={result['input_len']} out={result['output_len']}",
        f"{'mode':8} {'c':>4} {'tok/s':>9} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} "
        f"{'p99':>7} {'busy':>6} {'fail':>5} {'decode ms':>9} {'prefill ms':>10} {'share':>6}",
    ]
    for mode in ("offline", "http"):
        runs = result.get(mode, {})
        runs = runs.get("runs", {}) if mode == "offline" else runs
        for c, r in runs.items():
            steps = r.get("steps", {})
            prefill_ms, share = steps.get("prefill_step_ms"), steps.get("prefill_share")
            lines.append(
                f"{mode:8} {c:>4} {cell(r['output_tok_s']):>9} {cell(r['ttft_ms']['p50'], 2):>9} "
                f"{cell(r['ttft_ms']['p99'], 2):>8} {cell(r['tpot_ms']['p50'], 2):>9} "
                f"{cell(r['tpot_ms']['p99'], 2):>7} {cell(r['device_busy'], 2):>6} "
                f"{r['failed']:>5} {cell(steps.get('decode_step_ms'), 3):>9} "
                f"{cell(prefill_ms, 3):>10} {cell(share, 2):>6}"
            )
    for name, value in result.get("offline", {}).get("probes", {}).items():
        lines.append(f"  {name}: {value:.4g}")
    for name, value in result["ratios"].items():
        lines.append(f"  {name}: {value:.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.phase == "offline":
        assert args.phase_out is not None
        args.phase_out.write_text(json.dumps(run_offline_phase(args)))
        return 0
    result: dict[str, Any] = {
        "tool": "bench_engine",
        "label": args.label,
        "config": worker_config(args),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "concurrency": concurrencies(args),
    }
    if not args.skip_offline:
        result["offline"] = offline(args, argv)
    if not args.skip_http:
        result["http"] = http(args)
    result["ratios"] = ratios(result)
    path = args.result_json
    if path is None and os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "bench_engine.json"
    if path is not None:
        write_result(path, result)
        print(f"wrote {path}", file=sys.stderr)
    print(table(result))
    failed = sum(r["failed"] for r in result.get("http", {}).values())
    failed += sum(r["failed"] for r in result.get("offline", {}).get("runs", {}).values())
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
