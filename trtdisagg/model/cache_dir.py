"""Where generated model directories live, and writing one exactly once.

Several workers often start together and all want the same generated directory (the `tiny`
checkpoint, a `synthetic:` model's config and tokenizer). Each writes into a temporary sibling
and renames it into place; the first rename wins and every reader sees one complete copy.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def default_cache_dir() -> Path:
    env = os.environ.get("TRTDISAGG_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "trtdisagg"


def write_once(final: Path, write: Callable[[Path], None]) -> Path:
    """`final`, created by `write(scratch_dir)` unless it already exists."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write(scratch)
        try:
            os.rename(scratch, final)
        except OSError:
            if not final.is_dir():  # else another process renamed its complete copy first
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final
