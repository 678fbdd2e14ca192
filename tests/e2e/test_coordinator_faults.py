"""Worker deaths under a real coordinator: 5xx within request_timeout, 503 with no ctx left,
and service resuming when the workers come back, without restarting the coordinator.

Requests use conditional disaggregation (short prompts prefilled on gen alone), so this runs
with or without the KV transceiver. The ctx and the gen are the module's: a test that kills them
leaves the next one to start them again, on the same ports.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import yaml

from tests.procs import REPO, free_port, metric, spawn, stop, wait_healthy, worker_config

pytestmark = pytest.mark.timeout(300)

REQUEST_TIMEOUT = 20


@attrs.define(eq=False)
class Workers:
    """A ctx and a gen on fixed ports, shared by the module: a test kills them, and the next one
    finds them started again (`up`) on the same ports."""

    tmp: Path
    ports: dict[str, int]
    procs: dict[str, subprocess.Popen[bytes]] = attrs.Factory(dict)

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def up(self) -> None:
        """Start each role whose process is gone, all at once, and wait until each is healthy."""
        starting: dict[str, Path] = {}
        for role, port in self.ports.items():
            if role in self.procs and self.procs[role].poll() is None:
                continue
            path = self.tmp / f"{role}.yaml"
            transfer = {"backend": "NIXL", "nixl_progress_thread": False}
            path.write_text(yaml.safe_dump(worker_config(cache_transceiver_config=transfer)))
            log_path = self.tmp / f"{role}-{port}-{time.monotonic_ns()}.log"
            args = [role, "--config", str(path), "--port", str(port)]
            with open(log_path, "wb") as log_file:
                self.procs[role] = subprocess.Popen(
                    [sys.executable, "-m", "trtdisagg", *args],
                    stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO,
                )  # fmt: skip
            starting[role] = log_path
        for role, log_path in starting.items():
            wait_healthy(self.url(role), self.procs[role], log_path, 120)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            stop(proc)


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    started = Workers(tmp_path_factory.mktemp("workers"), {"ctx": free_port(), "gen": free_port()})
    try:
        yield started
    finally:
        started.stop_all()


def running(url: str) -> float:
    return metric(httpx.get(url + "/metrics").text, "trtdisagg_requests_running")


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        time.sleep(0.05)  # polling an observable condition, bounded above


def status(url: str) -> int:
    return httpx.get(url + "/health", timeout=2).status_code


def test_worker_death_5xx_then_503_then_recovery(workers: Workers, tmp_path: Path) -> None:
    workers.up()
    port = free_port()
    ctx_url, gen_url = workers.url("ctx"), workers.url("gen")
    config = {
        "hostname": "127.0.0.1", "port": port,
        "context_servers": {"urls": [ctx_url]}, "generation_servers": {"urls": [gen_url]},
        "conditional_disagg_config": {"max_local_prefill_length": 64},
        "health_check_interval": 0.2, "request_timeout": REQUEST_TIMEOUT, "max_retries": 1,
    }  # fmt: skip
    path = tmp_path / "disagg.yaml"
    path.write_text(yaml.safe_dump(config))
    short = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
    with spawn(
        ["coordinator", "--config", str(path)], port=port, log_path=tmp_path / "coord.log"
    ) as coord:
        assert httpx.post(coord.url + "/v1/completions", json=short, timeout=30).status_code == 200

        # gen dies in the middle of a long request: the client gets a 5xx, well within the timeout.
        outcome: dict[str, Any] = {}

        def long_request() -> None:
            started = time.monotonic()
            long = {**short, "max_tokens": 3000, "ignore_eos": True}
            r = httpx.post(coord.url + "/v1/completions", json=long, timeout=REQUEST_TIMEOUT + 10)
            outcome.update(status=r.status_code, seconds=time.monotonic() - started, body=r.text)

        thread = threading.Thread(target=long_request)
        thread.start()
        wait_for(lambda: running(gen_url) == 1, 20, "gen busy")
        workers.procs["gen"].send_signal(signal.SIGKILL)
        thread.join(REQUEST_TIMEOUT + 15)
        assert 500 <= outcome["status"] < 600, outcome
        assert outcome["seconds"] < REQUEST_TIMEOUT, outcome

        # With ctx gone too, new requests are refused at once with 503.
        workers.procs["ctx"].send_signal(signal.SIGKILL)
        wait_for(lambda: status(coord.url) == 503, 5, "coordinator /health 503")
        wait_for(
            lambda: httpx.get(coord.url + "/cluster_info").json()["unhealthy"]["context"],
            5,
            "ctx marked unhealthy",
        )
        started = time.monotonic()
        r = httpx.post(coord.url + "/v1/completions", json=short, timeout=30)
        assert r.status_code == 503 and time.monotonic() - started < 2, r.text
        info = httpx.get(coord.url + "/cluster_info").json()
        assert info["is_ready"] is False
        assert info["unhealthy"] == {"context": [ctx_url], "generation": [gen_url]}
        assert servers(coord.url) == {  # what an alert on no server in rotation reads
            (role, state): float(state == "unhealthy")
            for role in ("context", "generation")
            for state in ("serving", "unhealthy", "unpaired")
        }

        # Both come back on the same ports: service resumes without a coordinator restart.
        workers.up()
        wait_for(lambda: status(coord.url) == 200, 10, "coordinator /health 200")
        r = httpx.post(coord.url + "/v1/completions", json=short, timeout=30)
        assert r.status_code == 200, r.text
        assert servers(coord.url)[("generation", "serving")] == 1
        assert coord.alive()


def servers(url: str) -> dict[tuple[str, str], float]:
    """The coordinator's `trtdisagg_coordinator_servers{role, state}`."""
    text = httpx.get(url + "/metrics").text
    return {
        (role, state): metric(
            text, "trtdisagg_coordinator_servers", f'role="{role}",state="{state}"'
        )
        for role in ("context", "generation")
        for state in ("serving", "unhealthy", "unpaired")
    }


