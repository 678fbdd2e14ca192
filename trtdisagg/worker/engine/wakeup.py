"""The engine loop's wake-up, and whether a step runs now.

Made first, before anything that wakes the loop (the transceiver, the handlers' inbox), so that
none of them needs the loop itself.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import attrs
import trio


@attrs.define(eq=False, kw_only=True)
class Wakeup:
    _event: trio.Event = attrs.field(factory=trio.Event, alias="event")
    _steps: int = attrs.field(default=0, alias="steps")  # launched and not finished

    def set(self) -> None:
        """Something changed for the loop (a request, an abort, a transfer's end): wake it.
        Safe from any task of the loop's thread, never blocks."""
        self._event.set()

    async def wait(self, timeout: float = math.inf) -> None:
        """Until `set` (or `timeout` seconds); a `set` while the loop was busy counts."""
        with trio.move_on_after(timeout):
            await self._event.wait()
        self._event = trio.Event()

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Marks a step (a forward, or a multi-rank tick) running in a worker thread."""
        self.step_started()
        try:
            yield
        finally:
            self.step_ended()

    def step_started(self) -> None:
        """A step was launched (asynchronous steps overlap: several may be in flight)."""
        self._steps += 1

    def step_ended(self) -> None:
        """A launched step finished (or failed)."""
        self._steps -= 1

    def idle(self) -> bool:
        """Whether no step runs now (the transceiver may then spin its loop, pacing.py)."""
        return self._steps == 0
