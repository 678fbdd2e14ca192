"""Coordinator start-up failures, as real processes: each must exit with a message naming the
cause (a config key, missing servers, an unreachable etcd) instead of hanging."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.procs import REPO, free_port

pytestmark = pytest.mark.timeout(120)


def _write(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "disagg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _run(path: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trtdisagg", "coordinator", "--config", str(path)],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _nowhere() -> str:
    return f"127.0.0.1:{free_port()}"


def test_bad_config_fails_at_start_naming_the_key(tmp_path: Path) -> None:
    path = _write(tmp_path, {
        "context_servers": {"urls": "127.0.0.1:8001"},
        "generation_servers": {"urls": ["127.0.0.1:8002"], "router": {"type": "fastest"}},
    })  # fmt: skip
    result = _run(path)
    assert result.returncode == 2
    assert "$.context_servers.urls: expected a list" in result.stderr
    assert "$.generation_servers.router.type" in result.stderr


def test_unknown_key_fails_at_start(tmp_path: Path) -> None:
    path = _write(tmp_path, {
        "context_servers": {"urls": [_nowhere()]}, "generation_servers": {"urls": [_nowhere()]},
        "max_retry": 3,
    })  # fmt: skip
    result = _run(path)
    assert result.returncode == 2 and "$.max_retry: unknown key" in result.stderr


def test_servers_never_healthy_fail_start_naming_them(tmp_path: Path) -> None:
    ctx, gen = _nowhere(), _nowhere()
    port = free_port()
    path = _write(tmp_path, {
        "hostname": "127.0.0.1", "port": port, "server_start_timeout": 2,
        "context_servers": {"urls": [ctx]}, "generation_servers": {"urls": [gen]},
    })  # fmt: skip
    log_path = tmp_path / "coordinator.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trtdisagg", "coordinator", "--config", str(path)],
            cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        saw_503 = False
        with httpx.Client(timeout=1) as client:
            while proc.poll() is None and not saw_503:
                with contextlib.suppress(httpx.TransportError):
                    saw_503 = client.get(f"http://127.0.0.1:{port}/health").status_code == 503
                time.sleep(0.05)  # polling the process's /health while it waits, bounded below
        proc.wait(30)
        output = log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert saw_503, "/health should answer 503 while waiting for servers"
    assert proc.returncode != 0
    assert "server_start_timeout" in output and ctx in output and gen in output


def test_fleet_with_unreachable_etcd_fails_naming_it(tmp_path: Path) -> None:
    etcd = f"http://{_nowhere()}"
    path = _write(tmp_path, {
        "hostname": "127.0.0.1", "port": free_port(), "num_workers": 2,
        "cluster": {"etcd": etcd, "name": "c"}, "server_start_timeout": 2,
    })  # fmt: skip
    result = _run(path)
    assert result.returncode != 0
    assert f"etcd at {etcd} did not answer within server_start_timeout=2s" in result.stderr


def test_an_old_disagg_coordinator_url_is_ignored_with_a_warning(tmp_path: Path) -> None:
    """There is no coordinator state process any more: the key still loads, a warning says it
    is ignored, and the front end checks its servers itself (here: none answers)."""
    path = _write(tmp_path, {
        "hostname": "127.0.0.1", "port": free_port(), "disagg_coordinator_url": "http://x:1",
        "server_start_timeout": 1,
        "context_servers": {"urls": [_nowhere()]}, "generation_servers": {"urls": [_nowhere()]},
    })  # fmt: skip
    result = _run(path)
    assert result.returncode != 0
    assert "disagg_coordinator_url is ignored" in result.stderr
    assert "server_start_timeout" in result.stderr
