"""The pure parts of tools/bench_serving.py, bench_hf_baseline.py, plot_bench.py and soak.py.

No servers: statistics, workload determinism, SSE parsing, request bodies, the result file's shape,
and the request-issuing loop driven by a fake sender under trio's autojump clock.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio

# tools/ is a directory of scripts, not a package: the scripts import each other as top-level
# modules (`from _bench_common import ...`), so the tests see them the same way.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import _bench_common as bc
import bench_serving as bs
import plot_bench
import soak

L = bc.LengthRange


def record(**overrides: object) -> bc.RequestRecord:
    fields: dict[str, object] = {
        "cls": "all", "index": 0, "input_len": 8, "output_len": 11, "ok": True, "start_s": 0.0,
        "ttft_s": 0.1, "e2e_s": 1.1, "itl_s": (0.1,) * 10, "prompt_tokens": 8, "output_tokens": 11,
    }  # fmt: skip
    fields.update(overrides)
    return bc.RequestRecord(**fields)  # type: ignore[arg-type]


# statistics ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 100])
def test_percentile_matches_numpy_linear(n: int) -> None:
    values = np.random.default_rng(n).exponential(3.0, size=n).tolist()
    for q in (0, 1, 50, 90, 99, 100):
        assert bc.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="no values"):
        bc.percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        bc.percentile([1.0], 101)


def test_latency_stats_are_milliseconds_and_empty_is_none() -> None:
    s = bc.LatencyStats.of_seconds([0.001, 0.002, 0.003])
    assert (s.count, s.mean, s.p50, s.max) == pytest.approx((3, 2.0, 2.0, 3.0))
    empty = bc.LatencyStats.of_seconds([])
    assert empty.count == 0 and empty.p99 is None


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    assert bc.tpot(1.1, 0.1, 11) == pytest.approx(0.1)
    assert bc.tpot(0.5, 0.5, 1) is None
    assert record().tpot_s == pytest.approx(0.1)
    assert record(ok=False).tpot_s is None
    assert record(output_tokens=1).tpot_s is None


def test_goodput_needs_both_slos_and_counts_failures_as_misses() -> None:
    slo = bc.Slo(ttft_ms=200, tpot_ms=50)
    records = [
        record(ttft_s=0.1, e2e_s=0.1 + 10 * 0.04),  # meets both
        record(ttft_s=0.3, e2e_s=0.3 + 10 * 0.04),  # TTFT too slow
        record(ttft_s=0.1, e2e_s=0.1 + 10 * 0.06),  # TPOT too slow
        record(ttft_s=0.1, e2e_s=5.0, output_tokens=1),  # one token: no TPOT to miss
        record(ok=False, ttft_s=None, e2e_s=None, error="HTTP 500"),
    ]
    g = bc.goodput(records, slo, duration_s=4.0)
    assert (g.good, g.fraction, g.rate) == pytest.approx((2, 0.4, 0.5))
    assert bc.goodput(records, bc.Slo(ttft_ms=200), 1.0).good == 3
    assert not bc.Slo().active


def test_summary_counts_tokens_mismatches_and_failures() -> None:
    records = [record(), record(index=1, output_tokens=7), record(index=2, ok=False, error="x")]
    s = bc.summarize(records, duration_s=2.0, slo=bc.Slo())
    assert (s.completed, s.failed, s.first_error) == (2, 1, "x")
    assert (s.total_input_tokens, s.total_output_tokens) == (16, 18)
    assert s.output_throughput == pytest.approx(9.0)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_len_mismatch == 1
    assert s.goodput is None
    assert s.itl_ms.count == 20


def test_summary_by_class_adds_all_only_for_several_classes() -> None:
    one = bc.summarize_by_class([record()], duration_s=1.0, slo=bc.Slo())
    assert list(one) == ["all"]
    two = bc.summarize_by_class(
        [record(cls="short"), record(cls="long"), record(cls="short", index=1)],
        duration_s=1.0, slo=bc.Slo(),
    )  # fmt: skip
    assert list(two) == ["short", "long", "all"]
    assert (two["short"].completed, two["long"].completed, two["all"].completed) == (2, 1, 3)


# workloads -------------------------------------------------------------------------------------


def test_length_range_parsing() -> None:
    assert L.parse("512") == L(512, 512)
    assert L.parse("100", 0.5) == L(50, 150)
    assert L.parse("256:1024") == L(256, 1024)
    assert str(L(3, 9)) == "3:9" and str(L(4, 4)) == "4"
    with pytest.raises(ValueError, match="lo <= hi"):
        L.parse("10:5")
    with pytest.raises(ValueError, match="range ratio"):
        L.parse("10", 1.0)


def test_prompts_are_deterministic_exact_and_prefix_stable() -> None:
    kw = {"input_len": L(16, 64), "output_len": L(4, 8), "vocab_size": 100, "seed": 7}
    a = bc.make_requests("all", 20, **kw)  # type: ignore[arg-type]
    assert a == bc.make_requests("all", 20, **kw)  # type: ignore[arg-type]
    assert a[:5] == bc.make_requests("all", 5, **kw)  # type: ignore[arg-type]
    assert a != bc.make_requests("all", 20, **(kw | {"seed": 8}))  # type: ignore[arg-type]
    assert a[0] != bc.make_requests("short", 1, **kw)[0]  # type: ignore[arg-type]
    assert all(16 <= r.input_len <= 64 and 4 <= r.output_len <= 8 for r in a)
    assert all(0 <= t < 100 for r in a for t in r.prompt_ids)
    assert len({r.input_len for r in a}) > 1
    exact = bc.make_requests("all", 3, input_len=L(64, 64), output_len=L(32, 32), vocab_size=512,
                             seed=0)  # fmt: skip
    assert [(r.input_len, r.output_len) for r in exact] == [(64, 32)] * 3


def test_bench_serving_and_hf_baseline_send_the_same_prompts() -> None:
    """The HF baseline calls make_requests("all", ...); bench_serving must draw the same ids."""
    config = bs.BenchConfig(base_url="http://x", model="m", input_len=L(30, 50),
                            output_len=L(5, 5), vocab_size=512, seed=3, concurrency=2,
                            num_requests=6)  # fmt: skip
    served = list(bs._requests("all", config, config.lengths, config.num_requests))
    hf = bc.make_requests("all", 6, input_len=L(30, 50), output_len=L(5, 5), vocab_size=512,
                          seed=3)  # fmt: skip
    assert served == hf


def test_poisson_arrivals_are_seeded_monotone_and_at_the_rate() -> None:
    a = bc.poisson_arrivals(2000, 4.0, seed=1)
    assert a == bc.poisson_arrivals(2000, 4.0, seed=1)
    assert a[:10] == bc.poisson_arrivals(10, 4.0, seed=1)
    assert a != bc.poisson_arrivals(2000, 4.0, seed=2)
    assert a[0] == 0.0 and all(x < y for x, y in itertools.pairwise(a))
    assert a[-1] / (len(a) - 1) == pytest.approx(0.25, rel=0.1)
    assert bc.poisson_arrivals(0, 1.0, seed=0) == []
    with pytest.raises(ValueError, match="positive"):
        bc.poisson_arrivals(3, math.inf, seed=0)


# the HTTP side, without HTTP -------------------------------------------------------------------


def sse(chunk: dict[str, object]) -> str:
    return "data: " + json.dumps(chunk)


def test_stream_state_times_content_chunks_and_reads_usage() -> None:
    spec = bc.RequestSpec(cls="all", index=4, prompt_ids=(1, 2, 3), output_len=3)
    st = bs.StreamState(sent_at=10.0)
    st.feed(sse({"choices": [{"delta": {"role": "assistant"}}]}), 10.05)  # no content yet
    st.feed("", 10.06)
    st.feed(sse({"choices": [{"text": "a", "token_ids": [5]}]}), 10.2)
    st.feed(sse({"choices": [{"text": "", "token_ids": [6]}]}), 10.5)  # partial UTF-8: ids only
    st.feed(sse({"choices": [{"text": "c", "token_ids": [7]}]}), 10.6)
    st.feed(sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}), 10.61)
    st.feed("data: [DONE]", 10.62)
    r = st.record(spec, t0=9.0, ended_at=10.7)
    assert r.ok and r.index == 4 and r.start_s == pytest.approx(1.0)
    assert r.ttft_s == pytest.approx(0.2) and r.e2e_s == pytest.approx(0.7)
    assert r.itl_s == pytest.approx((0.3, 0.1))
    assert (r.prompt_tokens, r.output_tokens) == (3, 3)
    assert r.tpot_s == pytest.approx(0.25)


def test_stream_state_failures() -> None:
    spec = bc.RequestSpec(cls="all", index=0, prompt_ids=(1,), output_len=2)
    cut = bs.StreamState(sent_at=0.0)
    cut.feed(sse({"choices": [{"text": "a"}]}), 0.1)
    assert cut.record(spec, 0.0, 0.2).error == "stream ended without data: [DONE]"
    empty = bs.StreamState(sent_at=0.0)
    empty.feed("data: [DONE]", 0.1)
    assert empty.record(spec, 0.0, 0.2).error == "stream carried no tokens"
    bad = bs.StreamState(sent_at=0.0)
    bad.feed(sse({"error": {"message": "boom", "code": 500}}), 0.1)
    bad.feed("data: [DONE]", 0.2)
    r = bad.record(spec, 0.0, 0.2)
    assert not r.ok and r.error is not None and "boom" in r.error and r.tpot_s is None
    assert not r.abandoned and not cut.record(spec, 0.0, 0.2).abandoned
    slow = bs.StreamState(sent_at=1.0, error="timeout after 5s", abandoned=True)
    slow.feed(sse({"choices": [{"text": "a"}]}), 1.5)
    given_up = slow.record(spec, 0.0, 6.0)
    assert given_up.abandoned and not given_up.ok and given_up.error == "timeout after 5s"
    assert given_up.ttft_s == pytest.approx(0.5) and given_up.tpot_s is None


def test_stream_state_counts_tokens_without_usage() -> None:
    st = bs.StreamState(sent_at=0.0)
    st.feed(sse({"choices": [{"text": "ab", "token_ids": [1, 2]}]}), 0.1)
    assert st.output_tokens() == 2
    plain = bs.StreamState(sent_at=0.0)
    plain.feed(sse({"choices": [{"text": "ab"}]}), 0.1)
    assert plain.output_tokens() == 1  # no ids, no usage: one per content chunk


def test_request_bodies() -> None:
    spec = bc.RequestSpec(cls="all", index=0, prompt_ids=(9, 8, 7), output_len=5)
    config = bs.BenchConfig(base_url="http://x", model=None, concurrency=1)
    body = bs.request_body(config, "tiny", spec, None)
    assert body == {
        "model": "tiny", "prompt": [9, 8, 7], "max_tokens": 5, "ignore_eos": True,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }  # fmt: skip
    chat = attrs.evolve(config, endpoint=bs.Endpoint.CHAT, return_token_ids=False)
    text = bs.make_text_of(chat)(spec)
    body = bs.request_body(chat, "tiny", spec, text)
    assert body["messages"] == [{"role": "user", "content": text}] and "prompt" not in body
    assert text is not None and len(text.split()) == 3 and "return_token_ids" not in body


def test_config_needs_a_stopping_rule_and_a_load_shape() -> None:
    with pytest.raises(ValueError, match="num-requests or --duration"):
        bs.BenchConfig(base_url="http://x", model=None, concurrency=1, num_requests=None)
    with pytest.raises(ValueError, match="concurrency"):
        bs.BenchConfig(base_url="http://x", model=None)
    argv = ["--mixed", "--long-input-len", "100:200", "--num-requests", "0", "--duration", "5"]
    args = bs.build_parser().parse_args(argv)
    config = bs.config_from_args(args)
    assert config.long_input_len == L(100, 200) and config.num_requests is None
    assert json.loads(json.dumps(config.to_json()))["long_input_len"] == "100:200"
    assert attrs.evolve(config, api_key="sk-secret").to_json()["api_key"] == "<redacted>"


# the issuing loop, with a fake sender ----------------------------------------------------------


def fake_sender(latency: float, log: dict[str, int]) -> bs.Send:
    async def send(spec: bc.RequestSpec) -> bc.RequestRecord:
        log["in_flight"] += 1
        log["peak"] = max(log["peak"], log["in_flight"])
        await trio.sleep(latency)
        log["in_flight"] -= 1
        return record(cls=spec.cls, index=spec.index, start_s=trio.current_time())

    return send


def specs(n: int | None, cls: str = "all") -> Iterable[bc.RequestSpec]:
    config = bs.BenchConfig(base_url="http://x", model=None, concurrency=1, input_len=L(2, 2),
                            output_len=L(2, 2))  # fmt: skip
    return bs._requests(cls, config, config.lengths, n)


async def test_closed_loop_keeps_n_in_flight(autojump_clock: trio.testing.MockClock) -> None:
    log = {"in_flight": 0, "peak": 0}
    collector = bs.Collector(rss_pid=None, measuring=True)
    stream = bs.Stream(requests=specs(20), concurrency=4)
    start = trio.current_time()
    await bs.run_stream(stream, fake_sender(1.0, log), collector, trio.CancelScope())
    assert log["peak"] == 4 and len(collector.records) == 20
    assert trio.current_time() - start == pytest.approx(5.0)


async def test_poisson_stream_follows_its_schedule(autojump_clock: trio.testing.MockClock) -> None:
    arrivals = bc.poisson_arrivals(10, 2.0, seed=5)
    collector = bs.Collector(rss_pid=None, measuring=True)
    start = trio.current_time()
    stream = bs.Stream(requests=specs(10), arrivals=iter(arrivals))
    await bs.run_stream(stream, fake_sender(0.0, {"in_flight": 0, "peak": 0}), collector,
                        trio.CancelScope())  # fmt: skip
    sent = sorted(r.start_s - start for r in collector.records)
    assert sent == pytest.approx(arrivals)


async def test_cancelling_issuing_drains_in_flight(autojump_clock: trio.testing.MockClock) -> None:
    collector = bs.Collector(rss_pid=None, measuring=True)
    stream = bs.Stream(requests=specs(None), concurrency=3)  # endless
    issuing = trio.CancelScope(deadline=trio.current_time() + 10.0)
    await bs.run_stream(stream, fake_sender(4.0, {"in_flight": 0, "peak": 0}), collector, issuing)
    # Issued at 0, 4, 8 (three each) and none after 10; all nine finished, none cut off.
    assert len(collector.records) == 9


async def test_mixed_run_paces_short_requests_at_their_rate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """--short-rate: the short class arrives as Poisson at that rate instead of a closed loop
    (here 2 per second, 0.5 s each, 8 slots: a closed loop would send 16 per second)."""
    args = bs.build_parser().parse_args(
        ["--mixed", "--short-rate", "2", "--short-concurrency", "8", "--long-rate", "0.5",
         "--num-requests", "0", "--duration", "20"]
    )  # fmt: skip
    config = bs.config_from_args(args)
    assert config.short_rate == 2.0
    collector = bs.Collector(rss_pid=None, measuring=True)
    log = {"in_flight": 0, "peak": 0}
    start = trio.current_time()
    await bs.run_measured(config, fake_sender(0.5, log), collector)
    short = sorted(r.start_s - 0.5 - start for r in collector.records if r.cls == "short")
    expected = [t for t in bc.poisson_arrivals(100, 2.0, seed=0, stream="arrivals/short") if t < 20]
    assert short == pytest.approx(expected)
    assert 25 <= len(short) <= 55  # about 40: the rate, not the slots, sets the count


def test_collector_skips_warmup_records() -> None:
    c = bs.Collector(rss_pid=None)
    c.add(record())
    c.measuring = True
    c.add(record(ok=False, error="x"))
    assert (c.finished, len(c.records), c.failed) == (2, 1, 1)


# result file, RSS, progress --------------------------------------------------------------------


def test_result_document_shape_round_trips(tmp_path: Path) -> None:
    records = [record(cls="short"), record(cls="long", ok=False, error="HTTP 503: busy")]
    summary = bc.summarize_by_class(records, duration_s=2.0, slo=bc.Slo(ttft_ms=100))
    rss = bc.summarize_rss(42, [(0, 1000), (100, 1100), (200, 1155)])
    doc = bc.result_document(tool="bench_serving", label="agg", config={"mixed": True},
                             summary=summary, records=records, rss=rss)  # fmt: skip
    path = tmp_path / "sub" / "r.json"
    bc.write_result(path, doc)
    back = bc.load_result(path)
    keys = {"schema", "tool", "label", "created", "config", "summary", "records", "rss"}
    assert set(back) == keys
    assert set(back["summary"]) == {"short", "long", "all"}
    short = back["summary"]["short"]
    assert set(short["ttft_ms"]) == {"count", "mean", "p50", "p90", "p99", "max"}
    assert short["goodput"]["slo_ttft_ms"] == 100
    assert back["records"][1]["error"] == "HTTP 503: busy"
    assert back["records"][0]["tpot_s"] == pytest.approx(0.1)
    assert back["rss"]["growth_checkpoint_to_end"] == pytest.approx(0.05)
    (tmp_path / "bad.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ValueError, match="schema"):
        bc.load_result(tmp_path / "bad.json")


def test_rss_summary() -> None:
    s = bc.summarize_rss(1, [(0, 500), (50, 900), (100, 800), (150, 820)])
    assert (s.start_kib, s.peak_kib, s.at_checkpoint_kib, s.end_kib) == (500, 900, 800, 820)
    assert s.growth_checkpoint_to_end == pytest.approx(0.025)
    short = bc.summarize_rss(1, [(0, 500), (5, 510)])
    assert short.at_checkpoint_kib is None and short.growth_checkpoint_to_end is None
    assert bc.read_rss_kib(os.getpid()) > 0


def test_progress_bar_on_a_pipe_prints_each_tenth_once() -> None:
    out = io.StringIO()
    bar = bc.ProgressBar(total=20, stream=out)
    for done in range(1, 21):
        bar.update(done, 0)
    bar.close(20, 0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1].startswith("[" + "#" * 30 + "] 20/20 done, 0 failed")


def test_summary_table_mentions_every_metric() -> None:
    summary = bc.summarize_by_class([record()], duration_s=1.0, slo=bc.Slo(tpot_ms=200))
    table = bc.format_summary("t", summary)
    for word in ("TTFT", "TPOT", "ITL", "E2E", "goodput", "output throughput"):
        assert word in table


# soak and plots --------------------------------------------------------------------------------


METRICS = """\
# HELP trtdisagg_kv_cache_total_blocks KV blocks in the pool
# TYPE trtdisagg_kv_cache_total_blocks gauge
trtdisagg_kv_cache_total_blocks{rank="0"} 64.0
trtdisagg_kv_cache_total_blocks{rank="1"} 64.0
trtdisagg_kv_cache_free_blocks{rank="0"} 60.0
trtdisagg_kv_cache_free_blocks{rank="1"} 62.0
trtdisagg_kv_cache_reusable_blocks 6.0
trtdisagg_requests_running 0.0
"""


def test_soak_metrics_parsing_and_block_check() -> None:
    m = soak.parse_metrics(METRICS)
    assert m[soak.TOTAL] == 128.0 and m[soak.FREE] == 122.0
    assert soak.check_blocks("w", m).ok
    leak = soak.check_blocks("w", m | {soak.REUSABLE: 5.0})
    assert not leak.ok and "LEAK" in leak.describe()
    assert not soak.check_blocks("w", {}).ok


def test_plot_series_group_by_label_and_sort_by_x() -> None:
    def doc(label: str, conc: int, p50: float) -> dict[str, Any]:
        return {"label": label, "config": {"concurrency": conc, "request_rate": None},
                "summary": {"all": {"ttft_ms": {"p50": p50}}}}  # fmt: skip

    runs = [(str(d["label"]), d) for d in (doc("a", 8, 3.0), doc("b", 1, 9.0), doc("a", 1, 1.0))]
    conc = plot_bench.series(runs, lambda d: float(d["config"]["concurrency"]),
                             plot_bench.stat_of("all", "ttft_ms", "p50"))  # fmt: skip
    assert conc == {"a": [(1, 1.0), (8, 3.0)], "b": [(1, 9.0)]}
    assert plot_bench.stat_of("all", "tpot_ms", "p50")(runs[0][1]) is None


def test_plots_render(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    paths = []
    for label, mixed in (("agg", False), ("agg", True), ("disagg", True)):
        for i, rate in enumerate((0.5, 1.0)):
            records = [record(cls="short"), record(cls="long", ttft_s=0.5 * (i + 1))]
            if not mixed:
                records = [record()]
            summary = bc.summarize_by_class(records, duration_s=2.0, slo=bc.Slo(ttft_ms=300))
            config = {"mixed": mixed, "long_rate": rate, "request_rate": None if mixed else rate,
                      "concurrency": None if mixed else 2 ** i}  # fmt: skip
            if not mixed and i == 0:
                config["request_rate"] = None
            doc = bc.result_document(tool="bench_serving", label=label, config=config,
                                     summary=summary, records=records)  # fmt: skip
            path = tmp_path / f"{label}-{mixed}-{i}.json"
            bc.write_result(path, doc)
            paths.append(str(path))
    out = tmp_path / "img"
    assert plot_bench.main([*paths, "--out-dir", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {
        "latency_vs_concurrency.png", "mixed_tpot.png", "mixed_ttft.png", "goodput_vs_rate.png",
    }  # fmt: skip
