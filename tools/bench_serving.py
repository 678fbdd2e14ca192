"""Benchmark any OpenAI-compatible server with random-token requests of exact lengths.

Every request streams (`stream: true`, `stream_options.include_usage`), carries its prompt as a
token-id list (so the input length is exact) and `ignore_eos: true` with `max_tokens` = output
length (so the output length is exact). Per request it records TTFT (send -> first chunk with
content), ITL (gaps between content chunks), E2E and TPOT = (E2E - TTFT) / (output tokens - 1);
output tokens come from the final `usage` chunk. The summary gives mean/p50/p90/p99, request and
token throughput, failures and, with SLOs, goodput (requests meeting both TTFT and TPOT).

Load shapes:
  --concurrency N             closed loop: N requests in flight at all times
  --request-rate R            open loop: Poisson arrivals at R req/s (seeded); with --concurrency
                              too, arrivals also wait for one of the N slots
  --mixed                     a closed-loop stream of short-prompt, long-output requests plus a
                              Poisson stream of long-prompt requests; reported per class. The run
                              ends when the --num-requests long requests are done (or --duration).
                              With --short-rate, the short requests arrive as a Poisson stream too
                              (still at most --short-concurrency in flight).

    python tools/bench_serving.py --base-url http://127.0.0.1:8000 --concurrency 8 \\
        --num-requests 200 --input-len 512 --output-len 128 --result-json out/c8.json
    python tools/bench_serving.py --mixed --long-rate 0.5 --num-requests 20 \\
        --slo-ttft-ms 2000 --slo-tpot-ms 50 --label disagg --result-json out/mixed-0.5.json

The run always ends by itself: a request is abandoned after --request-timeout seconds, and the
stopping rule is a request count or a --duration.
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import httpx
import trio
from _bench_common import (
    RSS_CHECKPOINT,
    LengthRange,
    ProgressBar,
    RequestRecord,
    RequestSpec,
    RssSummary,
    Slo,
    flatten_phases,
    format_summary,
    iter_poisson_arrivals,
    iter_requests,
    read_rss_kib,
    result_document,
    summarize_by_class,
    summarize_rss,
    write_result,
)

Send = Callable[[RequestSpec], Awaitable[RequestRecord]]

_INPUT_LEN: Final = LengthRange(512, 512)
_OUTPUT_LEN: Final = LengthRange(128, 128)
_SHORT_INPUT_LEN: Final = LengthRange(64, 64)
_SHORT_OUTPUT_LEN: Final = LengthRange(256, 256)
_LONG_INPUT_LEN: Final = LengthRange(2048, 2048)
_LONG_OUTPUT_LEN: Final = LengthRange(16, 16)
_NO_SLO: Final = Slo()


class Endpoint(enum.StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/v1/completions" if self is Endpoint.COMPLETIONS else "/v1/chat/completions"


@attrs.frozen(kw_only=True)
class BenchConfig:
    """Everything a run depends on; written into the result file as "config"."""

    base_url: str
    model: str | None  # None: the first model of GET /v1/models
    endpoint: Endpoint = Endpoint.COMPLETIONS
    api_key: str | None = None
    input_len: LengthRange = _INPUT_LEN
    output_len: LengthRange = _OUTPUT_LEN
    vocab_size: int = 256
    seed: int = 0
    concurrency: int | None = None
    request_rate: float | None = None
    num_requests: int | None = 100
    duration_s: float | None = None
    warmup: int = 0
    request_timeout_s: float = 600.0
    slo: Slo = _NO_SLO
    mixed: bool = False
    short_input_len: LengthRange = _SHORT_INPUT_LEN
    short_output_len: LengthRange = _SHORT_OUTPUT_LEN
    short_concurrency: int = 4
    short_rate: float | None = None  # None: the short stream is a closed loop
    long_input_len: LengthRange = _LONG_INPUT_LEN
    long_output_len: LengthRange = _LONG_OUTPUT_LEN
    long_rate: float = 0.5
    return_token_ids: bool = True
    perf_metrics: bool = False  # ask for, and summarise, the server's phase timings
    tokenizer: Path | None = None  # chat only: decode prompt ids into text
    rss_pid: int | None = None
    label: str = ""
    progress: bool = True

    def __attrs_post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give --num-requests or --duration (the run must end by itself)")
        if not self.mixed and self.concurrency is None and self.request_rate is None:
            raise ValueError("give --concurrency N and/or --request-rate R (or --mixed)")

    @property
    def lengths(self) -> tuple[LengthRange, LengthRange]:
        return self.input_len, self.output_len

    @property
    def short_lengths(self) -> tuple[LengthRange, LengthRange]:
        return self.short_input_len, self.short_output_len

    @property
    def long_lengths(self) -> tuple[LengthRange, LengthRange]:
        return self.long_input_len, self.long_output_len

    def to_json(self) -> dict[str, Any]:
        def plain(_inst: Any, _field: Any, value: Any) -> Any:
            return str(value) if isinstance(value, LengthRange | Path) else value

        out = attrs.asdict(self, value_serializer=plain)
        out["api_key"] = None if self.api_key is None else "<redacted>"  # result files get shared
        return out


@attrs.define(eq=False)
class StreamState:
    """Parses one SSE response as it arrives and times its content chunks. Pure: no I/O."""

    sent_at: float
    first_at: float | None = None
    last_at: float | None = None
    gaps: list[float] = attrs.Factory(list)
    content_chunks: int = 0
    counted_tokens: int = 0
    usage: dict[str, Any] | None = None
    perf: dict[str, Any] | None = None
    done: bool = False
    error: str | None = None
    abandoned: bool = False  # given up on after the request timeout

    def feed(self, line: str, now: float) -> None:
        if not line.startswith("data:"):
            return  # blank separators, comments, `event:` lines
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            self.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
            return
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("perf_metrics"), dict):
            self.perf = chunk["perf_metrics"]
        ids = 0
        content = False
        for choice in chunk.get("choices") or ():
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            n = len(choice.get("token_ids") or ())
            ids += n
            content = content or bool(text) or n > 0
        if not content:
            return
        if self.last_at is None:
            self.first_at = now
        else:
            self.gaps.append(now - self.last_at)
        self.last_at = now
        self.content_chunks += 1
        self.counted_tokens += ids

    def output_tokens(self) -> int:
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            return int(self.usage["completion_tokens"])
        return self.counted_tokens or self.content_chunks

    def record(self, spec: RequestSpec, t0: float, ended_at: float) -> RequestRecord:
        failed = RequestRecord(
            cls=spec.cls,
            index=spec.index,
            input_len=spec.input_len,
            output_len=spec.output_len,
            ok=False,
            start_s=self.sent_at - t0,
        )
        error = self.error
        if error is None and not self.done:
            error = "stream ended without data: [DONE]"
        if error is None and self.first_at is None:
            error = "stream carried no tokens"
        if self.abandoned:
            first = None if self.first_at is None else self.first_at - self.sent_at
            return attrs.evolve(failed, error=error, abandoned=True, ttft_s=first)
        if error is not None:
            return attrs.evolve(failed, error=error)
        assert self.first_at is not None
        prompt = self.usage.get("prompt_tokens") if self.usage else None
        return attrs.evolve(
            failed,
            ok=True,
            ttft_s=self.first_at - self.sent_at,
            e2e_s=ended_at - self.sent_at,
            itl_s=tuple(self.gaps),
            prompt_tokens=prompt if isinstance(prompt, int) else None,
            output_tokens=self.output_tokens(),
            phases=flatten_phases(self.perf) if self.perf else {},
        )


_WORDS = ("alpha", "bravo", "cache", "delta", "echo", "fox", "gen", "hotel", "india", "kilo")


def request_body(
    config: BenchConfig, model: str, spec: RequestSpec, text: str | None
) -> dict[str, Any]:
    """The JSON body for `spec`; `text` replaces the token ids for the chat endpoint."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.return_token_ids:
        body["return_token_ids"] = True
    if config.perf_metrics:
        body["return_perf_metrics"] = True
    if config.endpoint is Endpoint.CHAT:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = list(spec.prompt_ids)
    return body


