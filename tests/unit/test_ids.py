"""Snowflake ids: layout, range, uniqueness across threads and nodes; waiting, never wrapping."""

from __future__ import annotations

import threading

import pytest

from trtdisagg.ids import (
    MAX_COUNTER,
    MAX_GLOBAL_ID,
    MIN_GLOBAL_ID,
    SnowflakeGenerator,
    compose,
    derive_node_id,
    is_global_id,
    next_local_id,
)


class FakeClock:
    """Milliseconds that advance only when the generator sleeps (or the test says so)."""

    def __init__(self, now: int = 1_000) -> None:
        self.now = now
        self.sleeps = 0

    def __call__(self) -> int:
        return self.now

    def sleep(self, _seconds: float) -> None:
        self.sleeps += 1
        if self.sleeps % 3 == 0:  # a few polls before the millisecond turns
            self.now += 1


def test_ids_from_8_threads_are_unique_and_in_range() -> None:
    gen = SnowflakeGenerator(node_id=7, process_id=3)
    per_thread = 100_000 // 8
    results: list[list[int]] = [[] for _ in range(8)]

    def mint(slot: list[int]) -> None:
        slot.extend(gen.next_id() for _ in range(per_thread))

    threads = [threading.Thread(target=mint, args=(r,)) for r in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [i for r in results for i in r]
    assert len(ids) == 100_000
    assert len(set(ids)) == len(ids)
    assert all(MIN_GLOBAL_ID <= i < MAX_GLOBAL_ID for i in ids)


def test_exhausted_millisecond_waits_for_the_next_instead_of_wrapping() -> None:
    clock = FakeClock()
    gen = SnowflakeGenerator(node_id=1, clock=clock, sleep=clock.sleep)
    first_ms = [gen.next_id() for _ in range(MAX_COUNTER + 1)]
    assert clock.sleeps == 0 and clock.now == 1_000
    overflow = gen.next_id()
    assert clock.now == 1_001 and clock.sleeps == 3
    assert overflow == compose(1_001, 1, 0, 0)
    assert first_ms == [compose(1_000, 1, 0, c) for c in range(MAX_COUNTER + 1)]
    assert len({*first_ms, overflow}) == MAX_COUNTER + 2


def test_clock_going_backwards_never_repeats_an_id() -> None:
    clock = FakeClock(now=5_000)
    gen = SnowflakeGenerator(node_id=1, clock=clock, sleep=clock.sleep)
    before = {gen.next_id() for _ in range(10)}
    clock.now = 4_000
    after = {gen.next_id() for _ in range(10)}
    assert not before & after


def test_two_node_ids_never_collide() -> None:
    clock_a, clock_b = FakeClock(), FakeClock()
    a = SnowflakeGenerator(node_id=1, clock=clock_a, sleep=clock_a.sleep)
    b = SnowflakeGenerator(node_id=2, clock=clock_b, sleep=clock_b.sleep)
    ids_a = {a.next_id() for _ in range(3 * (MAX_COUNTER + 1))}
    ids_b = {b.next_id() for _ in range(3 * (MAX_COUNTER + 1))}
    assert not ids_a & ids_b


def test_process_ids_separate_fleet_workers() -> None:
    clock = FakeClock()
    gens = [SnowflakeGenerator(node_id=9, process_id=p, clock=clock) for p in range(4)]
    ids = [g.next_id() for g in gens for _ in range(100)]
    assert len(set(ids)) == len(ids)


def test_layout() -> None:
    raw = (1234 << 24) | (5 << 16) | (6 << 10) | 7
    assert compose(1234, 5, 6, 7) == raw + MIN_GLOBAL_ID
    assert is_global_id(compose(1234, 5, 6, 7))


def test_local_ids_wrap_below_the_global_range() -> None:
    assert next_local_id(0) == 1
    assert next_local_id(MIN_GLOBAL_ID - 1) == 0
    assert not is_global_id(next_local_id(MIN_GLOBAL_ID - 1))


@pytest.mark.parametrize(("node", "process"), [(256, 0), (-1, 0), (0, 64)])
def test_out_of_range_node_or_process_id(node: int, process: int) -> None:
    with pytest.raises(ValueError, match=r"must be in \[0, "):
        SnowflakeGenerator(node_id=node, process_id=process)


def test_derived_node_id_is_stable_and_in_range() -> None:
    assert derive_node_id("host", 8000) == derive_node_id("host", 8000)
    assert 0 <= derive_node_id("host", 8000) < 256
    assert len({derive_node_id("h", p) for p in range(8000, 8100)}) > 50