def test_disaggregated_legs_survive_or_fail_cleanly_when_ctx_dies(
    workers: Workers, tmp_path: Path
) -> None:
    """ctx → gen over NIXL: a request already decoding on gen finishes after ctx dies (its KV
    has moved); a request still in ctx's prefill ends in a 5xx; then no ctx means 503 at once."""
    workers.up()
    port = free_port()
    ctx_url, gen_url = workers.url("ctx"), workers.url("gen")
    config = {
        "hostname": "127.0.0.1", "port": port, "max_retries": 0,
        "context_servers": {"urls": [ctx_url]}, "generation_servers": {"urls": [gen_url]},
        "health_check_interval": 0.2, "request_timeout": REQUEST_TIMEOUT,
    }  # fmt: skip
    path = tmp_path / "disagg.yaml"
    path.write_text(yaml.safe_dump(config))
    with spawn(
        ["coordinator", "--config", str(path)], port=port, log_path=tmp_path / "coord.log"
    ) as coord:
        outcomes: dict[str, Any] = {}

        def call(name: str, body: dict[str, Any]) -> None:
            started = time.monotonic()
            r = httpx.post(coord.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT + 10)
            outcomes[name] = (r.status_code, time.monotonic() - started, r.text)

        decoding = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
                    "temperature": 0}  # fmt: skip
        prefilling = {
            "prompt": [10 + i % 400 for i in range(3890)],
            "max_tokens": 4,
            "temperature": 0,
        }
        first = threading.Thread(target=call, args=("decoding", decoding))
        first.start()
        wait_for(lambda: running(gen_url) == 1, 20, "gen decoding")
        second = threading.Thread(target=call, args=("prefilling", prefilling))
        second.start()
        wait_for(lambda: running(ctx_url) == 1, 20, "ctx prefilling")
        workers.procs["ctx"].send_signal(signal.SIGKILL)
        first.join(REQUEST_TIMEOUT + 15)
        second.join(REQUEST_TIMEOUT + 15)
        assert outcomes["decoding"][0] == 200, outcomes["decoding"]
        status, seconds, _ = outcomes["prefilling"]
        assert 500 <= status < 600 and seconds < REQUEST_TIMEOUT, outcomes["prefilling"]
        wait_for(lambda: httpx.get(coord.url + "/health").status_code == 503, 5, "503")
        started = time.monotonic()
        r = httpx.post(coord.url + "/v1/completions", json=decoding, timeout=30)
        assert r.status_code == 503 and time.monotonic() - started < 2, r.text
        assert coord.alive()