def make_text_of(config: BenchConfig) -> Callable[[RequestSpec], str | None]:
    """Chat needs text: the ids decoded by --tokenizer, else one word per id (approximate)."""
    if config.endpoint is Endpoint.COMPLETIONS:
        return lambda spec: None
    if config.tokenizer is None:
        return lambda spec: " ".join(_WORDS[i % len(_WORDS)] for i in spec.prompt_ids)
    from tokenizers import Tokenizer

    path = config.tokenizer
    tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    return lambda spec: tok.decode(list(spec.prompt_ids), skip_special_tokens=False)


def make_sender(
    client: httpx.AsyncClient, config: BenchConfig, model: str, t0: Callable[[], float]
) -> Send:
    """`send(spec)` streams one request and returns its record; it never raises for a failed
    request (HTTP status, transport error, timeout, bad stream) but records the failure."""
    text_of = make_text_of(config)

    async def send(spec: RequestSpec) -> RequestRecord:
        body = request_body(config, model, spec, text_of(spec))
        state = StreamState(sent_at=time.perf_counter())
        try:
            with trio.fail_after(config.request_timeout_s):
                async with client.stream("POST", config.endpoint.path, json=body) as response:
                    if response.status_code != 200:
                        detail = (await response.aread()).decode(errors="replace")[:300]
                        state.error = f"HTTP {response.status_code}: {detail}"
                    else:
                        async for line in response.aiter_lines():
                            state.feed(line, time.perf_counter())
        except trio.TooSlowError:
            state.error = f"timeout after {config.request_timeout_s:g}s"
            state.abandoned = True
        except (httpx.HTTPError, json.JSONDecodeError) as error:
            state.error = f"{type(error).__name__}: {error}"[:300]
        return state.record(spec, t0(), time.perf_counter())

    return send


