"""The log of accepts that fail for want of descriptors (api/hypercorn_serve.py)."""

from __future__ import annotations

import logging
import sys

from trtdisagg.api.hypercorn_serve import AcceptFailuresOnceASecond


class Clock:
    now = 50.0

    def __call__(self) -> float:
        return self.now


def record() -> logging.LogRecord:
    try:
        raise OSError(24, "Too many open files")
    except OSError:
        exc_info = sys.exc_info()
    return logging.LogRecord(
        "trio.serve_listeners", logging.ERROR, __file__, 1,
        "accept returned %s (%s); retrying in %s seconds",
        ("EMFILE", "Too many open files", 0.1), exc_info,
    )  # fmt: skip


def test_one_line_a_second_without_traceback_counting_the_rest() -> None:
    clock = Clock()
    only = AcceptFailuresOnceASecond(clock)
    passed = []
    for _ in range(10):  # ten a second, as trio retries
        r = record()
        if only.filter(r):
            passed.append(r)
        clock.now += 0.09
    clock.now = 51.5
    r = record()
    assert only.filter(r)
    passed.append(r)
    assert len(passed) == 2
    assert all(r.exc_info is None and r.exc_text is None for r in passed)
    assert (
        passed[0].getMessage()
        == "accept returned EMFILE (Too many open files); retrying in 0.1 seconds"
    )
    assert passed[1].getMessage().endswith("seconds (9 more since the last line)")
