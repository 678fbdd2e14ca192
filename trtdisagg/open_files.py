"""The process's open-file limit, raised to what the system allows at start.

Every stream through the coordinator holds a client connection and an upstream one, a worker
holds its clients' connections and a control socket per peer: at the soft limit many systems give
a process (1024), a few hundred concurrent streams run out of descriptors. The hard limit is the
administrator's; the soft one is ours to raise up to it (as vLLM and SGLang do). Child processes
inherit it.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

# Enough for any front end; a hard limit of "unlimited" is not a soft limit the kernel takes.
MAX_OPEN_FILES = 1 << 20


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (at most MAX_OPEN_FILES); the soft limit
    after. A limit the system refuses to raise stays as it was (and is logged)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning(
                "open-file limit stays %d (could not raise it to %d: %s)", soft, target, exc
            )
            return soft
        return target
    return soft