@attrs.define(eq=False, kw_only=True)
class Collector:
    """Receives every finished request: keeps the measured ones, samples RSS, draws progress."""

    rss_pid: int | None
    progress: ProgressBar | None = None
    measuring: bool = False
    records: list[RequestRecord] = attrs.Factory(list)
    rss_samples: list[tuple[int, int]] = attrs.Factory(list)
    finished: int = 0  # all requests, warm-up included: the RSS sample index
    failed: int = 0

    def sample_rss(self) -> None:
        if self.rss_pid is None:
            return
        try:
            self.rss_samples.append((self.finished, read_rss_kib(self.rss_pid)))
        except OSError as error:  # the process is gone: keep what we have, say so once
            print(f"RSS sampling stopped: {error}", file=sys.stderr)
            self.rss_pid = None

    def add(self, record: RequestRecord) -> None:
        self.finished += 1
        self.sample_rss()
        if not self.measuring:
            return
        self.records.append(record)
        self.failed += not record.ok
        if self.progress is not None:
            self.progress.update(len(self.records), self.failed)


@attrs.frozen(kw_only=True)
class Stream:
    """One request class: which requests, how many in flight, and when each may start."""

    requests: Iterable[RequestSpec]  # finite, or endless when issuing is stopped from outside
    concurrency: int | None = None  # None: unbounded
    arrivals: Iterable[float] | None = None  # offsets from the stream's start; None: no pacing


async def run_stream(
    stream: Stream, send: Send, collector: Collector, issuing: trio.CancelScope
) -> None:
    """Issue `stream`'s requests until they run out or `issuing` is cancelled, then wait for the
    ones in flight (each bounded by its own timeout)."""
    slots = trio.Semaphore(stream.concurrency) if stream.concurrency else None
    start = trio.current_time()

    async def one(spec: RequestSpec) -> None:
        try:
            collector.add(await send(spec))
        finally:
            if slots is not None:
                slots.release()

    pacing: Iterable[float | None] = stream.arrivals if stream.arrivals is not None else _nones()
    async with trio.open_nursery() as nursery:
        with issuing:
            for spec, offset in zip(stream.requests, pacing):
                if offset is not None:
                    await trio.sleep_until(start + offset)
                if slots is not None:
                    await slots.acquire()
                nursery.start_soon(one, spec)


def _nones() -> Iterable[None]:
    while True:
        yield None


def _requests(
    cls: str, config: BenchConfig, lengths: tuple[LengthRange, LengthRange], count: int | None
) -> Iterable[RequestSpec]:
    it = iter_requests(
        cls,
        input_len=lengths[0],
        output_len=lengths[1],
        vocab_size=config.vocab_size,
        seed=config.seed,
    )
    return it if count is None else (spec for spec, _ in zip(it, range(count)))


