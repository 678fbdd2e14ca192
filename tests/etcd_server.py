"""A real etcd for tests: on free ports, in a temporary directory, always stopped.

Started with the same command line as `up`'s embedded etcd (`trtdisagg.membership.embedded`)
and waited for on its ``/health``. Without an etcd binary the tests that need one skip, except
under CI (``CI`` set), where `make test` installs it and a missing binary is a failure.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from tests.procs import free_port, stop
from trtdisagg.membership.embedded import EtcdNotInstalled, etcd_args, etcd_binary
from trtdisagg.membership.etcd import EtcdClient
from trtdisagg.membership.etcd_wire import RangeAnswer


@attrs.frozen
class Etcd:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    ports: tuple[int, int]


def require_etcd() -> str:
    try:
        return etcd_binary()
    except EtcdNotInstalled as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@contextlib.contextmanager
def running_etcd(
    tmp_path: Path,
    *,
    host: str = "127.0.0.1",
    netns: str | None = None,
    ports: tuple[int, int] | None = None,
) -> Iterator[Etcd]:
    """An etcd on free ports (or `ports`: client, peer), keeping its data in `tmp_path`: one
    started again with the same ports and path is the same etcd, restarted."""
    binary = require_etcd()
    client_port, peer_port = ports or (free_port(), free_port())
    args = etcd_args(
        binary,
        data_dir=tmp_path / f"etcd-{client_port}",
        client_port=client_port,
        peer_port=peer_port,
        host=host,
    )
    if netns is not None:
        args = ["ip", "netns", "exec", netns, *args]
    log_path = tmp_path / f"etcd-{client_port}.log"
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://{host}:{client_port}"
    try:
        deadline = time.monotonic() + 30
        with httpx.Client(timeout=1.0, trust_env=False) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"etcd exited with {proc.returncode}:\n{log_path.read_text()}"
                    )
                try:
                    if client.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"etcd not healthy after 30 s:\n{log_path.read_text()}")
                time.sleep(0.05)  # polling its health endpoint, bounded by the deadline
        yield Etcd(url=url, proc=proc, log_path=log_path, ports=(client_port, peer_port))
    finally:
        stop(proc)


async def wait_for_members(
    client: EtcdClient, prefix: bytes, present: Callable[[RangeAnswer], bool], *, timeout: float
) -> RangeAnswer:
    """Read the prefix until `present(answer)` holds: read once, then re-read on every watch
    event (etcd has no wait-for-key; a watch is its event)."""
    with trio.fail_after(timeout):
        answer = await client.get_prefix(prefix)
        while not present(answer):
            async with client.watch(prefix, start_revision=answer.revision + 1) as batches:
                async for _ in batches:
                    break
            answer = await client.get_prefix(prefix)
        return answer
