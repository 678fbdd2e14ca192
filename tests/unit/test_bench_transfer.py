"""The pure parts of tools/bench_transfer.py: geometry -> bytes/tokens, block plans, argument
validation, statistics and the report's last line. No processes, no NIXL."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

# tools/ is a directory of scripts, not a package (see test_bench_tools.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_transfer as bt

KIB, MIB = 1024, 2**20


# geometry --------------------------------------------------------------------------------------


def test_default_geometry_is_128_kib_per_token_and_64_mib_is_512_tokens() -> None:
    geo = bt.DEFAULT_GEOMETRY
    assert (geo.layers, geo.kv_heads, geo.head_dim, geo.dtype) == (32, 8, 128, "bfloat16")
    assert geo.bytes_per_token == 128 * KIB
    assert geo.block_bytes == 4 * MIB  # 32 tokens per block
    assert geo.tokens_for_mib(64) == 512
    assert geo.blocks_for(512) == 16
    assert geo.transfer_bytes(512) == 64 * MIB


def test_model_8b_matches_the_published_kv_size() -> None:
    assert bt.MODEL_8B.bytes_per_token == 131_072  # performance.md §5.3
    assert bt.MODEL_8B.transfer_bytes(1024) == 134_217_728


@pytest.mark.parametrize(
    ("dtype", "per_token"), [("float16", 2 * 4 * 2 * 16 * 2), ("float32", 2 * 4 * 2 * 16 * 4)]
)
def test_bytes_per_token_follows_every_dimension(dtype: str, per_token: int) -> None:
    geo = bt.Geometry(layers=4, kv_heads=2, head_dim=16, tokens_per_block=8, dtype=dtype)
    assert geo.bytes_per_token == per_token
    assert geo.block_bytes == 8 * per_token


def test_a_partial_last_block_moves_in_full() -> None:
    geo = bt.DEFAULT_GEOMETRY
    assert geo.blocks_for(1) == 1
    assert geo.blocks_for(33) == 2
    assert geo.transfer_bytes(33) == 2 * geo.block_bytes


def test_kv_mib_rounds_down_to_whole_tokens() -> None:
    geo = bt.DEFAULT_GEOMETRY
    assert geo.tokens_for_mib(0.25) == 2  # 256 KiB / 128 KiB
    assert geo.tokens_for_mib(0.3) == 2
    with pytest.raises(ValueError, match="holds no token"):
        geo.tokens_for_mib(0.1)
    with pytest.raises(ValueError, match="positive"):
        geo.tokens_for_mib(0)


def test_geometry_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="layers must be positive"):
        attrs.evolve(bt.DEFAULT_GEOMETRY, layers=0)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        attrs.evolve(bt.DEFAULT_GEOMETRY, dtype="int8")
    with pytest.raises(ValueError, match="tokens must be positive"):
        bt.DEFAULT_GEOMETRY.blocks_for(0)


# block plans -----------------------------------------------------------------------------------


def test_consecutive_blocks_are_one_descriptor() -> None:
    plan = bt.plan_blocks(16, scatter=False)
    assert plan.ctx_blocks == tuple(range(16))
    assert plan.gen_blocks == tuple(range(1, 17))
    assert plan.expected_descriptors == 1
    assert (plan.ctx_pool_blocks, plan.gen_pool_blocks) == (16, 17)
    assert plan.raw_dst_first == 1


def test_scattered_gen_blocks_are_one_descriptor_each() -> None:
    plan = bt.plan_blocks(4, scatter=True)
    assert plan.gen_blocks == (1, 3, 5, 7)
    assert plan.expected_descriptors == 4
    assert plan.gen_pool_blocks == 8
    # the raw write's contiguous destination fits in the pool too
    assert plan.raw_dst_first + plan.num_blocks <= plan.gen_pool_blocks


def test_count_runs_needs_both_sides_consecutive() -> None:
    assert bt.count_runs([], []) == 0
    assert bt.count_runs([5], [9]) == 1
    assert bt.count_runs([0, 1, 2, 3], [4, 5, 9, 10]) == 2
    assert bt.count_runs([0, 2, 3], [1, 2, 3]) == 2
    with pytest.raises(ValueError, match="2 source blocks but 1"):
        bt.count_runs([0, 1], [0])


# arguments -------------------------------------------------------------------------------------


def test_no_arguments_is_the_cpu_64_mib_case() -> None:
    cfg = bt.parse_config([])
    assert cfg.geometry == bt.DEFAULT_GEOMETRY
    assert (cfg.tokens, cfg.num_bytes, cfg.device, cfg.scatter) == (512, 64 * MIB, "cpu", False)
    assert 1 <= cfg.iterations <= 50 and cfg.warmup >= 1
    assert cfg.result_json is None


def test_geometry_options_and_derived_tokens() -> None:
    cfg = bt.parse_config(
        ["--layers", "16", "--kv-heads", "4", "--head-dim", "64", "--dtype", "float32",
         "--tokens-per-block", "16", "--kv-mib", "8"]
    )  # fmt: skip
    assert cfg.geometry.bytes_per_token == 2 * 16 * 4 * 64 * 4  # 32 KiB
    assert cfg.tokens == 256
    assert cfg.num_bytes == 8 * MIB
    assert bt.parse_config(["--tokens", "100"]).num_bytes == 4 * 4 * MIB  # 4 blocks of 32


def test_model_8b_preset(tmp_path: Path) -> None:
    cfg = bt.parse_config(["--model-8b", "--tokens", "1024", "--result-json", str(tmp_path / "r")])
    assert cfg.geometry == bt.MODEL_8B
    assert cfg.label == "llama-3.1-8b"
    assert cfg.num_bytes == 128 * MIB
    assert cfg.result_json == tmp_path / "r"
    # restating the preset's own values is allowed
    assert bt.parse_config(["--model-8b", "--layers", "32"]).geometry == bt.MODEL_8B


def test_each_child_may_be_pinned_as_a_worker_s_engine() -> None:
    cpu = min(os.sched_getaffinity(0))
    cfg = bt.parse_config(["--ctx-cpus", str(cpu)])
    assert (cfg.ctx_cpus, cfg.gen_cpus) == ((cpu,), None)
    assert bt.parse_config([]).ctx_cpus is None


def _rejected(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as excinfo:
        bt.parse_config(argv)
    assert excinfo.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--ctx-tp", "--gen-tp", "--ctx-pp", "--gen-pp"])
def test_heterogeneous_pairings_are_refused_clearly(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _rejected([flag, "2"], capsys)
    assert "heterogeneous pairings need multi-rank workers (issue 5)" in err
    # the homogeneous value is accepted
    assert bt.parse_config([flag, "1"]).tokens == 512


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model-8b", "--layers", "16"], "--model-8b fixes the geometry"),
        (["--model-8b", "--dtype", "float16"], "--model-8b fixes the geometry"),
        (["--tokens", "0"], "--tokens must be positive"),
        (["--kv-mib", "-1"], "--kv-mib must be positive"),
        (["--kv-mib", "0.01"], "holds no token"),
        (["--iterations", "0"], "--iterations and --warmup must be >= 1"),
        (["--warmup", "0"], "--iterations and --warmup must be >= 1"),
        (["--layers", "0"], "layers must be positive"),
        (["--timeout", "0"], "--timeout must be positive"),
        (["--gen-gpu", "1"], "need --device cuda"),
        (["--device", "cuda", "--gen-gpu", "-1"], "GPU indices"),
        (["--ctx-tp", "0"], "parallel sizes must be >= 1"),
        (["--ctx-busy-ms", "-1"], "--ctx-busy-ms must be in [0, 10000]"),
        (["--gen-cpus", "2-1"], "--gen-cpus: range '2-1' runs backwards"),
        (["--ctx-cpus", str(max(os.sched_getaffinity(0)) + 1)], "not available to this process"),
        (["--raw-poll-us", "-1"], "--raw-poll-us must be in [0, 10000]"),
    ],
)
def test_invalid_arguments(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in _rejected(argv, capsys)


def test_ctx_busy_is_off_unless_asked_and_named_in_the_report() -> None:
    assert bt.parse_config([]).ctx_busy_s == 0.0
    assert bt.parse_config(["--ctx-busy-ms", "5"]).ctx_busy_s == pytest.approx(0.005)
    assert "ctx busy" not in bt.format_report(_doc([], {"context-first": 0.8}))
    busy = bt.format_report(_doc(["--ctx-busy-ms", "5"], {"context-first": 0.8}))
    assert "ctx busy: its next step runs 5 ms in a worker thread" in busy


def test_raw_spins_on_cuda_and_sleeps_on_the_cpu_unless_told() -> None:
    """A 20 us sleep lasts 55-110 us here: on CUDA it slowed raw, the anchor, down; on the
    2-core CPU machine spinning starves the copy instead."""
    assert bt.parse_config(["--device", "cuda"]).raw_poll_s == 0.0
    assert bt.parse_config([]).raw_poll_s == pytest.approx(20e-6)
    assert bt.parse_config(["--device", "cuda", "--raw-poll-us", "20"]).raw_poll_s == (
        pytest.approx(20e-6)
    )
    assert bt.parse_config(["--raw-poll-us", "0"]).raw_poll_s == 0.0
    assert "raw polls spinning" in bt.format_report(
        _doc(["--raw-poll-us", "0"], {"context-first": 0.8})
    )
    assert "raw polls every 20 us (sleeping)" in bt.format_report(_doc([], {"context-first": 0.8}))


def test_tokens_and_kv_mib_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    assert "not allowed with argument" in _rejected(["--tokens", "8", "--kv-mib", "1"], capsys)


def test_config_is_json_ready(tmp_path: Path) -> None:
    doc = bt.parse_config(["--result-json", str(tmp_path / "x.json")]).to_json()
    assert doc["geometry"]["layers"] == 32
    assert doc["result_json"] == str(tmp_path / "x.json")
    assert doc["schedules"] == ["context-first"]
    assert json.loads(json.dumps(doc)) == doc


@pytest.mark.parametrize(
    ("argv", "schedules"),
    [
        ([], ("context-first",)),  # the figures so far: unchanged by default
        (["--schedule", "context-first"], ("context-first",)),
        (["--schedule", "generation-first"], ("generation-first",)),
        (["--schedule", "both"], ("context-first", "generation-first")),
    ],
)
def test_schedule_option(argv: list[str], schedules: tuple[str, ...]) -> None:
    cfg = bt.parse_config(argv)
    assert cfg.schedules == schedules
    assert cfg.primary_schedule == schedules[0]
    assert cfg.to_json()["schedules"] == list(schedules)


def test_unknown_schedule_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert "invalid choice: 'gen-first'" in _rejected(["--schedule", "gen-first"], capsys)
    with pytest.raises(ValueError, match="--schedule must be one of"):
        bt.schedules_for("gen-first")


@pytest.mark.parametrize(
    "schedules", [(), ("context-first", "context-first"), ("context-first", "raw")]
)
def test_bench_config_validates_its_schedules(schedules: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="schedules must be distinct"):
        attrs.evolve(bt.parse_config([]), schedules=schedules)


def test_result_line_names() -> None:
    assert bt.result_line_name("generation-first") == "ratio_vs_raw_nixl_generation_first"
    assert bt.result_line_name("context-first") == "ratio_vs_raw_nixl_context_first"


# statistics and report -------------------------------------------------------------------------


def test_path_stats_and_ratio() -> None:
    xcvr = bt.PathStats.of([0.030, 0.020, 0.025], 50_000_000)
    raw = bt.PathStats.of([0.020, 0.021, 0.019], 50_000_000)
    assert xcvr.median_s == pytest.approx(0.025)
    assert xcvr.gbps == pytest.approx(2.0)
    assert raw.gbps == pytest.approx(2.5)
    assert bt.ratio_vs_raw(xcvr, raw) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="positive times"):
        bt.PathStats.of([], 1)


def test_overhead_is_per_iteration_difference() -> None:
    over = bt.Overhead.of([0.030, 0.026, 0.021], [0.020, 0.025, 0.020])
    assert over.p50_s == pytest.approx(0.001)
    assert over.min_s == pytest.approx(0.001)
    assert over.p90_s == pytest.approx(0.0082)
    with pytest.raises(ValueError, match="2 transceiver vs 1 raw"):
        bt.Overhead.of([1.0, 2.0], [1.0])


def test_stage_offsets_are_per_key_and_relative_to_gens_request() -> None:
    gen = [[1, "request", 10.0], [1, "outcome", 10.004], [2, "request", 20.0]]
    gen += [[2, "notice", 20.002], [2, "notice", 20.009], [2, "outcome", 20.006]]
    ctx = [[1, "received", 10.001], [2, "received", 20.003], [3, "received", 30.0]]
    stamps: dict[str, list[list[Any]]] = {"gen": gen, "ctx": ctx}
    stages = bt.stage_offsets(stamps, [1, 2])  # key 3 was not measured
    assert list(stages) == ["gen.request", "ctx.received", "gen.notice", "gen.outcome"]
    assert stages["ctx.received"]["p50_s"] == pytest.approx(0.002)  # (0.001 + 0.003) / 2
    assert stages["gen.notice"] == {
        "p50_s": pytest.approx(0.002),
        "p90_s": pytest.approx(0.002),
        "n": 1,
    }
    assert stages["gen.outcome"]["n"] == 2


def test_generation_first_stages_count_from_ctxs_respond() -> None:
    # gen asked at 10.0; its REQUEST_DATA waited at ctx from 10.001 until the KV was ready
    gen = [[1, "request", 10.0], [1, "notice", 10.0205], [1, "outcome", 10.021]]
    ctx = [[1, "received", 10.001], [1, "respond", 10.005], [1, "posted", 10.0052]]
    ctx += [[9, "respond", 90.0]]  # another key, not measured
    stages = bt.stage_offsets({"gen": gen, "ctx": ctx}, [1], origin="ctx.respond")
    assert list(stages) == [
        "ctx.respond", "gen.request", "ctx.received", "ctx.posted", "gen.notice", "gen.outcome"
    ]  # fmt: skip
    assert stages["ctx.respond"]["p50_s"] == 0.0
    assert stages["gen.request"]["p50_s"] == pytest.approx(-0.005)
    assert stages["ctx.received"]["p50_s"] == pytest.approx(-0.004)
    assert stages["gen.outcome"]["p50_s"] == pytest.approx(0.016)
    # keys without the origin stamp (e.g. context-first ones) count nowhere
    assert bt.stage_offsets({"gen": gen, "ctx": ctx[:1]}, [1], origin="ctx.respond") == {}


def test_summarize_schedule_pairs_with_the_same_iterations_raw_times() -> None:
    doc = bt.summarize_schedule(
        wall_s=[0.030, 0.026, 0.021],
        outcome_s=[0.031, 0.027, 0.022],
        write_s=[0.020, 0.020, 0.020],
        raw_s=[0.020, 0.025, 0.020],
        num_bytes=50_000_000,
        cold_s=0.2,
        stages={},
        timed=bt.TIMED["generation-first"],
    )
    assert doc["timed"] == "ctx KV ready->gen outcome"
    assert doc["cold_s"] == 0.2
    assert doc["transceiver"]["median_s"] == pytest.approx(0.026)
    assert doc["handover_overhead"]["p50_s"] == pytest.approx(0.001)
    assert doc["ratio_vs_raw_nixl"] == pytest.approx(0.020 / 0.026)
    assert doc["samples"]["transceiver_s"] == [0.030, 0.026, 0.021]
    assert json.loads(json.dumps(doc)) == doc


def test_rss_growth() -> None:
    assert bt.rss_growth(1000, 1050) == pytest.approx(0.05)
    assert bt.rss_growth(None, 1050) is None
    assert bt.rss_growth(1000, None) is None


def _stats(median: float) -> dict[str, Any]:
    return attrs.asdict(bt.PathStats.of([median], 64 * MIB))


def _schedule(median: float, ratio: float, timed: str) -> dict[str, Any]:
    return {
        "timed": timed,
        "cold_s": 0.4,
        "transceiver": _stats(median),
        "transceiver_write": _stats(0.021),
        "handover_overhead": {"p50_s": 0.005, "p90_s": 0.006, "min_s": 0.001},
        "stages": {},
        "ratio_vs_raw_nixl": ratio,
    }


def _doc(argv: list[str], ratios: dict[str, float]) -> dict[str, Any]:
    """A result doc as run_bench makes it, for the selected schedules (ratios by schedule)."""
    cfg = bt.parse_config(argv)
    rss = {"after_warmup_kib": 2048, "at_checkpoint_kib": None, "end_kib": 2048}
    schedules = {s: _schedule(0.025, ratios[s], bt.TIMED[s]) for s in cfg.schedules}
    primary = schedules[cfg.primary_schedule]
    return {
        "config": cfg.to_json(),
        "devices": "cpu -> cpu",
        "bytes": cfg.num_bytes,
        "num_blocks": 16,
        "descriptors": 1,
        "expected_descriptors": 1,
        "primary_schedule": cfg.primary_schedule,
        "cold": {"transceiver_s": 0.4, "raw_s": 0.05},
        "transceiver": primary["transceiver"],
        "raw": _stats(0.020),
        "raw_initiator": _stats(0.019),
        "transceiver_write": primary["transceiver_write"],
        "handover_overhead": primary["handover_overhead"],
        "stages": {},
        "ratio_vs_raw_nixl": primary["ratio_vs_raw_nixl"],
        "schedules": schedules,
        "rss": {"ctx": {**rss, "growth_checkpoint_to_end": None}, "gen": {**rss,
                "growth_checkpoint_to_end": 0.01}},
        "transceiver_statistics": {
            "ctx": {"senders": 0, "receivers": 0, "bad_frames": 0, "rendezvous": 0, "early": 0},
            "gen": {"senders": 0, "receivers": 0, "bad_frames": 0, "rendezvous": 1, "early": 0},
        },
        "cpu_share": {"measured": {"ctx": 1.5, "gen": None}, "idle": {"ctx": 0.98, "gen": 0.97}},
        "verified": True,
    }  # fmt: skip


def test_report_ends_with_the_ratio_line() -> None:
    text = bt.format_report(_doc([], {"context-first": 0.8}))
    lines = text.splitlines()
    assert lines[-1] == "ratio_vs_raw_nixl=0.8000"
    assert not any(line.startswith("ratio_vs_raw_nixl_") for line in lines)
    assert "67108864 bytes" in text
    assert "descriptors: transceiver 1 (expected 1), raw 1" in text
    assert "context-first (gen call->outcome)" in text
    assert "p50 5.000 ms" in text
    assert "growth +1.00%" in text
    assert "measured phase ctx 1.50 gen -; idle ctx 0.98 gen 0.97" in text
    assert "ctx early 0" in text


def test_report_of_both_schedules_ends_with_context_firsts_ratio() -> None:
    doc = _doc(["--schedule", "both"], {"context-first": 0.7, "generation-first": 0.85})
    text = bt.format_report(doc)
    lines = text.splitlines()
    assert lines[-2:] == ["ratio_vs_raw_nixl_generation_first=0.8500", "ratio_vs_raw_nixl=0.7000"]
    assert "generation-first (ctx KV ready->gen outcome)" in text
    assert "context-first (gen call->outcome)" in text
    assert "generation-first: ratio vs raw 0.8500; handover overhead" in text
    assert (
        "cold first transfer: context-first 400.000 ms (rendezvous + connection), "
        "generation-first 400.000 ms, raw 50.000 ms"
    ) in text


def test_report_of_generation_first_alone_ends_with_its_ratio() -> None:
    doc = _doc(["--schedule", "generation-first"], {"generation-first": 0.85})
    doc["schedules"]["generation-first"]["stages"] = {
        "ctx.respond": {"p50_s": 0.0, "p90_s": 0.0, "n": 1},
        "gen.request": {"p50_s": -0.003, "p90_s": -0.002, "n": 1},
        "gen.outcome": {"p50_s": 0.022, "p90_s": 0.023, "n": 1},
    }
    text = bt.format_report(doc)
    assert text.splitlines()[-1] == "ratio_vs_raw_nixl=0.8500"
    assert "context-first" not in text
    assert (
        "generation-first: stages after ctx.respond (p50/p90 ms): gen.request -3.000/-2.000, "
        "gen.outcome 22.000/23.000"
    ) in text


def test_report_of_a_result_file_from_before_schedules() -> None:
    doc = _doc([], {"context-first": 0.8})
    del doc["schedules"], doc["primary_schedule"], doc["config"]["schedules"]
    for role in ("ctx", "gen"):
        del doc["transceiver_statistics"][role]["early"]
    assert bt.format_report(doc).splitlines()[-1] == "ratio_vs_raw_nixl=0.8000"


def test_cpu_share_and_proc_stat_of_this_process() -> None:
    assert bt.cpu_share(1.0, 2.5, 3.0) == pytest.approx(0.5)
    assert bt.cpu_share(None, 2.5, 3.0) is None
    assert bt.cpu_share(1.0, 2.0, 0.0) is None
    assert bt.read_cpu_s(os.getpid()) > 0
