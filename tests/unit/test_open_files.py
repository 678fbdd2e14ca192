"""The open-file limit a process raises at start (trtdisagg/open_files.py)."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from trtdisagg.open_files import MAX_OPEN_FILES

PROBE = (
    "import resource; from trtdisagg.open_files import raise_open_file_limit; "
    "print(raise_open_file_limit(), *resource.getrlimit(resource.RLIMIT_NOFILE))"
)


def _run(soft: int, hard: int) -> list[int]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    out = subprocess.run(
        [sys.executable, "-c", PROBE], preexec_fn=limit, capture_output=True, text=True, check=True
    )
    return [int(x) for x in out.stdout.split()]


def test_a_low_soft_limit_is_raised_to_the_hard_one() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > MAX_OPEN_FILES:
        hard = MAX_OPEN_FILES
    if hard <= 256:
        pytest.fail(f"this machine's hard open-file limit ({hard}) leaves nothing to raise")
    assert _run(256, hard) == [hard, hard, hard]


def test_a_soft_limit_already_at_the_hard_one_stays() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = min(hard, MAX_OPEN_FILES) if hard != resource.RLIM_INFINITY else MAX_OPEN_FILES
    assert _run(hard, hard) == [hard, hard, hard]
