"""The KV event log: a drain and any number of cursors read the same events independently."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trtdisagg.kv.event_log import KvEvent, KvEventKind, KvEventLog


def fill(log: KvEventLog, count: int) -> None:
    for i in range(count):
        log.append(KvEventKind.STORED, (i,), None)


def ids(events: list[KvEvent]) -> list[int]:
    return [e.event_id for e in events]


def test_cursors_and_a_drain_each_read_every_event() -> None:
    log = KvEventLog(capacity=8)
    fill(log, 3)
    assert ids(log.after(-1)) == [0, 1, 2]
    assert ids(log.drain()) == [0, 1, 2]
    assert ids(log.after(-1)) == [0, 1, 2]  # the drain took nothing from a cursor
    assert ids(log.after(0)) == [1, 2]
    assert log.after(2) == [] and log.drain() == []
    fill(log, 2)
    assert ids(log.after(2)) == [3, 4] and ids(log.drain()) == [3, 4]
    assert log.num_dropped == 0


def test_a_cursor_that_fell_behind_sees_the_gap_and_a_stale_one_sees_every_event() -> None:
    log = KvEventLog(capacity=3)
    fill(log, 6)
    assert ids(log.after(0)) == [3, 4, 5]  # starts past 0 + 1: events were missed
    assert ids(log.after(9)) == [3, 4, 5]  # a cursor from a previous run of the worker
    assert ids(log.after(5)) == []


def test_a_drain_counts_the_events_it_never_got() -> None:
    log = KvEventLog(capacity=2)
    fill(log, 5)
    assert ids(log.drain()) == [3, 4]
    assert log.num_dropped == 3
    fill(log, 2)  # ids 5 and 6 push out 3 and 4, which the drain had
    assert log.num_dropped == 3
    assert ids(log.drain()) == [5, 6]


def test_the_capacity_is_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        KvEventLog(capacity=0)


@given(
    capacity=st.integers(1, 6),
    script=st.lists(st.tuples(st.sampled_from(["append", "drain", "a", "b"]), st.integers(1, 4))),
)
def test_readers_get_each_event_once_in_order_or_see_a_gap(
    capacity: int, script: list[tuple[str, int]]
) -> None:
    log = KvEventLog(capacity=capacity)
    cursors = {"a": -1, "b": -1}
    seen: dict[str, list[int]] = {"a": [], "b": [], "drain": []}
    appended = 0
    for action, count in script:
        if action == "append":
            fill(log, count)
            appended += count
            continue
        got = ids(log.drain() if action == "drain" else log.after(cursors[action]))
        if got:
            assert got == list(range(got[0], got[0] + len(got)))  # consecutive
        if got and seen[action]:
            assert got[0] > seen[action][-1]  # never an event twice
        seen[action] += got
        if action in cursors and got:
            cursors[action] = got[-1]
    for events in seen.values():
        assert events == sorted(set(events))
        assert all(0 <= e < appended for e in events)
    # What a drain never got was dropped, and is counted.
    assert log.num_dropped == appended - len(seen["drain"]) - len(log.drain())
