"""The bounce path's staging room under arbitrary allocate/release/cancel sequences.

A staging buffer that loses room for good turns every later bounced transfer into a wait until
its deadline: SGLang once shipped a staging ring whose watermark never advanced after wrapping,
so prefill waited forever. Such bugs only show after particular interleavings, so instead of a
few hand-picked cases these tests let hypothesis drive `StagingAllocator` (first-fit ranges) and
`StagingArea` (its one FIFO queue of reservations, on trio) through random sequences, and check
after every step what the code promises:

- reservations never overlap and lie inside [0, capacity); free + held bytes == capacity;
- the allocator is exactly first-fit, and an idle buffer serves one reservation of its whole
  capacity (nothing fragmented or stuck is left behind);
- sizes outside (0, capacity] are refused at once, naming both sizes: a ValueError from the
  allocator, a TransferLayerError from the area even with others in line; a capacity that is
  not a whole number of alignment units is refused when the allocator is made;
- the area serves strictly in arrival order, a waiter that fits is woken (nobody sleeps at the
  head of the line while its bytes are free), a cancelled or timed-out waiter leaves nothing
  behind, and a wait ends at its deadline with an error naming the sizes.

Waiting tasks are settled with `trio.testing.wait_all_tasks_blocked`, never with sleeps.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from trtdisagg.transfer.errors import TransferLayerError
from trtdisagg.transfer.protocol.bounce import StagedRun, StagingAllocator
from trtdisagg.transfer.runtime.staging_area import StagingArea

ALIGN = 256  # StagingArea's allocator keeps StagingAllocator's default alignment


def _aligned(num_bytes: int, alignment: int = ALIGN) -> int:
    return -(-num_bytes // alignment) * alignment


def _sizes(capacity: int, alignment: int) -> st.SearchStrategy[int]:
    """Valid request sizes, with the boundaries (1, one alignment unit and either side of it,
    exactly the capacity) drawn far more often than a uniform draw would."""
    edges = {1, alignment, alignment + 1, max(alignment - 1, 1), capacity, max(capacity - 1, 1)}
    return st.one_of(
        st.sampled_from(sorted(s for s in edges if s <= capacity)), st.integers(1, capacity)
    )


def _gaps(used: dict[int, int], capacity: int) -> list[tuple[int, int]]:
    """The free ranges (offset, size) a correct allocator holds, given what is in use."""
    gaps, cursor = [], 0
    for offset in sorted(used):
        if offset > cursor:
            gaps.append((cursor, offset - cursor))
        cursor = offset + used[offset]
    if cursor < capacity:
        gaps.append((cursor, capacity - cursor))
    return gaps


def _assert_disjoint_inside(ranges: Sequence[tuple[int, int]], capacity: int) -> None:
    end = 0
    for offset, size in sorted(ranges):
        assert offset >= end, f"range at {offset} overlaps the one ending at {end}: {ranges}"
        end = offset + size
    assert end <= capacity, f"a range ends at {end}, past the capacity {capacity}: {ranges}"


# --- StagingAllocator -------------------------------------------------------------------------


class StagingAllocatorMachine(RuleBasedStateMachine):
    """A model of the allocator (what is in use) checked against it after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = StagingAllocator(capacity=0)  # replaced by `setup`
        self.used: dict[int, int] = {}  # offset -> aligned size

    # Aligned capacities only: that is what production builds (`kv_cache_bounce_size_mb << 20`);
    # unaligned ones have their own test below, so that a failure there does not mask this one.
    @initialize(alignment=st.sampled_from([1, 16, ALIGN]), units=st.integers(1, 48))
    def setup(self, alignment: int, units: int) -> None:
        self.alloc = StagingAllocator(capacity=alignment * units, alignment=alignment)

    @property
    def capacity(self) -> int:
        return self.alloc.capacity

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        num_bytes = data.draw(_sizes(self.capacity, self.alloc.alignment), label="num_bytes")
        size = _aligned(num_bytes, self.alloc.alignment)
        # First fit is the documented policy; None exactly when no merged gap is large enough,
        # so a release that failed to merge neighbours shows up here as a wrong None.
        expected = next((o for o, free in _gaps(self.used, self.capacity) if free >= size), None)
        offset = self.alloc.allocate(num_bytes)
        assert offset == expected, f"allocate({num_bytes}) gave {offset}, first fit is {expected}"
        if offset is not None:
            self.used[offset] = size

    @rule(data=st.data())
    def allocate_out_of_range(self, data: st.DataObject) -> None:
        num_bytes = data.draw(
            st.one_of(st.integers(-3, 0), st.integers(self.capacity + 1, 3 * self.capacity + 1)),
            label="num_bytes",
        )
        free = self.alloc.free_bytes
        with pytest.raises(
            ValueError, match=f"^cannot stage {num_bytes} bytes in a buffer of {self.capacity}$"
        ):
            self.alloc.allocate(num_bytes)
        assert self.alloc.free_bytes == free  # a refusal takes nothing

    @precondition(lambda self: bool(self.used))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.used)), label="offset")
        self.alloc.release(offset)
        del self.used[offset]

    @rule(data=st.data())
    def drain_then_take_everything(self, data: st.DataObject) -> None:
        # Whatever happened before and in whatever order things come back, an empty buffer must
        # be one range again: the "stuck watermark" bug leaves room that is free but unusable.
        for offset in data.draw(st.permutations(sorted(self.used)), label="release order"):
            self.alloc.release(offset)
        self.used.clear()
        assert self.alloc.free_bytes == self.capacity
        assert self.alloc.allocate(self.capacity) == 0
        self.alloc.release(0)

    @invariant()
    def bytes_add_up_and_ranges_are_disjoint(self) -> None:
        held = sum(self.used.values())
        assert self.alloc.free_bytes + held == self.capacity, (
            f"{self.alloc.free_bytes} free + {held} held != capacity {self.capacity}"
        )
        _assert_disjoint_inside(list(self.used.items()), self.capacity)


StagingAllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestStagingAllocator = StagingAllocatorMachine.TestCase


@settings(max_examples=200, deadline=None)
@given(alignment=st.sampled_from([1, 16, ALIGN]), capacity=st.integers(1, 4096))
def test_allocator_idle_buffer_serves_its_whole_capacity(alignment: int, capacity: int) -> None:
    # `allocate` accepts any size up to `capacity` and promises None only "while nothing that
    # large is free"; on an idle buffer all of it is free. Sizes round up to the alignment, so a
    # ragged capacity would turn a legal request into one that waits forever: such a buffer is
    # refused when made (hypothesis found `capacity=1, alignment=16` served nothing).
    if capacity % alignment:
        with pytest.raises(ValueError, match=f"^staging capacity {capacity} is not a multiple"):
            StagingAllocator(capacity=capacity, alignment=alignment)
        return
    alloc = StagingAllocator(capacity=capacity, alignment=alignment)
    offset = alloc.allocate(capacity)
    assert offset == 0, (
        f"an idle {capacity}-byte buffer (alignment {alignment}) refused allocate({capacity}): "
        f"{offset}, with {alloc.free_bytes} bytes free"
    )


# --- StagingArea --------------------------------------------------------------------------------


@attrs.frozen
class FakeStager:
    """Just the room: StagingArea only reads the capacity; the copies are not under test."""

    capacity: int
    address: int = 0x10000
    memory_type: str = "DRAM"

    def pack(
        self,
        offset: int,
        runs: Sequence[StagedRun],
        block_ids: Sequence[int],
        *,
        first_token: int,
        num_tokens: int,
    ) -> None:
        raise AssertionError("not used")

    def unpack(
        self, offset: int, block_ids: Sequence[int], *, first_token: int, num_tokens: int
    ) -> None:
        raise AssertionError("not used")


def _area(capacity: int) -> StagingArea:
    return StagingArea(stager=FakeStager(capacity), clock=trio.current_time)


@attrs.define(eq=False)
class Waiter:
    """One `reserve` call running in its own task, and what became of it."""

    name: str
    arrival: int
    num_bytes: int
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    offset: int | None = None
    error: Exception | None = None
    state: str = "waiting"  # -> held -> released, or -> cancelled, or -> failed


async def _reserve(
    area: StagingArea, waiter: Waiter, everyone: list[Waiter], deadline: float, served: list[str]
) -> None:
    with waiter.scope:
        try:
            waiter.offset = await area.reserve(waiter.num_bytes, deadline)
        except (TransferLayerError, ValueError) as error:
            waiter.error, waiter.state = error, "failed"
            return
        # Checked at the moment of service, in the same scheduling step as the return: anyone
        # who arrived earlier and still waits has been overtaken.
        ahead = [w.name for w in everyone if w.state == "waiting" and w.arrival < waiter.arrival]
        assert not ahead, f"{waiter.name} was served while {ahead} waited ahead of it"
        waiter.state = "held"
        served.append(waiter.name)
    if waiter.state == "waiting":
        waiter.state = "cancelled"


