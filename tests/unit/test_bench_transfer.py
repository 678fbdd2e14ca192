"""The pure parts of tools/bench_transfer.py: geometry -> bytes/tokens, block plans, argument
validation, statistics and the report's last line. No processes, no NIXL."""

from __future__ import annotations

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
    ],
)
def test_invalid_arguments(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in _rejected(argv, capsys)


def test_tokens_and_kv_mib_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    assert "not allowed with argument" in _rejected(["--tokens", "8", "--kv-mib", "1"], capsys)


def test_config_is_json_ready(tmp_path: Path) -> None:
    doc = bt.parse_config(["--result-json", str(tmp_path / "x.json")]).to_json()
    assert doc["geometry"]["layers"] == 32
    assert doc["result_json"] == str(tmp_path / "x.json")


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


def test_rss_growth() -> None:
    assert bt.rss_growth(1000, 1050) == pytest.approx(0.05)
    assert bt.rss_growth(None, 1050) is None
    assert bt.rss_growth(1000, None) is None


def _stats(median: float) -> dict[str, Any]:
    return attrs.asdict(bt.PathStats.of([median], 64 * MIB))


def test_report_ends_with_the_ratio_line() -> None:
    cfg = bt.parse_config([])
    rss = {"after_warmup_kib": 2048, "at_checkpoint_kib": None, "end_kib": 2048}
    doc = {
        "config": cfg.to_json(),
        "devices": "cpu -> cpu",
        "bytes": cfg.num_bytes,
        "num_blocks": 16,
        "descriptors": 1,
        "expected_descriptors": 1,
        "cold": {"transceiver_s": 0.4, "raw_s": 0.05},
        "transceiver": _stats(0.025),
        "raw": _stats(0.020),
        "raw_initiator": _stats(0.019),
        "transceiver_write": _stats(0.021),
        "handover_overhead": {"p50_s": 0.005, "p90_s": 0.006, "min_s": 0.001},
        "rss": {"ctx": {**rss, "growth_checkpoint_to_end": None}, "gen": {**rss,
                "growth_checkpoint_to_end": 0.01}},
        "transceiver_statistics": {
            "ctx": {"senders": 0, "receivers": 0, "bad_frames": 0, "rendezvous": 0},
            "gen": {"senders": 0, "receivers": 0, "bad_frames": 0, "rendezvous": 1},
        },
        "cpu_share": {"measured": {"ctx": 1.5, "gen": None}, "idle": {"ctx": 0.98, "gen": 0.97}},
        "verified": True,
        "ratio_vs_raw_nixl": 0.8,
    }  # fmt: skip
    text = bt.format_report(doc)
    lines = text.splitlines()
    assert lines[-1] == "ratio_vs_raw_nixl=0.8000"
    assert "67108864 bytes" in text
    assert "descriptors: transceiver 1 (expected 1), raw 1" in text
    assert "p50 5.000 ms" in text
    assert "growth +1.00%" in text
    assert "measured phase ctx 1.50 gen -; idle ctx 0.98 gen 0.97" in text


def test_cpu_share_and_proc_stat_of_this_process() -> None:
    assert bt.cpu_share(1.0, 2.5, 3.0) == pytest.approx(0.5)
    assert bt.cpu_share(None, 2.5, 3.0) is None
    assert bt.cpu_share(1.0, 2.0, 0.0) is None
    assert bt.read_cpu_s(os.getpid()) > 0
