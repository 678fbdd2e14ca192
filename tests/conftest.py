"""Session setup shared by every test directory.

Without a CUDA device, the Triton kernels can only run under Triton's interpreter, which must be
switched on before anything imports triton (transformers does, so this cannot wait for the tests
that use the kernels). Child processes inherit it; on CPU nothing else runs Triton.

Under pytest-xdist (`make test` runs `--dist loadfile --no-loadscope-reorder`), each module is one
unit of work, handed out in collection order: modules with a `slow` test come first, so that the
longest units do not start last and leave one worker idle; the integration modules, which mostly
wait, are spread among the unit modules, which keep a core busy.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


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