@attrs.define
class Line:
    """Waiters on one area, started one at a time so that arrival order is known."""

    area: StagingArea
    nursery: trio.Nursery
    deadline: float = math.inf
    waiters: list[Waiter] = attrs.Factory(list)
    served: list[str] = attrs.Factory(list)

    async def join(self, num_bytes: int, name: str = "", deadline: float | None = None) -> Waiter:
        waiter = Waiter(name or f"w{len(self.waiters)}", len(self.waiters), num_bytes)
        self.waiters.append(waiter)
        when = self.deadline if deadline is None else deadline
        self.nursery.start_soon(_reserve, self.area, waiter, self.waiters, when, self.served)
        # Queued (or served) before anyone else arrives: arrival order is join order.
        await trio.testing.wait_all_tasks_blocked()
        return waiter

    def by_state(self, state: str) -> list[Waiter]:
        return [w for w in self.waiters if w.state == state]

    def release(self, waiter: Waiter) -> None:
        assert waiter.state == "held" and waiter.offset is not None
        self.area.release(waiter.offset)
        waiter.state = "released"


def _check_area(line: Line) -> None:
    area, capacity = line.area, line.area.allocator.capacity
    held = [(w.offset, _aligned(w.num_bytes)) for w in line.by_state("held")]
    assert all(offset is not None for offset, _ in held)
    ranges = [(offset, size) for offset, size in held if offset is not None]
    _assert_disjoint_inside(ranges, capacity)
    in_use = sum(size for _, size in ranges)
    # A cancelled or failed waiter that kept its bytes shows here as bytes nobody holds.
    assert area.allocator.free_bytes + in_use == capacity, (
        f"{area.allocator.free_bytes} free + {in_use} held != capacity {capacity}"
    )
    waiting = line.by_state("waiting")
    if waiting:
        head = waiting[0]
        # Liveness: everyone is blocked now, so the head of the line must really not fit. If it
        # would, a wake-up was lost or a departed ticket still blocks the line: it would sleep
        # until its deadline although its bytes are free (the stuck-watermark symptom).
        probe = copy.deepcopy(area.allocator)
        assert probe.allocate(head.num_bytes) is None, (
            f"{head.name} ({head.num_bytes} bytes) heads the line and fits, yet sleeps; "
            f"{area.allocator.free_bytes} of {capacity} free, waiting: "
            f"{[(w.name, w.num_bytes) for w in waiting]}"
        )


Op = tuple[str, int]


@st.composite
def area_scripts(draw: st.DrawFn) -> tuple[int, list[Op]]:
    capacity = ALIGN * draw(st.integers(1, 12))
    op = st.one_of(
        st.tuples(st.just("reserve"), _sizes(capacity, ALIGN)),
        st.tuples(st.just("release"), st.integers(0, 1 << 16)),  # which: modulo those held
        st.tuples(st.just("cancel"), st.integers(0, 1 << 16)),  # which: modulo those waiting
        st.tuples(st.just("oversized"), st.integers(capacity + 1, 4 * capacity)),
    )
    return capacity, draw(st.lists(op, max_size=40))


