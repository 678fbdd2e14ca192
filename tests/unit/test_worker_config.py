"""Worker config: YAML through one converter; every error names its key path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trtdisagg.config import ConfigError, WorkerConfig, load_worker_config
from trtdisagg.cpu_affinity import CpuList
from trtdisagg.kv.page_table import Layout


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "worker.yaml"
    path.write_text(text)
    return path


def test_defaults_and_overrides(tmp_path: Path) -> None:
    path = _write(tmp_path, "port: 9001\nkv_cache_config: {layout: NHD, tokens_per_block: 16}\n")
    config = load_worker_config(path, {"port": 9100, "model": None})
    assert config.port == 9100  # CLI flag beats the file
    assert config.model == "tiny"  # an unset flag changes nothing
    assert config.kv_cache_config.layout is Layout.NHD
    assert config.kv_cache_config.tokens_per_block == 16
    assert load_worker_config(None) == WorkerConfig()
    assert not WorkerConfig().cpu_compile
    assert load_worker_config(_write(tmp_path, "cpu_compile: true\n")).cpu_compile
    fraction = load_worker_config(
        _write(tmp_path, "kv_cache_config: {free_gpu_memory_fraction: 0.5}\n")
    )
    assert fraction.kv_cache_config.free_gpu_memory_fraction == 0.5
    assert WorkerConfig().cache_transceiver_config.peer_probe_ms == 5000
    member = load_worker_config(
        _write(
            tmp_path,
            "host: 0.0.0.0\nadvertise_host: 198.18.0.2\ncluster: {etcd: 'e:2379', name: c}\n",
        )
    )
    assert member.cluster is not None and member.cluster.lease_ttl_s == 10
    assert member.advertise_host == "198.18.0.2"


@pytest.mark.parametrize(
    ("text", "override", "cpus"),
    [
        ("cpu_affinity: [3, 1]\n", None, (1, 3)),
        ("cpu_affinity: 0-2,7\n", None, (0, 1, 2, 7)),
        ("cpu_affinity: 5\n", None, (5,)),
        ("cpu_affinity: [3]\n", "2,4-5", (2, 4, 5)),  # --cpu-affinity beats the file
        ("port: 9001\n", None, None),
        # one CPU a rank: enough where NIXL's progress thread is off (the CPU's default)
        ("cpu_affinity: 0\ncache_transceiver_config: {backend: NIXL}\n", None, (0,)),
        (
            "device: cuda\ncpu_affinity: 0-1\ncache_transceiver_config: {backend: NIXL}\n",
            None,
            (0, 1),
        ),
    ],
)
def test_cpu_affinity_reads_a_list_or_the_kernel_s_text(
    tmp_path: Path, text: str, override: str | None, cpus: CpuList | None
) -> None:
    config = load_worker_config(_write(tmp_path, text), {"cpu_affinity": override})
    assert config.cpu_affinity == cpus


@pytest.mark.parametrize(
    ("text", "spins"),
    [
        ("device: cpu\n", False),  # an idle CPU worker must not burn a core
        ("device: cuda\n", True),
        ("device: cpu\ncache_transceiver_config: {nixl_progress_thread: true}\n", True),
        ("device: cuda\ncache_transceiver_config: {nixl_progress_thread: false}\n", False),
    ],
)
def test_nixl_s_progress_thread_is_on_for_cuda_unless_set(
    tmp_path: Path, text: str, spins: bool
) -> None:
    assert load_worker_config(_write(tmp_path, text)).nixl_progress_thread is spins


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("bogus: 1\n", ["bogus"]),
        ("kv_cache_config: {tokens_per_blok: 16}\n", ["kv_cache_config", "tokens_per_blok"]),
        ("kv_cache_config: {layout: ABC}\n", ["kv_cache_config.layout"]),
        ("port: eighty\n", ["port"]),
        ("device: tpu\n", ["device", "tpu"]),
        ("dtype: int8\n", ["dtype", "int8"]),
        ("max_batch_size: 0\n", ["max_batch_size", "positive"]),
        ("prefill_chunk_tokens: 64\n", ["prefill_chunk_tokens", "exceed max_batch_size (64)"]),
        ("prefill_chunk_tokens: '256'\n", ["$.prefill_chunk_tokens", "expected an integer"]),
        ("cache_transceiver_config: {backend: RDMA}\n", ["cache_transceiver_config.backend"]),
        (
            "cache_transceiver_config: {peer_probe_ms: 0}\n",
            ["cache_transceiver_config", "peer_probe_ms", "positive"],
        ),
        ("kv_cache_config: {max_tokens: 8, tokens_per_block: 32}\n", ["max_tokens"]),
        ("cluster: {etcd: 'etcd:2379'}\n", ["cluster.name", "missing"]),
        ("cluster: {etcd: etcd, name: c}\n", ["cluster", "etcd", "http://host:port"]),
        ("cluster: {etcd: 'e:1', name: a/b}\n", ["cluster", "name", "a/b"]),
        ("cluster: {etcd: 'e:1', name: c, lease_ttl_s: 0}\n", ["lease_ttl_s", "positive"]),
        ("host: 0.0.0.0\ncluster: {etcd: 'e:1', name: c}\n", ["advertise_host", "required"]),
        ("cpu_affinity: 3-1\n", ["cpu_affinity", "backwards"]),
        ("cpu_affinity: [0, 0]\n", ["cpu_affinity", "twice"]),
        ("cpu_affinity: []\n", ["cpu_affinity", "no CPU"]),
        ("cpu_affinity: [-1]\n", ["cpu_affinity", "integers"]),
        ("cpu_affinity: 0-70000\n", ["cpu_affinity", "below"]),
        ("cpu_affinity: one\n", ["cpu_affinity", "'0-3,8'"]),
        ("cpu_affinity: {a: 1}\n", ["cpu_affinity", "list"]),
        ("cpu_affinity: [0]\ntensor_parallel_size: 2\n", ["cpu_affinity", "2 rank(s)"]),
        (
            "device: cuda\ncpu_affinity: [0, 1, 2]\ntensor_parallel_size: 2\n"
            "cache_transceiver_config: {backend: NIXL}\n",
            ["cpu_affinity", "needs 2 at least", "progress thread"],
        ),
        # YAML's scalars are taken as typed, never converted: a quoted or fractional number
        # for an integer, or a word for a flag, is refused rather than read as something else
        ("cuda_graphs: maybe\n", ["$.cuda_graphs", "expected a boolean, got a string"]),
        ("cpu_compile: 'no'\n", ["$.cpu_compile", "expected a boolean"]),
        ("port: 9001.7\n", ["$.port", "expected an integer, got a number"]),
        ("max_batch_size: '12'\n", ["$.max_batch_size", "expected an integer, got a string"]),
        ("cuda_device: true\n", ["$.cuda_device", "expected an integer, got a boolean"]),
        (
            "kv_cache_config: {free_gpu_memory_fraction: '0.5'}\n",
            ["$.kv_cache_config.free_gpu_memory_fraction", "expected a number"],
        ),
        ("- a list\n", ["mapping"]),
        ("port: [1\n", ["not valid YAML"]),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        load_worker_config(_write(tmp_path, text))
    message = str(caught.value)
    for word in words:
        assert word in message, message
    assert str(tmp_path / "worker.yaml") in message


def test_a_bad_config_fails_at_start_with_the_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "kv_cache_config: {layout: DIAGONAL}\n")
    done = subprocess.run(
        [sys.executable, "-m", "trtdisagg", "ctx", "--config", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "kv_cache_config.layout" in done.stderr, done.stderr


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_cpu_this_process_may_not_use_fails_at_start_naming_it(
    tmp_path: Path, ranks: int
) -> None:
    """Also when it is another rank's: rank 0 checks them all before it spawns any."""
    absent = max(os.sched_getaffinity(0)) + 1
    cpus = [min(os.sched_getaffinity(0)), absent][-ranks:]
    path = _write(tmp_path, f"cpu_affinity: {cpus}\ntensor_parallel_size: {ranks}\n")
    done = subprocess.run(
        [sys.executable, "-m", "trtdisagg", "ctx", "--config", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"cpu_affinity: CPU {absent} not available to this process" in done.stderr, done.stderr
