"""A fleet's metrics directory is held while its supervisor lives; a killed one's is removed by
the next fleet, a running one's never."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trtdisagg.coordinator.fleet import (
    METRICS_DIR_PREFIX,
    hold_metrics_dir,
    remove_orphaned_metrics_dirs,
)

_HOLDER = """
import sys
from pathlib import Path
from trtdisagg.coordinator.fleet import hold_metrics_dir
path, _ = hold_metrics_dir(Path(sys.argv[1]))
print(path, flush=True)
sys.stdin.read()  # until the test kills it
"""


def test_a_held_directory_stays_and_a_released_one_goes(tmp_path: Path) -> None:
    path, held = hold_metrics_dir(tmp_path)
    assert path.is_dir() and path.name.startswith(METRICS_DIR_PREFIX)
    assert remove_orphaned_metrics_dirs(tmp_path) == []
    assert path.is_dir()
    os.close(held)
    assert remove_orphaned_metrics_dirs(tmp_path) == [path]
    assert not path.exists()


def test_the_directory_of_a_killed_supervisor_is_removed_by_the_next_fleet(
    tmp_path: Path,
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        orphan = Path(holder.stdout.readline().strip())
        assert remove_orphaned_metrics_dirs(tmp_path) == []  # its supervisor lives
    finally:
        holder.kill()
        holder.wait(10)
    mine, held = hold_metrics_dir(tmp_path)  # the next fleet
    try:
        assert not orphan.exists() and mine.is_dir()
    finally:
        os.close(held)


def test_a_directory_without_its_lock_yet_is_left_alone(tmp_path: Path) -> None:
    making = tmp_path / f"{METRICS_DIR_PREFIX}making"
    making.mkdir()
    assert remove_orphaned_metrics_dirs(tmp_path) == []
    assert making.is_dir()