async def run_measured(config: BenchConfig, send: Send, collector: Collector) -> None:
    """The measured phase: one stream, or the two streams of a mixed run."""
    deadline = math.inf if config.duration_s is None else trio.current_time() + config.duration_s
    if not config.mixed:
        arrivals = None
        if config.request_rate is not None:
            arrivals = iter_poisson_arrivals(config.request_rate, seed=config.seed)
        stream = Stream(
            requests=_requests("all", config, config.lengths, config.num_requests),
            concurrency=config.concurrency,
            arrivals=arrivals,
        )
        await run_stream(stream, send, collector, trio.CancelScope(deadline=deadline))
        return
    short = Stream(
        requests=_requests("short", config, config.short_lengths, None),
        concurrency=config.short_concurrency,
        arrivals=None
        if config.short_rate is None
        else iter_poisson_arrivals(config.short_rate, seed=config.seed, stream="arrivals/short"),
    )
    long = Stream(
        requests=_requests("long", config, config.long_lengths, config.num_requests),
        arrivals=iter_poisson_arrivals(config.long_rate, seed=config.seed, stream="arrivals/long"),
    )
    short_issuing = trio.CancelScope(deadline=deadline)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_stream, short, send, collector, short_issuing)
        await run_stream(long, send, collector, trio.CancelScope(deadline=deadline))
        short_issuing.cancel()  # the long stream is done: stop the background, let it drain


@attrs.frozen(kw_only=True)
class RunResult:
    model: str
    records: list[RequestRecord]
    duration_s: float
    rss: RssSummary | None


