"""A spawned helper process (a front end of a fleet, a worker's API front) ends with its parent.

A parent that dies without stopping its children (SIGKILL, the OOM killer) would leave them
serving: a worker front answering for an engine that is gone, or a coordinator front end still
taking a share of the port (`SO_REUSEPORT`) with the old settings when a new fleet starts there.
No event reports a parent's death to a child, so the child looks every `PARENT_POLL_S`: when it
has been reparented, it exits at once, as its parent's death left it nothing to finish cleanly.
"""

from __future__ import annotations

import logging
import os
from typing import Final

import trio

PARENT_POLL_S: Final = 0.5


async def exit_with_parent(parent_pid: int, log: logging.Logger, who: str) -> None:
    """Exit this process (code 1) once `parent_pid` is no longer its parent.

    The parent passes its pid at spawn: the child's own getppid(), read once it is up, would
    already name init had the parent died during the child's start, and it would wait forever.
    """
    while os.getppid() == parent_pid:  # noqa: ASYNC110
        await trio.sleep(PARENT_POLL_S)
    log.error("%s: its parent process (pid %d) is gone; exiting", who, parent_pid)
    os._exit(1)
