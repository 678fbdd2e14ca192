"""Many worker instances at once: started together, waited for together, always stopped.

Multi-rank instances spawn their ranks at start, so starting a dozen of them one after the
other would cost minutes; here every process starts first and then each is waited for with one
shared deadline. Each binds port 0 and its ready line names the port it got: a port picked here
and bound later could be taken meanwhile by another starting process (gloo, TCPStore, UCX).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.procs import REPO, Server, stop, wait_healthy, worker_config

READY = re.compile(r"worker ready: .* url=(http://\S+)")


def _ready_url(server: Server, deadline: float) -> str:
    """The URL from the worker's ready line, once it is logged (or the worker died)."""
    while time.monotonic() < deadline:
        found = READY.search(server.log())
        if found:
            return found.group(1)
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"worker exited with {server.proc.returncode}:\n{server.log()[-4000:]}"
            )
        time.sleep(0.1)  # polling the log for the ready line, bounded by the deadline
    raise TimeoutError(f"no ready line in {server.log_path}:\n{server.log()[-4000:]}")


@contextlib.contextmanager
def running_instances(
    tmp_path: Path,
    specs: Mapping[str, tuple[str, dict[str, Any]]],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 240.0,
) -> Iterator[dict[str, Server]]:
    """Start `{name: (role, worker overrides)}` at once; yield `{name: Server}` once all are
    healthy; stop them all on the way out."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    servers: dict[str, Server] = {}
    try:
        for name, (role, overrides) in specs.items():
            config_path = tmp_path / f"{name}.yaml"
            config_path.write_text(yaml.safe_dump(worker_config(**overrides)))
            log_path = tmp_path / f"{name}.log"
            with open(log_path, "wb") as log_file:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "trtdisagg", role, "--config", str(config_path),
                     "--port", "0"],
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    env=full_env,
                )  # fmt: skip
            servers[name] = Server(url="", proc=proc, log_path=log_path, port=0)
        deadline = time.monotonic() + timeout
        for server in servers.values():
            server.url = _ready_url(server, deadline)
            server.port = int(server.url.rsplit(":", 1)[1])
            wait_healthy(server.url, server.proc, server.log_path, deadline - time.monotonic())
        yield servers
    finally:
        # Signal every process first, so their shutdowns overlap instead of queueing.
        for server in servers.values():
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGTERM)
        for server in servers.values():
            stop(server.proc)
