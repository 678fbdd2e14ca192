"""A single-member etcd for one machine: the command line that starts it. Pure.

`python -m trtdisagg up` with ``etcd: embedded`` starts one (a child like the workers), and the
tests start one per module. It keeps its data in `data_dir`, listens for clients on
``host:client_port`` (its v3 JSON gateway, ``/health``) and for peers on ``host:peer_port``
(unused by a single member, but etcd always binds it).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Final

from trtdisagg.errors import TrtDisaggError

INSTALL_HINT: Final = (
    "install it with `apt-get install -y etcd-server` (Debian), or put etcd on PATH"
)


class EtcdNotInstalled(TrtDisaggError):
    """No `etcd` binary on PATH."""


def etcd_binary() -> str:
    found = shutil.which("etcd")
    if found is None:
        raise EtcdNotInstalled(f"no etcd on PATH: {INSTALL_HINT}")
    return found


def etcd_args(
    binary: str,
    *,
    data_dir: Path,
    client_port: int,
    peer_port: int,
    host: str = "127.0.0.1",
    name: str = "trtdisagg",
) -> list[str]:
    """The argv of a fresh single-member etcd."""
    client = f"http://{host}:{client_port}"
    peer = f"http://{host}:{peer_port}"
    return [
        binary,
        "--name", name,
        "--data-dir", str(data_dir),
        "--listen-client-urls", client,
        "--advertise-client-urls", client,
        "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"{name}={peer}",
        "--initial-cluster-state", "new",
        "--logger", "zap",
        "--log-outputs", "stderr",
        "--log-level", "warn",
    ]  # fmt: skip
