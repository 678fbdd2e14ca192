"""Helpers of the edge tests (fuzzing, security, soak): a real ctx + gen (+ coordinator) cluster.

The workers start in parallel (they dominate start-up time), then the coordinator; every process is
stopped on exit, SIGTERM to all first and then a bounded wait each, so stopping costs one grace
period rather than one per process. Readiness is each process's /health, polled with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import yaml

from tests.procs import REPO, Server, free_port, metric, stop, wait_healthy, worker_config

TRANSFER_TIMEOUT_MS = 3000
NIXL = {
    "backend": "NIXL",
    "kv_transfer_timeout_ms": TRANSFER_TIMEOUT_MS,
    "nixl_progress_thread": False,
}


@attrs.frozen
class Cluster:
    ctx: Server
    gen: Server
    coordinator: Server | None

    @property
    def workers(self) -> tuple[Server, Server]:
        return (self.ctx, self.gen)

    @property
    def servers(self) -> list[Server]:
        return [self.ctx, self.gen] + ([self.coordinator] if self.coordinator else [])


def _popen(args: list[str], log_path: Path, env: dict[str, str] | None) -> subprocess.Popen[bytes]:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "trtdisagg", *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=full_env,
        )


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        stop(proc)  # signals once more (a repeat must not cut a stop short), waits, kills


@contextlib.contextmanager
def running_cluster(
    tmp: Path,
    *,
    worker: dict[str, Any] | None = None,
    gen_worker: dict[str, Any] | None = None,
    coordinator: dict[str, Any] | None = None,
    with_coordinator: bool = True,
    coordinator_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    worker_env: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> Iterator[Cluster]:
    """ctx and gen workers (`worker` overrides both, `gen_worker` gen only) and a coordinator.

    `env` is added to every process's environment, `worker_env` to the workers' only. The
    coordinator polls health at its default interval: the suite's clusters idle most of their
    lives, and faster polling costs CPU that the other tests wait for. Tests that need a dead
    worker noticed quickly set `health_check_interval` in `coordinator`.
    """
    procs: list[subprocess.Popen[bytes]] = []
    try:
        servers: dict[str, Server] = {}
        for role, extra in (("ctx", {}), ("gen", gen_worker or {})):
            port = free_port()
            config = worker_config(**{"cache_transceiver_config": NIXL, **(worker or {}), **extra})
            path = tmp / f"{role}.yaml"
            path.write_text(yaml.safe_dump(config))
            log_path = tmp / f"{role}.log"
            args = [role, "--config", str(path), "--port", str(port)]
            proc = _popen(args, log_path, {**(env or {}), **(worker_env or {})})
            procs.append(proc)
            servers[role] = Server(f"http://127.0.0.1:{port}", proc, log_path, port)
        for server in servers.values():
            wait_healthy(server.url, server.proc, server.log_path, timeout)
        coord: Server | None = None
        if with_coordinator:
            port = free_port()
            data = {
                "hostname": "127.0.0.1",
                "port": port,
                "context_servers": {"urls": [servers["ctx"].url]},
                "generation_servers": {"urls": [servers["gen"].url]},
                "server_start_timeout": 60,
                "request_timeout": 60,
                **(coordinator or {}),
            }
            path = tmp / "disagg.yaml"
            path.write_text(yaml.safe_dump(data))
            log_path = tmp / "coordinator.log"
            args = ["coordinator", "--config", str(path), *coordinator_args]
            proc = _popen(args, log_path, env)
            procs.append(proc)
            coord = Server(f"http://127.0.0.1:{port}", proc, log_path, port)
            wait_healthy(coord.url, proc, log_path, timeout)
        yield Cluster(ctx=servers["ctx"], gen=servers["gen"], coordinator=coord)
    finally:
        _stop_all(procs)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll an observable condition until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached within {timeout}s")
        time.sleep(0.05)  # a metrics/health poll interval, bounded above by the deadline


def metrics_of(client: httpx.Client, server: Server) -> str:
    return client.get(server.url + "/metrics").text


def held_blocks(text: str) -> float:
    """Blocks neither free nor kept by the prefix cache: 0 when nothing is in flight."""
    return (
        metric(text, "trtdisagg_kv_cache_total_blocks")
        - metric(text, "trtdisagg_kv_cache_free_blocks")
        - metric(text, "trtdisagg_kv_cache_reusable_blocks")
    )


def wait_idle(client: httpx.Client, server: Server, timeout: float = 15.0) -> None:
    """Wait until `server` runs no request and every KV block is back (free or reusable)."""

    def idle() -> bool:
        text = metrics_of(client, server)
        return metric(text, "trtdisagg_requests_running") == 0 and held_blocks(text) == 0

    wait_until(idle, timeout, f"{server.url} idle with every block back")


def info_endpoint(client: httpx.Client, server: Server) -> str:
    """A worker's control-plane endpoint (every worker with a transceiver has one)."""
    info = client.get(server.url + "/server_info").json()
    return str(info["disaggregated_params"]["ctx_info_endpoint"])


def completion(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip


def split(client: httpx.Client, cluster: Cluster, body: dict[str, Any]) -> list[int]:
    """context_only on ctx, then generation_only on gen: gen's tokens (asserts both legs 200)."""
    ctx_body = {**body, "stream": False, "disaggregated_params": {"request_type": "context_only"}}
    r = client.post(cluster.ctx.url + "/v1/completions", json=ctx_body)
    assert r.status_code == 200, r.text
    answer = r.json()
    params = {**answer["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
    gen_body = {**body, "prompt_token_ids": answer["prompt_token_ids"],
                "disaggregated_params": params}  # fmt: skip
    g = client.post(cluster.gen.url + "/v1/completions", json=gen_body)
    assert g.status_code == 200, g.text
    return list(g.json()["choices"][0]["token_ids"])


def aggregated(client: httpx.Client, url: str, body: dict[str, Any]) -> list[int]:
    """The tokens of `body` served whole by the worker at `url` (the reference of a split)."""
    r = client.post(url + "/v1/completions", json={**body, "stream": False})
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def assert_alive(client: httpx.Client, cluster: Cluster) -> None:
    """Every process still runs, answers /health and serves a real (split) request correctly."""
    for server in cluster.servers:
        assert server.alive(), f"{server.url} died:\n{server.log()[-4000:]}"
        assert client.get(server.url + "/health").status_code == 200
    body = completion([3, 4, 5, 6, 7, 8, 9], 4)
    expected = aggregated(client, cluster.ctx.url, body)
    assert split(client, cluster, body) == expected
    if cluster.coordinator is not None:
        r = client.post(cluster.coordinator.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected
