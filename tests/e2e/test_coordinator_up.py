"""`python -m trtdisagg up`: a local cluster stops cleanly as soon as any child dies, and a second
signal during the stop still stops it. (`make serve`'s cluster printing its URL, serving and
stopping on Ctrl-C: tests/e2e/test_security.py, which also checks what it binds.)"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.procs import REPO, free_port

pytestmark = pytest.mark.timeout(300)


@contextlib.contextmanager
def cluster(tmp_path: Path, **extra: Any) -> Iterator[tuple[subprocess.Popen[bytes], Path, int]]:
    port = free_port()
    worker = {
        "model": "tiny",
        "kv_cache_config": {"tokens_per_block": 16},
        "cache_transceiver_config": {"backend": "NIXL", "nixl_progress_thread": False},
    }
    spec = {
        **extra,
        "log_dir": str(tmp_path / "logs"),
        "stop_grace": 5,
        "ctx": [{**worker, "port": free_port()}],
        "gen": [{**worker, "port": free_port()}],
        "coordinator": {"port": port, "health_check_interval": 0.2},
    }
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "up.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trtdisagg", "up", str(path)],
            stdout=sink, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while b"cluster ready" not in out.read_bytes():
            assert proc.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.1)  # waiting on the launcher's own readiness line, bounded above
        yield proc, out, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _child_pids(text: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"started (\S+) \(pid (\d+)\)", text)}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_up_with_an_embedded_etcd_serves_registered_workers_and_stops_when_one_dies(
    tmp_path: Path,
) -> None:
    """`etcd: embedded`: etcd starts first, the workers register themselves, the coordinator is
    given only the etcd URL. Any child dying (etcd included) stops them all."""
    with cluster(tmp_path, etcd="embedded", cluster_name="uptest") as (proc, out, port):
        pids = _child_pids(out.read_text())
        assert set(pids) == {"etcd", "ctx-0", "gen-0", "coordinator"}
        coordinator = yaml.safe_load((tmp_path / "logs" / "coordinator.yaml").read_text())
        assert coordinator["cluster"]["name"] == "uptest"
        assert "urls" not in coordinator["context_servers"]
        body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        info = httpx.get(f"http://127.0.0.1:{port}/cluster_info").json()
        assert info["membership"]["stale"] is False and len(info["server_lists"]["context"]) == 1
        os.kill(pids["gen-0"], signal.SIGKILL)
        assert proc.wait(30) == 1
        assert "gen-0 exited" in out.read_text()
        assert all(_gone(pid) for pid in pids.values())


def test_a_second_signal_during_the_stop_still_stops_every_child(tmp_path: Path) -> None:
    """Ctrl-C pressed twice (or a supervisor repeating SIGTERM) must not orphan the cluster."""
    with cluster(tmp_path) as (proc, out, _port):
        pids = _child_pids(out.read_text())
        # A stopped child cannot act on SIGTERM, so the stop lasts until the second signal
        # (the other children may be gone in milliseconds).
        os.kill(pids["gen-0"], signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        # The second signal once the stop has begun (its log line is the event to wait for).
        deadline = time.monotonic() + 10
        while "stopping the cluster" not in out.read_text():
            assert time.monotonic() < deadline, "up never began stopping"
            time.sleep(0.02)  # polling an observable log line, bounded above
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert "received SIGTERM again: killing the cluster now" in out.read_text()
        assert all(_gone(pid) for pid in pids.values()), "a child outlived up"