async def resolve_model(client: httpx.AsyncClient, config: BenchConfig) -> str:
    if config.model is not None:
        return config.model
    with trio.fail_after(30):
        response = await client.get("/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def load_client(
    base_url: str, *, api_key: str | None = None, request_timeout_s: float | None = None
) -> httpx.AsyncClient:
    """The load's client (here and in bench_engine): one kept-alive connection per stream.

    httpx keeps 20 connections alive by default: at a higher concurrency each wave of requests
    would reconnect the rest, and their setup would count in TTFT.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(request_timeout_s, connect=30.0)
    return httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=timeout, trust_env=False
    )


async def run_benchmark(config: BenchConfig) -> RunResult:
    """Warm up, then run the measured phase; return its records (warm-up excluded)."""
    client = load_client(
        config.base_url, api_key=config.api_key, request_timeout_s=config.request_timeout_s
    )
    async with client:
        model = await resolve_model(client, config)
        t0 = 0.0
        send = make_sender(client, config, model, lambda: t0)
        collector = Collector(rss_pid=config.rss_pid)
        collector.sample_rss()
        if config.warmup:
            print(f"warm-up: {config.warmup} requests", file=sys.stderr)
            lengths = config.short_lengths if config.mixed else config.lengths
            warm = Stream(
                requests=_requests("warmup", config, lengths, config.warmup),
                concurrency=config.concurrency or config.short_concurrency,
            )
            await run_stream(warm, send, collector, trio.CancelScope())
        if config.progress:
            total = None if config.mixed else config.num_requests
            collector.progress = ProgressBar(total=total, duration_s=config.duration_s)
        collector.measuring = True
        t0 = time.perf_counter()
        await run_measured(config, send, collector)
        duration = time.perf_counter() - t0
        if collector.progress is not None:
            collector.progress.close(len(collector.records), collector.failed)
    records = sorted(collector.records, key=lambda r: r.start_s)
    rss = None if config.rss_pid is None else summarize_rss(config.rss_pid, collector.rss_samples)
    return RunResult(model=model, records=records, duration_s=duration, rss=rss)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model name in requests (default: first of /v1/models)")
    p.add_argument("--endpoint", choices=[e.value for e in Endpoint], default="completions")
    p.add_argument("--api-key")
    p.add_argument("--input-len", default="512", help='prompt tokens: "N" or "LO:HI"')
    p.add_argument("--output-len", default="128", help='output tokens: "N" or "LO:HI"')
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="spread every N over [N(1-r), N(1+r)] uniformly",
    )
    p.add_argument("--vocab-size", type=int, default=256, help="prompt ids uniform in [0, V)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, help="requests in flight (closed loop)")
    p.add_argument("--request-rate", type=float, help="Poisson arrivals per second (open loop)")
    p.add_argument(
        "--num-requests",
        type=int,
        default=100,
        help="measured requests (mixed: long ones); 0: run for --duration",
    )
    p.add_argument("--duration", type=float, help="stop issuing after this many seconds")
    p.add_argument("--warmup", type=int, default=0, help="requests sent first, not measured")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument(
        "--mixed",
        action="store_true",
        help="short stream (closed loop or --short-rate) + long Poisson stream",
    )
    p.add_argument("--short-input-len", default="64")
    p.add_argument("--short-output-len", default="256")
    p.add_argument("--short-concurrency", type=int, default=4)
    p.add_argument(
        "--short-rate", type=float, help="short-prompt requests per second (default: closed loop)"
    )
    p.add_argument("--long-input-len", default="2048", help='"N" or "LO:HI"')
    p.add_argument("--long-output-len", default="16")
    p.add_argument("--long-rate", type=float, default=0.5, help="long-prompt requests per second")
    p.add_argument("--no-token-ids", action="store_true", help='do not send "return_token_ids"')
    p.add_argument(
        "--perf-metrics",
        action="store_true",
        help='send "return_perf_metrics" and summarise the server phases (ctx, transfer, gen)',
    )
    p.add_argument("--tokenizer", type=Path, help="chat only: tokenizer.json (or its dir)")
    p.add_argument("--sample-rss-pid", type=int, help="sample this PID's VmRSS per request")
    p.add_argument("--label", default="", help="run name in the result file and plots")
    p.add_argument("--result-json", type=Path)
    p.add_argument("--no-progress", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    def length(text: str) -> LengthRange:
        return LengthRange.parse(text, args.range_ratio)

    return BenchConfig(
        base_url=args.base_url.rstrip("/"), model=args.model, endpoint=Endpoint(args.endpoint),
        api_key=args.api_key, input_len=length(args.input_len), output_len=length(args.output_len),
        vocab_size=args.vocab_size, seed=args.seed, concurrency=args.concurrency,
        request_rate=args.request_rate, num_requests=args.num_requests or None,
        duration_s=args.duration, warmup=args.warmup, request_timeout_s=args.request_timeout,
        slo=Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms), mixed=args.mixed,
        short_input_len=length(args.short_input_len),
        short_output_len=length(args.short_output_len), short_concurrency=args.short_concurrency,
        short_rate=args.short_rate, long_input_len=length(args.long_input_len),
        long_output_len=length(args.long_output_len), long_rate=args.long_rate,
        return_token_ids=not args.no_token_ids,
        perf_metrics=args.perf_metrics, tokenizer=args.tokenizer,
        rss_pid=args.sample_rss_pid, label=args.label, progress=not args.no_progress,
    )  # fmt: skip


def report(config: BenchConfig, result: RunResult, *, tool: str, result_json: Path | None) -> int:
    """Write the result file (first: it is the record), then print the table.

    Returns:
        The exit status: 1 when any measured request failed, else 0.
    """
    summary = summarize_by_class(result.records, duration_s=result.duration_s, slo=config.slo)
    if result_json is not None:
        cfg = config.to_json() | {"resolved_model": result.model}
        doc = result_document(
            tool=tool,
            label=config.label,
            config=cfg,
            summary=summary,
            records=result.records,
            rss=result.rss,
        )
        write_result(result_json, doc)
        print(f"wrote {result_json}", file=sys.stderr)
    print(format_summary(f"{tool} {config.label}".strip(), summary))
    if result.rss is not None:
        print(format_rss(result.rss))
    return 1 if any(not r.ok for r in result.records) else 0


def format_rss(r: RssSummary) -> str:
    def mib(kib: int | None) -> str:
        return "-" if kib is None else f"{kib / 1024:.1f} MiB"

    growth = "-" if r.growth_checkpoint_to_end is None else f"{r.growth_checkpoint_to_end:+.1%}"
    return (f"RSS pid {r.pid}: start {mib(r.start_kib)}, peak {mib(r.peak_kib)}, "
            f"after request {RSS_CHECKPOINT} {mib(r.at_checkpoint_kib)}, end {mib(r.end_kib)}, "
            f"growth {RSS_CHECKPOINT}->end {growth}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as error:
        print(f"bench_serving: {error}", file=sys.stderr)
        return 2
    try:
        result = trio.run(run_benchmark, config)
    except (httpx.HTTPError, trio.TooSlowError) as error:
        print(f"bench_serving: cannot reach {config.base_url}: {error!r}", file=sys.stderr)
        return 2
    return report(config, result, tool="bench_serving", result_json=args.result_json)


if __name__ == "__main__":
    sys.exit(main())
