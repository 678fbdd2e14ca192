"""Real server processes for e2e tests: start on a free port, wait for /health, always stop.

Waiting is on health with a bounded deadline, never on a sleep of a guessed length. A server that
dies during start-up fails the test at once with the tail of its log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import yaml

from trtdisagg import free_ports

REPO = Path(__file__).resolve().parent.parent


@attrs.define(eq=False)
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int

    def __attrs_post_init__(self) -> None:
        STARTED.append(self)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None


# Every server a test process started, so that a failing test's report shows what they logged.
STARTED: list[Server] = []


def free_port() -> int:
    """A free port that no other xdist worker hands out: each worker takes only the ports that
    are its own index modulo the number of workers. free_ports.free_port never gives one port
    twice, but only within one process, and a port handed out is free only until its server
    binds it: a second worker could otherwise give the same one to a server that starts
    meanwhile, which then fails to bind while the first one answers its health checks."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    while True:
        port = free_ports.free_port()
        if port % workers == index:
            return port


def _listening_sockets(pid: int, port: int) -> set[str]:
    """The sockets listening on TCP `port` in process `pid`'s network namespace, as its fd
    links name them (`socket:[inode]`)."""
    found = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    found.add(f"socket:[{fields[9]}]")
    return found


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` or one of its descendants holds a socket listening on `port`."""
    pending = [pid]
    while pending:
        current = pending.pop()
        wanted = _listening_sockets(current, port)
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{current}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in wanted:
                        return True
        pending.extend(children(current))
    return False


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout: float) -> None:
    """Wait until `proc` answers /health at `url`. Another process that answers there does not
    count: the port was taken meanwhile, and `proc` fails to bind it."""
    deadline = time.monotonic() + timeout
    port = int(url.rsplit(":", 1)[1])
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"server exited with {proc.returncode} during start-up:\n{tail}")
            try:
                if client.get(url + "/health").status_code == 200 and listens_on(proc.pid, port):
                    return
            except httpx.TransportError:
                pass
            # Polling a health endpoint at a short interval is the readiness signal itself.
            time.sleep(0.1)
    tail = log_path.read_text(errors="replace")[-4000:]
    raise TimeoutError(f"{url} not healthy after {timeout}s:\n{tail}")


def stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def spawn(
    args: list[str],
    *,
    port: int,
    log_path: Path,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> Iterator[Server]:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trtdisagg", *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=full_env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_path, timeout)
        yield Server(url=url, proc=proc, log_path=log_path, port=port)
    finally:
        stop(proc)


def worker_config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model": "tiny",
        "max_batch_size": 64,
        "max_num_tokens": 256,
        "kv_cache_config": {"tokens_per_block": 16, "max_tokens": 16384},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


@contextlib.contextmanager
def running_worker(
    tmp_path: Path, role: str = "ctx", *, env: dict[str, str] | None = None, **overrides: Any
) -> Iterator[Server]:
    port = free_port()
    config_path = tmp_path / f"{role}-{port}.yaml"
    config_path.write_text(yaml.safe_dump(worker_config(**overrides)))
    with spawn(
        [role, "--config", str(config_path), "--port", str(port)],
        port=port,
        log_path=tmp_path / f"{role}-{port}.log",
        env=env,
    ) as server:
        yield server


def metric(text: str, name: str, labels: str = "") -> float:
    """Value of one Prometheus sample (`name{labels}`), or 0.0 if absent."""
    prefix = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(prefix + " "):
            return float(line.split()[-1])
    return 0.0


def children(pid: int) -> list[int]:
    """The pids of process `pid`'s children, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found


def cpus_of_threads(pid: int) -> dict[int, tuple[int, ...]]:
    """The CPUs each thread of process `pid` may run on (its tid -> sorted CPU ids)."""
    allowed = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            allowed[int(task.name)] = tuple(sorted(os.sched_getaffinity(int(task.name))))
        except ProcessLookupError:
            continue  # ended meanwhile
    return allowed
