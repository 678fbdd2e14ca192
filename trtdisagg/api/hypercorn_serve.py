"""hypercorn's Trio server, with a connection closed as soon as its client closes it.

hypercorn 0.18's Trio `TCPServer` keeps a connection whose client closed it while it was idle
(before its first request, or between two) open until `keep_alive_timeout` ends: its idle timer
lives in the connection's task group and outlives the read loop that saw the end of the stream.
With our 75 s keep-alive, a client that opens a connection per request (curl, a load balancer's
TCP probe) holds one descriptor per connection for 75 s after it left, and about 14 such
connections a second run a process with the usual limit of 1024 descriptors out of them. Here the
idle timer stops once the client's side has ended, so the connection closes at once; one whose
request is still being answered closes when that answer ends, as before. And an answer that ends
its connection (`Connection: close`) closes it: hypercorn's close ran in a cancelled task and
stopped before it did. While the process is out of descriptors, trio logs each failed accept
with its traceback, ten a second: here one line a second says it, and how many it stands for.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import hypercorn.config
import hypercorn.trio
import hypercorn.trio.run
import trio
from hypercorn.trio.tcp_server import TCPServer


class _PromptlyClosedTCPServer(TCPServer):
    async def _read_data(self) -> None:
        await super()._read_data()
        await self.idle_task.stop()  # the client is gone: nothing to keep the connection for

    async def _close(self) -> None:
        # An answer that ends the connection (`Connection: close`) closes it from the task that
        # sent the answer, which the framework has cancelled by then: unshielded, the close
        # stopped at its first checkpoint and the connection stayed open.
        with trio.CancelScope(shield=True):
            await super()._close()


class AcceptFailuresOnceASecond(logging.Filter):
    """trio's line for an accept that failed for want of resources (EMFILE, ENFILE, ENOMEM,
    ENOBUFS): at most one a second, without its traceback, counting the ones it stands for."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._last = -math.inf
        self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = self._clock()
        if now - self._last < 1.0:
            self._dropped += 1
            return False
        self._last = now
        record.exc_info, record.exc_text = None, None
        if self._dropped:
            record.msg = f"{record.msg} ({self._dropped} more since the last line)"
            self._dropped = 0
        return True


_ACCEPT_LOG = logging.getLogger("trio.serve_listeners")


async def serve(
    app: Any,
    config: hypercorn.config.Config,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`hypercorn.trio.serve`, with connections closed when their clients close them."""
    hypercorn.trio.run.TCPServer = _PromptlyClosedTCPServer  # type: ignore[misc]
    if not any(isinstance(f, AcceptFailuresOnceASecond) for f in _ACCEPT_LOG.filters):
        _ACCEPT_LOG.addFilter(AcceptFailuresOnceASecond())
    await hypercorn.trio.serve(app, config, task_status=task_status)
