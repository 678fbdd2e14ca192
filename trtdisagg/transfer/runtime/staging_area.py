"""StagingArea: room in this rank's staging buffer, handed out first come, first served.

Bouncing transfers (protocol/bounce.py) reserve their bytes here before they write (ctx) or ask
(gen). A reservation that does not fit waits in arrival order, until the transfer's deadline:
a large one is never overtaken forever by small ones, and since every holder frees its room once
its own write or scatter is done, waiting cannot deadlock.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import attrs
import trio

from trtdisagg.transfer.errors import TransferLayerError
from trtdisagg.transfer.protocol.bounce import Stager, StagingAllocator


@attrs.define(eq=False, kw_only=True)
class StagingArea:
    stager: Stager
    clock: Callable[[], float]
    allocator: StagingAllocator = attrs.field(init=False)
    _queue: collections.deque[object] = attrs.Factory(collections.deque)
    _changed: trio.Event = attrs.Factory(trio.Event)

    def __attrs_post_init__(self) -> None:
        self.allocator = StagingAllocator(capacity=self.stager.capacity)

    @property
    def capacity(self) -> int:
        return self.stager.capacity

    async def reserve(self, num_bytes: int, deadline: float) -> int:
        """The offset of `num_bytes` reserved bytes; TransferLayerError at the deadline, or at
        once for a size no wait can serve (it would otherwise hold the head of the line, and
        everyone behind it, until its deadline)."""
        if not 0 < num_bytes <= self.capacity:
            raise TransferLayerError(
                f"cannot stage {num_bytes} bytes in a staging buffer of {self.capacity}"
            )
        ticket = object()
        self._queue.append(ticket)
        try:
            with trio.move_on_at(trio.current_time() + max(deadline - self.clock(), 0.0)):
                while True:
                    if self._queue[0] is ticket:
                        offset = self.allocator.allocate(num_bytes)
                        if offset is not None:
                            return offset
                    changed = self._changed
                    await changed.wait()
            raise TransferLayerError(
                f"no room for {num_bytes} bytes in the staging buffer before the deadline "
                f"({self.allocator.free_bytes} of {self.capacity} free)"
            )
        finally:
            self._queue.remove(ticket)
            self._notify()  # the next in line may fit now

    def release(self, offset: int) -> None:
        self.allocator.release(offset)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
