"""The engine loop's wake-up.

Made first, before anything that wakes the loop (the transceiver, the handlers' inbox), so that
none of them needs the loop itself.
"""

from __future__ import annotations

import math

import attrs
import trio


@attrs.define(eq=False, kw_only=True)
class Wakeup:
    _event: trio.Event = attrs.field(factory=trio.Event, alias="event")

    def set(self) -> None:
        """Something changed for the loop (a request, an abort, a transfer's end): wake it.
        Safe from any task of the loop's thread, never blocks."""
        self._event.set()

    async def wait(self, timeout: float = math.inf) -> None:
        """Until `set` (or `timeout` seconds); a `set` while the loop was busy counts."""
        with trio.move_on_after(timeout):
            await self._event.wait()
        self._event = trio.Event()
