"""A rank of a multi-rank worker that dies takes its instance down instead of hanging it.

(What multi-rank workers serve is tested in test_hetero_pairings.py, on its shared instances.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.instances import running_instances
from tests.procs import Server, cpus_of_threads
from trtdisagg.cpu_affinity import rank_share
from trtdisagg.model.tiny import TinySpec, write_checkpoint

SPEC = TinySpec(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96)


def _overrides(model: Path, tp: int, pp: int) -> dict[str, Any]:
    return {
        "model": str(model),
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        # Small steps: long prompts are prefilled in chunks that share steps with decodes.
        "max_num_tokens": 48,
        "kv_cache_config": {"tokens_per_block": 8, "max_tokens": 4096},
    }


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "gqa4"
    write_checkpoint(SPEC, path)
    return path


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return True
        time.sleep(0.05)  # polling process state, bounded above
    return False


def _follower(server: Server) -> int:
    # The spawn start method adds a resource tracker child; ranks are named in their command.
    for kid in _children(server.proc.pid):
        if "spawn_main" in Path(f"/proc/{kid}/cmdline").read_bytes().decode(errors="replace"):
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes()
            if b"resource_tracker" not in cmd:
                return kid
    raise AssertionError(f"no rank process under pid {server.proc.pid}")


def test_a_dead_follower_stops_the_instance(tmp_path: Path, model: Path) -> None:
    """(Its ranks are pinned, each to its slice of `cpu_affinity`: checked first.)"""
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, f"two ranks pinned apart need two CPUs, this process has {cpus}"
    specs = {"tp2": ("ctx", {**_overrides(model, 2, 1), "cpu_affinity": cpus})}
    with running_instances(tmp_path, specs) as servers:
        server = servers["tp2"]
        follower = _follower(server)
        assert set(cpus_of_threads(server.proc.pid).values()) == {rank_share(cpus, 0, 2)}
        assert set(cpus_of_threads(follower).values()) == {rank_share(cpus, 1, 2)}
        os.kill(follower, signal.SIGKILL)
        server.proc.wait(30)
        assert server.proc.returncode != 0
        assert f"rank 1 (pid {follower}) exited with code -9" in server.log()


def test_a_dead_rank0_takes_its_followers_along(tmp_path: Path, model: Path) -> None:
    specs = {"tp2": ("ctx", _overrides(model, 2, 1))}
    with running_instances(tmp_path, specs) as servers:
        server = servers["tp2"]
        follower = _follower(server)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        assert _wait_gone(follower, 30), f"rank 1 (pid {follower}) outlived rank 0"
        with pytest.raises(httpx.TransportError):
            httpx.get(server.url + "/health", timeout=2)