async def _play(capacity: int, ops: list[Op]) -> None:
    area = _area(capacity)
    # A guard, not a synchronisation: a bug that blocks forever fails this example instead of
    # hanging the run until pytest-timeout.
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            line = Line(area, nursery)
            for kind, value in ops:
                if kind == "reserve":
                    await line.join(value)
                elif kind == "release" and line.by_state("held"):
                    held = line.by_state("held")
                    line.release(held[value % len(held)])
                elif kind == "cancel" and line.by_state("waiting"):
                    waiting = line.by_state("waiting")
                    waiting[value % len(waiting)].scope.cancel()
                elif kind == "oversized":
                    # Refused at once, whoever waits; a deadline of now makes a wait (instead of
                    # a refusal) fail with the deadline's message, not hang.
                    with pytest.raises(
                        TransferLayerError,
                        match=f"^cannot stage {value} bytes in a staging buffer of {capacity}$",
                    ):
                        await area.reserve(value, trio.current_time())
                await trio.testing.wait_all_tasks_blocked()
                _check_area(line)
            assert not line.by_state("failed")  # no deadline was ever due

            for waiter in line.by_state("waiting"):
                waiter.scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            for waiter in line.by_state("held"):
                line.release(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert area.allocator.free_bytes == capacity
            # The whole buffer, at once (deadline now): the line and the ranges are both clear.
            assert await area.reserve(capacity, trio.current_time()) == 0
            area.release(0)


@settings(max_examples=200, deadline=None)
@given(script=area_scripts())
def test_area_fuzz_fifo_disjoint_and_nobody_stuck(script: tuple[int, list[Op]]) -> None:
    capacity, ops = script
    trio.run(_play, capacity, ops)


async def test_area_head_of_line_is_not_overtaken_and_is_woken_by_a_release() -> None:
    area = _area(4 * ALIGN)
    async with trio.open_nursery() as nursery:
        line = Line(area, nursery)
        first = await line.join(3 * ALIGN, "first")
        big = await line.join(2 * ALIGN, "big")  # 1 unit free: waits
        small = await line.join(ALIGN, "small")  # would fit, but "first come, first served"
        assert (first.state, big.state, small.state) == ("held", "waiting", "waiting")
        assert area.allocator.free_bytes == ALIGN  # small did not slip into the free unit

        line.release(first)  # the only event: the waiters must be woken by it
        await trio.testing.wait_all_tasks_blocked()
        assert line.served == ["first", "big", "small"]
        assert (big.offset, small.offset) == (0, 2 * ALIGN)
        _check_area(line)


async def test_area_cancelled_waiter_leaves_nothing_and_lets_the_next_one_in() -> None:
    area = _area(4 * ALIGN)
    async with trio.open_nursery() as nursery:
        line = Line(area, nursery)
        first = await line.join(3 * ALIGN, "first")
        big = await line.join(2 * ALIGN, "big")
        small = await line.join(ALIGN, "small")
        assert small.state == "waiting"

        big.scope.cancel()  # nothing is released: only big leaving the line can let small in
        await trio.testing.wait_all_tasks_blocked()
        assert (big.state, big.offset) == ("cancelled", None)
        assert (small.state, small.offset) == ("held", 3 * ALIGN)
        assert area.allocator.free_bytes == 0

        line.release(first)
        line.release(small)
        assert area.allocator.free_bytes == area.allocator.capacity
        assert await area.reserve(area.allocator.capacity, trio.current_time()) == 0


async def test_area_wait_ends_at_its_deadline_naming_the_sizes(
    mock_clock: trio.testing.MockClock,
) -> None:
    area = _area(4 * ALIGN)
    async with trio.open_nursery() as nursery:
        line = Line(area, nursery)
        first = await line.join(3 * ALIGN, "first")
        start = trio.current_time()
        big = await line.join(2 * ALIGN, "big", deadline=start + 10)
        small = await line.join(ALIGN, "small", deadline=start + 100)

        mock_clock.jump(9.5)
        await trio.testing.wait_all_tasks_blocked()
        assert (big.state, small.state) == ("waiting", "waiting")

        mock_clock.jump(1)
        await trio.testing.wait_all_tasks_blocked()
        assert big.state == "failed" and isinstance(big.error, TransferLayerError)
        assert str(big.error) == (
            f"no room for {2 * ALIGN} bytes in the staging buffer before the deadline "
            f"({ALIGN} of {4 * ALIGN} free)"
        )
        # Timing out is leaving the line: small, behind it and fitting, is served at once.
        assert (small.state, small.offset) == ("held", 3 * ALIGN)
        line.release(first)
        line.release(small)
        assert area.allocator.free_bytes == area.allocator.capacity


@pytest.mark.parametrize("num_bytes", [0, -1, 4 * ALIGN + 1, 1 << 40])
async def test_area_refuses_impossible_sizes_at_once(num_bytes: int) -> None:
    area = _area(4 * ALIGN)
    held = await area.reserve(ALIGN, trio.current_time())
    # Deadline now: a request that queued instead of being refused would end with the
    # deadline's message ("no room for ..."), not this one.
    with pytest.raises(
        TransferLayerError,
        match=f"^cannot stage {num_bytes} bytes in a staging buffer of {4 * ALIGN}$",
    ):
        await area.reserve(num_bytes, trio.current_time())
    assert area.allocator.free_bytes == 3 * ALIGN  # the refusal took nothing...
    assert await area.reserve(3 * ALIGN, trio.current_time()) == ALIGN  # ...nor blocks the line
    area.release(held)
