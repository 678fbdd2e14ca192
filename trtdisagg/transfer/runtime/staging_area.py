"""StagingArea: this rank's staging buffer: its room, first come first served, and the copies.

Bouncing transfers (protocol/bounce.py) reserve their bytes here before they write (ctx) or ask
(gen); ctx packs its share into the room before the one write (`stage`), gen copies what landed
into its blocks (`scatter`). A reservation that does not fit waits in arrival order, until the
transfer's deadline: a large one is never overtaken forever by small ones, and since every holder
frees its room once its own write or scatter is done, waiting cannot deadlock.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Awaitable, Callable

import attrs
import trio

from trtdisagg.transfer.errors import TransferLayerError
from trtdisagg.transfer.protocol import events as ev
from trtdisagg.transfer.protocol.bounce import Stager, StagingAllocator
from trtdisagg.transfer.protocol.fragments import Fragments


@attrs.define(eq=False, kw_only=True)
class StagingArea:
    stager: Stager
    clock: Callable[[], float]
    allocator: StagingAllocator = attrs.field(init=False)
    _queue: collections.deque[object] = attrs.Factory(collections.deque)
    _changed: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)

    def __attrs_post_init__(self) -> None:
        self.allocator = StagingAllocator(capacity=self.stager.capacity)

    async def reserve(self, num_bytes: int, deadline: float) -> int:
        """The offset of `num_bytes` reserved bytes; TransferLayerError at the deadline, or at
        once for a size no wait can serve (it would otherwise hold the head of the line, and
        everyone behind it, until its deadline)."""
        capacity = self.allocator.capacity
        if not 0 < num_bytes <= capacity:
            raise TransferLayerError(
                f"cannot stage {num_bytes} bytes in a staging buffer of {capacity}"
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
                    await self._changed.park()
            raise TransferLayerError(
                f"no room for {num_bytes} bytes in the staging buffer before the deadline "
                f"({self.allocator.free_bytes} of {capacity} free)"
            )
        finally:
            self._queue.remove(ticket)
            self._changed.unpark_all()  # the next in line may fit now

    async def stage(
        self, order: ev.WriteOrder, in_thread: Callable[[Callable[[], None]], Awaitable[None]]
    ) -> tuple[int, ev.WriteOrder]:
        """Reserve room and pack `order`'s share into it (the packing through `in_thread`, which
        holds the agent's lock): the offset, and the order that writes from it."""
        staged = order.staged
        assert staged is not None
        offset = await self.reserve(staged.num_bytes, order.deadline)
        pack = functools.partial(
            self.stager.pack, offset, staged.runs, staged.block_ids,
            first_token=staged.first_token, num_tokens=staged.num_tokens,
        )  # fmt: skip
        try:
            await in_thread(pack)
        except TransferLayerError:
            self.release(offset)
            raise
        rows = order.fragments.rows.copy()
        rows[:, 0] += self.stager.address + offset
        return offset, attrs.evolve(order, fragments=Fragments(rows))

    async def scatter(self, staged: ev.Staged) -> str | None:
        """Copy a bounced receive into its blocks and free its room; what failed, if anything.
        On the GPU the copy is queued on the device's stream, ahead of any step that reads the
        blocks; from host memory it is real work, done in a worker thread."""
        unpack = functools.partial(
            self.stager.unpack, staged.offset, staged.block_ids,
            first_token=staged.first_token, num_tokens=staged.num_tokens,
        )  # fmt: skip
        try:
            if self.stager.memory_type == "VRAM":
                unpack()
            else:
                await trio.to_thread.run_sync(unpack)
        except Exception as exc:  # a failed copy fails the request, never the service
            return f"{type(exc).__name__}: {exc}"
        finally:
            self.release(staged.offset)
        return None

    def release(self, offset: int) -> None:
        self.allocator.release(offset)
        self._changed.unpark_all()
