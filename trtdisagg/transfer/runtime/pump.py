"""The agent's one lock, and the one thread that posts slow writes, polls the agent while a
transfer waits and releases each write that ended (docs/LIFECYCLE.md, "Who notices that a write
ended").

A quick post runs on the Trio thread, but only while no blocking call runs: the lock is then free
or held by the pump for microseconds. A Trio task cannot poll the agent often enough (epoll's
timeout is whole milliseconds), hence the thread, parked on a `threading.Event` while nothing is
awaited. A post that blocks runs on that thread, which polls its write at once: from a worker
thread, the write would go unpolled during the hops to the Trio thread and the pump (each waiting
for the GIL), and over TCP an unpolled write does not move.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import trio

from trtdisagg.transfer.errors import TransferLayerError
from trtdisagg.transfer.runtime.agents.base import TransferAgent, XferHandle, XferStatus

log = logging.getLogger(__name__)

T = TypeVar("T")
Notifications = list[tuple[str, bytes]]
Ended = list[tuple[int, XferStatus]]
Posted = list[tuple[int, str | None]]  # a write posted, or why its post failed

# The pump's period while a write or a notification is awaited (each poll takes microseconds).
# Over TCP UCX moves bytes only while both ends progress it, so a slow period caps the write's
# rate (docs/BENCHMARKS.md, between hosts).
PUMP_INTERVAL_S = 50e-6
_PR_SET_TIMERSLACK = 29


class AgentPump:
    """The agent, its lock, and the pump's thread (the module docstring)."""

    def __init__(self, agent: TransferAgent,
                 deliver: Callable[[Posted, Notifications, Ended], None]) -> None:  # fmt: skip
        self.agent, self._deliver = agent, deliver
        self._lock = threading.Lock()  # the agent's
        self._slow = 0  # blocking calls under way (each in a worker thread or on the pump's)
        self._state = threading.Lock()  # guards what the Trio thread hands over, and the wake-up
        self._wakeup = threading.Event()
        self._posts: list[tuple[int, Callable[[], XferHandle]]] = []
        self._notices = self._stopping = False
        self._writes: dict[int, XferHandle] = {}  # polled (the agent's lock guards it)
        self._thread: threading.Thread | None = None

    async def in_thread(self, call: Callable[[], T]) -> T:
        self._slow += 1
        try:
            return await trio.to_thread.run_sync(self._locked, call)
        finally:
            self._slow -= 1

    def _locked(self, call: Callable[[], T]) -> T:
        with self._lock:
            return call()

    def post(self, write_id: int, submit: Callable[[], XferHandle], *, quick: bool) -> None:
        """Post a write (here if `quick` and no blocking call runs, else on the pump's thread),
        poll it until it ends, release it. Whether its post failed is delivered before its end:
        a quick post's at once."""
        if quick and not self._slow:
            error = self._submit(write_id, submit)
            with self._state:
                self._wakeup.set()
            self._deliver([(write_id, error)], [], [])
            return
        self._slow += 1  # (until it is delivered)
        with self._state:
            self._posts.append((write_id, submit))
            self._wakeup.set()

    def want_notices(self, wanted: bool) -> None:
        """Drain the agent's notifications (while a receive awaits one) or not."""
        if wanted != self._notices:
            with self._state:
                self._notices = wanted
                if wanted:
                    self._wakeup.set()

    def start(self) -> None:
        token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(
            target=self._run, args=(token,), name="kv-notification-pump", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        with self._state:
            self._stopping = True
            self._wakeup.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self, token: trio.lowlevel.TrioToken) -> None:
        _cut_timer_slack()
        while True:
            self._wakeup.wait()
            with self._state:
                if self._stopping:
                    return
                posts, self._posts = self._posts, []
                notices = self._notices
                if not posts and not self._writes and not notices:
                    self._wakeup.clear()  # under the lock: a post made now sets it again
                    continue
            posted = [(write_id, self._submit(write_id, submit)) for write_id, submit in posts]
            try:  # every transfer of the worker waits on this thread: nothing may end it
                got, ended = self._poll(notices)
            except Exception:
                log.exception("polling the transfer agent; polling again in 1 s")
                got, ended = [], []
                time.sleep(1.0)
            if posted or got or ended:
                with contextlib.suppress(trio.RunFinishedError):  # (stopped first, normally)
                    token.run_sync_soon(self._delivered, posted, got, ended)
            time.sleep(PUMP_INTERVAL_S)

    def _submit(self, write_id: int, submit: Callable[[], XferHandle]) -> str | None:
        """Post a write and poll it from now on; why the post failed, if it did."""
        try:
            with self._lock:
                self._writes[write_id] = submit()
        except Exception as exc:  # a failed post fails its write, never the pump
            if not isinstance(exc, TransferLayerError):
                log.exception("posting KV write %d", write_id)
            return str(exc) or type(exc).__name__
        return None

    def _poll(self, notices: bool) -> tuple[Notifications, Ended]:
        agent, ended = self.agent, Ended()
        with self._lock:
            got = agent.get_notifications() if notices else []
            for write_id, handle in self._writes.items():
                try:
                    state = agent.poll(handle)
                except Exception as exc:  # (an agent's own error, or what its backend raised)
                    log.warning("polling write %d: %r", write_id, exc)
                    state = XferStatus.ERROR
                if state is not XferStatus.PENDING:
                    ended.append((write_id, state))
            for write_id, _ in ended:
                try:
                    agent.release(self._writes.pop(write_id))
                except Exception:  # (its write has ended all the same)
                    log.exception("releasing KV write %d", write_id)
        return got, ended

    def _delivered(self, posted: Posted, got: Notifications, ended: Ended) -> None:
        self._slow -= len(posted)  # (on the Trio thread, as `post` counted them)
        try:  # on the Trio thread, outside any task: nothing may escape
            self._deliver(posted, got, ended)
        except Exception:
            log.exception("handing the agent's news over failed")


def _cut_timer_slack() -> None:
    """Let this thread's short sleeps end on time: Linux adds 50 us of timer slack to each one
    by default, as long as the whole period we sleep."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
