"""Where the split path's added latency goes: the coordinator itself, or the ctx -> gen handover.

Starts, as real processes on this machine (tiny model, CPU): an aggregated worker, a ctx and a
gen worker (NIXL, progress threads off, as in the CPU configs) and a coordinator in front of the
pair. Then, at concurrency 1, sends the same short completion (a prompt of token ids, greedy,
`max_tokens` tokens, not streamed) along three paths, the three in turn for every prompt so that
the machine's drift hits them alike:

  direct     to the aggregated worker (no split at all);
  manual     the split done by this client, as the coordinator does it (`coordinator/split.py`):
             `context_only` to ctx, then `generation_only` to gen with ctx's parameters;
  coordinator  the same request to the coordinator, which splits it.

manual - direct is the handover (ctx's answer, gen's admission, the KV transfer, gen's first
step, a second HTTP round trip); coordinator - manual is the coordinator's own cost (a third
HTTP hop, parsing, forwarding). Both are per-prompt differences, summarised at p50 and p90.
The last line is `coordinator_added_ms_p50=<x>`.

    python tools/bench_split.py                          # 60 prompts of 32 tokens, 8 out
    python tools/bench_split.py --prompts 200 --input-len 256 --output-len 16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import httpx
import trio
import yaml
from _bench_common import percentile

from trtdisagg.coordinator.split import AttemptIds, ctx_request, gen_request, parse_ctx_response
from trtdisagg.free_ports import free_port

START_TIMEOUT_S: Final = 180.0
PATHS: Final = ("direct", "manual", "coordinator")
WORKER: Final = {"model": "tiny", "kv_cache_config": {"tokens_per_block": 32, "max_tokens": 16384}}
TRANSFER: Final = {"backend": "NIXL", "nixl_progress_thread": False}


@attrs.frozen(kw_only=True)
class Summary:
    p50_ms: float
    p90_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Summary:
        return cls(p50_ms=percentile(seconds, 50) * 1e3, p90_ms=percentile(seconds, 90) * 1e3)


@contextlib.contextmanager
def started(command: Sequence[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A child process for the whole run, stopped with SIGINT (then killed) at the end."""
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield process
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


async def wait_healthy(
    client: httpx.AsyncClient, url: str, process: subprocess.Popen[bytes]
) -> None:
    with trio.fail_after(START_TIMEOUT_S):
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{url}: the process exited with {process.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(url + "/health")).status_code == 200:
                    return
            await trio.sleep(0.2)  # polling a server that is starting, bounded above


async def completion(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(url + "/v1/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"{url}: {response.status_code} {response.text[:300]}")
    answer: dict[str, Any] = response.json()
    return answer


async def manual_split(
    client: httpx.AsyncClient, ctx: str, gen: str, body: dict[str, Any], key: int
) -> list[int]:
    """What the coordinator does for a context_first request, done by this client."""
    ids = AttemptIds(request_id=key, transfer_key=key)
    answer = await completion(client, ctx, ctx_request(body, ids))
    result = parse_ctx_response(answer, server=ctx)
    if result.finished:
        raise RuntimeError("ctx finished the request itself: use --output-len > 1")
    final = await completion(client, gen, gen_request(body, result))
    return list(final["choices"][0]["token_ids"])


async def measure(args: argparse.Namespace, workdir: Path) -> dict[str, list[float]]:
    ports = {name: free_port() for name in ("agg", "ctx", "gen", "coordinator")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    (workdir / "agg.yaml").write_text(yaml.safe_dump(WORKER))
    (workdir / "pd.yaml").write_text(
        yaml.safe_dump({**WORKER, "cache_transceiver_config": TRANSFER})
    )
    coordinator = {
        "hostname": "127.0.0.1",
        "port": ports["coordinator"],
        "context_servers": {"urls": [urls["ctx"].removeprefix("http://")]},
        "generation_servers": {"urls": [urls["gen"].removeprefix("http://")]},
    }
    (workdir / "coordinator.yaml").write_text(yaml.safe_dump(coordinator))
    python = [sys.executable, "-m", "trtdisagg"]
    commands = {
        "agg": [*python, "ctx", "--config", str(workdir / "agg.yaml"), "--port", str(ports["agg"])],
        "ctx": [*python, "ctx", "--config", str(workdir / "pd.yaml"), "--port", str(ports["ctx"])],
        "gen": [*python, "gen", "--config", str(workdir / "pd.yaml"), "--port", str(ports["gen"])],
        "coordinator": [*python, "coordinator", "--config", str(workdir / "coordinator.yaml")],
    }
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(10, args.vocab_size) for _ in range(args.input_len)]
        for _ in range(args.warmup + args.prompts)
    ]
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    with contextlib.ExitStack() as stack:
        processes = {
            name: stack.enter_context(started(command, workdir / f"{name}.log"))
            for name, command in commands.items()
        }
        async with httpx.AsyncClient(timeout=120) as client:
            for name in ("agg", "ctx", "gen", "coordinator"):
                await wait_healthy(client, urls[name], processes[name])
            for i, prompt in enumerate(prompts):
                body = {
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": args.output_len,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
                tokens: dict[str, list[int]] = {}
                for offset in range(len(PATHS)):  # which path goes first rotates
                    path = PATHS[(i + offset) % len(PATHS)]
                    start = time.perf_counter()
                    if path == "manual":
                        tokens[path] = await manual_split(
                            client, urls["ctx"], urls["gen"], body, key=10_000_000 + i
                        )
                    else:
                        url = urls["agg"] if path == "direct" else urls["coordinator"]
                        answer = await completion(client, url, body)
                        tokens[path] = list(answer["choices"][0]["token_ids"])
                    if i >= args.warmup:
                        times[path].append(time.perf_counter() - start)
                if len({tuple(t) for t in tokens.values()}) != 1:
                    raise RuntimeError(f"prompt {i}: the paths answered differently: {tokens}")
    return times


def report(times: dict[str, list[float]]) -> tuple[str, dict[str, Any]]:
    handover = [m - d for m, d in zip(times["manual"], times["direct"], strict=True)]
    own = [c - m for c, m in zip(times["coordinator"], times["manual"], strict=True)]
    rows = {path: Summary.of(seconds) for path, seconds in times.items()}
    rows["manual - direct (handover)"] = Summary.of(handover)
    rows["coordinator - manual (the coordinator itself)"] = Summary.of(own)
    lines = [f"bench_split: {len(times['direct'])} prompts per path, E2E (non-streamed)"]
    lines += [
        f"  {name:48s} p50 {s.p50_ms:7.2f} ms   p90 {s.p90_ms:7.2f} ms" for name, s in rows.items()
    ]
    own_p50 = rows["coordinator - manual (the coordinator itself)"].p50_ms
    lines.append(f"coordinator_added_ms_p50={own_p50:.2f}")
    document = {name: attrs.asdict(s) for name, s in rows.items()}
    return "\n".join(lines), document


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_split.py",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--prompts", type=int, default=60, help="measured prompts per path")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured prompts per path")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", type=Path)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.warmup < 0 or args.input_len < 1 or args.output_len < 2:
        parser.error("--prompts >= 1, --warmup >= 0, --input-len >= 1, --output-len >= 2")
    with tempfile.TemporaryDirectory(prefix="bench_split_") as tmp:
        times = trio.run(measure, args, Path(tmp))
    text, document = report(times)
    print(text)
    if args.result_json is not None:
        args.result_json.write_text(json.dumps({"config": vars(args) | {"result_json": None},
                                                "summary": document}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
