"""The cyclic garbage collector paused while a process of ours imports, then frozen and resumed.

Importing torch makes a few hundred thousand objects that live as long as the process. The
collector, run by allocation counts, walks them again and again while they are being made (about
a fifth of a worker's start-up CPU: docs/BENCHMARKS.md, the make test row), and every full
collection after start-up walks them once more: a pause in the serving loop (and, in a rank of a
multi-rank instance, in every collective it joins) that grows with what was imported.

So the collector is paused before the imports and, once they are done and before the process
serves, what exists is frozen (moved where no collection looks) and collection starts again:
`python -m trtdisagg` pauses in `__main__.py` and each command resumes after its imports; a
`spawn`ed rank starts in `run_after_imports`, which does both around its entry module's import
(`multiprocessing` runs no `__main__.py` of a package in a child).
"""

from __future__ import annotations

import gc
import importlib
from typing import Any


def pause_gc_for_imports() -> None:
    gc.disable()


def resume_gc() -> None:
    """Freeze every object that exists now and collect again from here on (idempotent)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def run_after_imports(module: str, function: str, *args: Any) -> None:
    """A `spawn`ed process's target: import `module` with the collector paused, resume it, and
    run `module.function(*args)`. (This module is light: the child imports it, and unpickles
    `args`, before anything here runs.)"""
    pause_gc_for_imports()
    entry = getattr(importlib.import_module(module), function)
    resume_gc()
    entry(*args)
