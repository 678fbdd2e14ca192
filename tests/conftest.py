"""Session setup shared by every test directory.

Without a CUDA device, the Triton kernels can only run under Triton's interpreter, which must be
switched on before anything imports triton (transformers does, so this cannot wait for the tests
that use the kernels). Child processes inherit it; on CPU nothing else runs Triton.

A failing test's report ends with the last lines of each server log written to while it ran: a
server that died or misbehaved says why only there, and CI keeps no files.

Under pytest-xdist (`make test` runs `--dist loadfile --no-loadscope-reorder`), each module is one
unit of work, handed out in collection order: modules with a `slow` test come first, so that the
longest units do not start last and leave one worker idle; the integration modules, which mostly
wait, are spread among the unit modules, which keep a core busy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from pathlib import Path

import pytest
import torch

from tests.procs import STARTED

LOG_TAIL_LINES = 40
_test_started = pytest.StashKey[float]()

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_test_started] = time.time()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    started = item.stash.get(_test_started, None)
    if report.failed and started is not None:
        for server in STARTED:
            try:
                if server.log_path.stat().st_mtime < started:
                    continue
                lines = server.log().splitlines()[-LOG_TAIL_LINES:]
            except OSError:
                continue  # its temporary directory is gone
            state = "running" if server.alive() else f"exited {server.proc.returncode}"
            title = f"log of {server.log_path.name} ({server.url or 'no url'}, {state})"
            report.sections.append((title, "\n".join(lines)))
    return report


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Whole modules move, so that none of their module-scoped fixtures is set up twice.
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    modules = list(dict.fromkeys(item.path for item in items))
    rank = {path: i for i, path in enumerate(_interleave_waiting(modules))}
    items.sort(key=lambda item: (item.path not in slow, rank[item.path]))  # slow modules first


def _interleave_waiting(modules: list[Path]) -> list[Path]:
    """`modules` in order, but the integration modules (whose tests mostly wait: on fake peers'
    timeouts, deadlines, handshakes) spread evenly among the unit modules (which keep a core
    busy), so that the two xdist workers are rarely both waiting."""
    waiting = [m for m in modules if m.parent.name == "integration"]
    busy = [m for m in modules if m.parent.name == "unit"]
    rest = [m for m in modules if m not in waiting and m not in busy]
    if not waiting or len(waiting) > len(busy):  # (a run of a few modules: as collected)
        return rest + waiting + busy
    step = len(busy) / len(waiting)
    slots = {int(i * step): m for i, m in enumerate(waiting)}  # distinct: step >= 1
    mixed = []
    for i, module in enumerate(busy):
        if i in slots:
            mixed.append(slots[i])
        mixed.append(module)
    return rest + mixed
