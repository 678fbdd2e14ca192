"""The test suite's own servers: a port another process answers on is not taken for ours, and
xdist workers never hand out the same port."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.procs import free_port, spawn, worker_config


class _AlwaysHealthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def impostor() -> Iterator[int]:
    """A port where another process's server already answers /health with 200."""
    server = http.server.HTTPServer(("127.0.0.1", free_port()), _AlwaysHealthy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_worker_whose_port_is_taken_fails_its_start_though_the_port_answers(
    tmp_path: Path, impostor: int
) -> None:
    config = tmp_path / "ctx.yaml"
    config.write_text(yaml.safe_dump(worker_config()))
    args = ["ctx", "--config", str(config), "--port", str(impostor)]
    starting = spawn(args, port=impostor, log_path=tmp_path / "ctx.log")
    with pytest.raises(RuntimeError, match="during start-up"), starting:
        pass


def test_each_xdist_worker_hands_out_only_its_own_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    for index in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        assert {free_port() % 3 for _ in range(20)} == {index}
