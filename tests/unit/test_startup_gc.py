"""The collector paused for a process's imports, then frozen and resumed before it serves."""

from __future__ import annotations

import gc
import multiprocessing
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from trtdisagg.startup_gc import pause_gc_for_imports, resume_gc, run_after_imports

REPO = Path(__file__).resolve().parents[2]

# `python -m trtdisagg ARGS` up to the moment it would start serving: `trio.run` says whether the
# collector runs and stops the process there.
AT_SERVE = """
import gc, sys, trio
import trtdisagg.__main__ as entry  # pauses the collector, as `python -m trtdisagg` does
assert not gc.isenabled()
def serving(*args, **kwargs):
    print("collecting" if gc.isenabled() else "paused", gc.get_freeze_count() > 0, flush=True)
    raise SystemExit(0)
trio.run = serving
sys.exit(entry.main(sys.argv[1:]))
"""


@pytest.fixture
def collector_restored() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()
    else:
        gc.disable()


@pytest.mark.usefixtures("collector_restored")
def test_resume_freezes_what_the_imports_made_and_collects_again() -> None:
    pause_gc_for_imports()
    assert not gc.isenabled()
    made_at_start = [[] for _ in range(100)]
    resume_gc()
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(made_at_start)


@pytest.mark.usefixtures("collector_restored")
def test_resume_once_running_freezes_nothing_more() -> None:
    gc.enable()
    frozen = gc.get_freeze_count()
    resume_gc()
    assert gc.get_freeze_count() == frozen


@pytest.mark.parametrize("command", ["ctx", "coordinator"])
def test_each_command_serves_with_the_collector_running(command: str, tmp_path: Path) -> None:
    args = ["ctx", "--model", "tiny", "--port", "0"]
    if command == "coordinator":
        config = tmp_path / "disagg.yaml"
        servers = "context_servers: {urls: ['127.0.0.1:9']}\n"
        config.write_text(servers + "generation_servers: {urls: ['127.0.0.1:7']}\n")
        args = ["coordinator", "--config", str(config)]
    result = subprocess.run(
        [sys.executable, "-c", AT_SERVE, *args],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["collecting", "True"], result.stderr


def report_collector(conn: Connection) -> None:
    """(A spawned child's entry.) Whether the collector runs, and whether anything is frozen."""
    conn.send((gc.isenabled(), gc.get_freeze_count() > 0))


def test_a_spawned_entry_runs_after_its_imports_with_the_collector_resumed() -> None:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(
        target=run_after_imports, args=(__name__, report_collector.__name__, theirs)
    )
    child.start()
    try:
        assert ours.poll(60), "the child reported nothing"
        assert ours.recv() == (True, True)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0
