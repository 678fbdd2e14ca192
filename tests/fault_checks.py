"""Helpers of the fault tests: workers with faults armed, fault plans, and leak checks.

A worker's state is observed only through its HTTP endpoints (`/metrics`, `/debug/...`), polled
with a deadline: it lives in another process, so there is no event to wait on.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
import yaml

from tests.procs import REPO, Server, metric, stop, wait_healthy, worker_config

TIMEOUT_S = 2.0  # default kv_transfer_timeout_ms of the fault tests' workers, in seconds
SLACK_S = 1.5  # scheduling, HTTP and polling on a loaded 2-core machine
# cache_transceiver_config.peer_probe_ms of the fault tests' workers: a dead peer is forgotten
# within about 4 x this (transfer/liveness.py); a live one answers its probes within it.
PEER_PROBE_MS = 1000
# Digests of the KV moved (TRTDISAGG_TEST_HOOKS), and faults armed with no rule yet.
ENV = {"TRTDISAGG_TEST_HOOKS": "1", "TRTDISAGG_FAULTS": "none"}


@attrs.define(eq=False)
class Processes:
    """Worker processes started without waiting, each stopped (SIGTERM, then SIGKILL) on exit."""

    tmp: Path
    started: list[Server] = attrs.Factory(list)

    def start_worker(
        self,
        role: str,
        port: int,
        *,
        timeout_s: float = TIMEOUT_S,
        kv_cache_config: dict[str, Any] | None = None,
        transfer: dict[str, Any] | None = None,
    ) -> Server:
        transfer = {
            "backend": "NIXL",
            "kv_transfer_timeout_ms": int(timeout_s * 1000),
            "nixl_progress_thread": False,
            "peer_probe_ms": PEER_PROBE_MS,
            **(transfer or {}),
        }
        config = self.tmp / f"{role}-{port}.yaml"
        overrides: dict[str, Any] = {"cache_transceiver_config": transfer}
        if kv_cache_config is not None:
            overrides["kv_cache_config"] = kv_cache_config
        config.write_text(yaml.safe_dump(worker_config(**overrides)))
        args = [role, "--config", str(config), "--port", str(port)]
        return self.start(args, port, f"{role}-{port}-{len(self.started)}.log")

    def start(self, args: list[str], port: int, log_name: str) -> Server:
        log_path = self.tmp / log_name
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **ENV}
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "trtdisagg", *args],
                stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO, env=env,
            )  # fmt: skip
        server = Server(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path, port=port)
        self.started.append(server)
        return server

    def stop_all(self) -> None:
        for server in self.started:
            if server.alive():
                server.proc.terminate()
        for server in self.started:
            stop(server.proc)


@contextlib.contextmanager
def processes(tmp: Path) -> Iterator[Processes]:
    procs = Processes(tmp)
    try:
        yield procs
    finally:
        procs.stop_all()


def wait_all_healthy(*servers: Server, timeout: float = 180.0) -> None:
    for server in servers:
        wait_healthy(server.url, server.proc, server.log_path, timeout)


async def set_faults(client: httpx.AsyncClient, server: Server, spec: str) -> None:
    r = await client.post(server.url + "/debug/faults", json={"spec": spec})
    assert r.status_code == 200, r.text


def held_blocks(text: str) -> float:
    """Blocks neither free nor reusable (prefix cache): held by a request or a transfer."""
    total = metric(text, "trtdisagg_kv_cache_total_blocks")
    free = metric(text, "trtdisagg_kv_cache_free_blocks")
    return total - free - metric(text, "trtdisagg_kv_cache_reusable_blocks")


def sessions(text: str) -> float:
    return metric(text, "trtdisagg_kv_sessions", 'side="sender"') + metric(
        text, "trtdisagg_kv_sessions", 'side="receiver"'
    )


def is_idle(text: str) -> bool:
    """No request, no block held, no transfer session, nothing quarantined."""
    running = metric(text, "trtdisagg_requests_running")
    running += metric(text, "trtdisagg_requests_waiting")
    quarantined = metric(text, "trtdisagg_kv_quarantined_requests")
    return running == 0 and held_blocks(text) == 0 and sessions(text) == 0 and quarantined == 0


async def wait_metrics(
    client: httpx.AsyncClient,
    server: Server,
    predicate: Callable[[str], bool],
    what: str,
    timeout: float,
) -> str:
    """Poll `/metrics` until `predicate(text)` holds; fail after `timeout` seconds."""
    try:
        with trio.fail_after(timeout):
            while not predicate(text := (await client.get(server.url + "/metrics")).text):  # noqa: ASYNC110
                await trio.sleep(0.02)
    except trio.TooSlowError:
        raise AssertionError(f"{server.url}: {what} not reached in {timeout}s") from None
    return text


async def gen_asks_first(
    client: httpx.AsyncClient,
    nursery: trio.Nursery,
    gen: Server,
    ctx: Server,
    body: dict[str, Any],
) -> list[httpx.Response]:
    """Send gen's generation-first request `body` in `nursery`, and return once its
    REQUEST_DATA waits at `ctx`; gen's answer is in the returned list when the request ends."""
    answers: list[httpx.Response] = []

    async def ask() -> None:
        answers.append(await client.post(gen.url + "/v1/completions", json=body))

    nursery.start_soon(ask)
    await request_data_waiting(client, ctx)
    return answers


async def request_data_waiting(client: httpx.AsyncClient, ctx: Server) -> None:
    """Until a generation-first gen's REQUEST_DATA waits at `ctx` for its request."""
    await wait_metrics(
        client, ctx, lambda t: metric(t, "trtdisagg_kv_early_messages") >= 1, "REQUEST_DATA", 10
    )


async def same_kv_landed(
    client: httpx.AsyncClient, ctx: Server, gen: Server, before: set[str]
) -> set[str]:
    """The transfer keys whose KV landed on gen since `before` (its digests' keys then); each
    one's bytes are asserted equal to what ctx sent. Transfer keys are random (the coordinator
    mints them), so a test finds its transfers this way."""
    ctx_digests, gen_digests = await digests(client, ctx), await digests(client, gen)
    landed = set(gen_digests) - before
    for key in landed:
        assert ctx_digests[key] == gen_digests[key], f"transfer {key}: the bytes differ"
    return landed


async def digests(client: httpx.AsyncClient, server: Server) -> dict[str, str]:
    data: dict[str, str] = (await client.get(server.url + "/debug/kv_digests")).json()
    return data


def completion(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip
