"""Session setup shared by every test directory.

Without a CUDA device, the Triton kernels can only run under Triton's interpreter, which must be
switched on before anything imports triton (transformers does, so this cannot wait for the tests
that use the kernels). Child processes inherit it; on CPU nothing else runs Triton.

Under pytest-xdist (`make test` runs `--dist loadfile --no-loadscope-reorder`), each module is one
unit of work, handed out in collection order: modules with a `slow` test come first, so that the
longest units do not start last and leave one worker idle.
"""

from __future__ import annotations

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Whole modules move, so that none of their module-scoped fixtures is set up twice.
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)  # stable: slow modules first
