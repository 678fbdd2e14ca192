"""trtdisagg/ratelimit.py: at most N lines per peer in any window, every suppressed line counted
once, bounded memory whatever the peers are called."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtdisagg.ratelimit import OVERFLOW_PEER, Admission, LogRateLimit, log_limited

# (peer, seconds since the previous event, flush before it?)
_EVENTS = st.lists(
    st.tuples(
        st.integers(0, 5),
        st.one_of(st.just(0.0), st.floats(0, 3, allow_nan=False, allow_infinity=False)),
        st.booleans(),
    ),
    max_size=300,
)


def _run(
    limit: LogRateLimit, events: list[tuple[int, float, bool]]
) -> tuple[dict[Hashable, list[float]], int, int, float]:
    """Drive `limit`; returns admission times by counted key, reported suppressed lines,
    suppressed events and the last time."""
    admitted: dict[Hashable, list[float]] = defaultdict(list)
    reported = suppressed = 0
    now = 0.0
    for peer, step, flush in events:
        now += step
        if flush:
            reported += sum(count for _, count in limit.flush(now))
        admission = limit.admit(peer, now)
        if admission is None:
            suppressed += 1
        else:
            admitted[admission.peer].append(now)
            reported += admission.suppressed
        assert limit.statistics().peers <= limit.max_peers + 1
    return admitted, reported, suppressed, now


@settings(max_examples=300, deadline=None)
@given(
    events=_EVENTS,
    lines=st.integers(1, 4),
    interval=st.floats(0.1, 5, allow_nan=False),
    max_peers=st.integers(1, 8),
)
def test_never_more_than_n_lines_per_window_and_counts_add_up(
    events: list[tuple[int, float, bool]], lines: int, interval: float, max_peers: int
) -> None:
    limit = LogRateLimit(lines=lines, interval_s=interval, max_peers=max_peers)
    admitted, reported, suppressed, now = _run(limit, events)
    for times in admitted.values():
        for first, last in zip(times, times[lines:]):
            assert last - first >= interval  # any lines+1 admitted lines span a full window
    reported += sum(count for _, count in limit.flush(now + 2 * interval))  # the quiet ones
    stats = limit.statistics()
    assert reported == suppressed == stats.suppressed
    assert stats.admitted + stats.suppressed == len(events)
    assert stats.peers == 0  # everything is flushed once a window has passed


@settings(max_examples=300, deadline=None)
@given(events=_EVENTS, lines=st.integers(1, 4), interval=st.floats(0.1, 5, allow_nan=False))
def test_a_line_is_suppressed_only_when_its_peer_already_had_n_in_the_window(
    events: list[tuple[int, float, bool]], lines: int, interval: float
) -> None:
    """Against a reference model (enough room for every peer: no overflow)."""
    limit = LogRateLimit(lines=lines, interval_s=interval, max_peers=16)
    model: dict[int, list[float]] = defaultdict(list)
    now = 0.0
    for peer, step, flush in events:
        now += step
        if flush:
            limit.flush(now)
        recent = [t for t in model[peer] if now - t < interval]
        expected = len(recent) < lines
        assert (limit.admit(peer, now) is not None) == expected
        if expected:
            model[peer].append(now)


def test_the_next_admitted_line_carries_the_suppressed_count() -> None:
    limit = LogRateLimit(lines=2, interval_s=10.0)
    assert limit.admit("a", 0.0) == Admission(peer="a", suppressed=0)
    assert limit.admit("a", 1.0) == Admission(peer="a", suppressed=0)
    assert [limit.admit("a", t) for t in (2.0, 3.0, 9.9)] == [None, None, None]
    assert limit.admit("b", 9.9) == Admission(peer="b", suppressed=0)  # peers are independent
    assert limit.admit("a", 10.0) == Admission(peer="a", suppressed=3)
    assert limit.admit("a", 10.5) is None
    assert limit.flush(11.0) == []  # "a" admitted at 10.0: its window has not passed yet
    assert limit.flush(20.0) == [("a", 1)]
    assert limit.flush(30.0) == []


def test_new_peers_beyond_the_table_share_the_overflow_entry() -> None:
    limit = LogRateLimit(lines=1, interval_s=10.0, max_peers=2)
    assert limit.admit("a", 0.0) == Admission(peer="a", suppressed=0)
    assert limit.admit("b", 0.0) == Admission(peer="b", suppressed=0)
    assert limit.admit("c", 1.0) == Admission(peer=OVERFLOW_PEER, suppressed=0)
    assert limit.admit("d", 2.0) is None  # counted against the overflow entry
    assert limit.statistics().peers == 3
    # "a" and "b" are quiet a window later: a new peer takes a slot of its own again.
    assert limit.admit("e", 12.0) == Admission(peer="e", suppressed=0)
    assert limit.flush(30.0) == [(OVERFLOW_PEER, 1)]


def test_log_limited_logs_within_the_limit_and_then_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("test.ratelimit")
    limit = LogRateLimit(lines=1, interval_s=5.0)
    with caplog.at_level(logging.WARNING, logger="test.ratelimit"):
        logged = [log_limited(logger, limit, "p", t, "bad frame from %s", "p") for t in range(7)]
    assert logged == [True, False, False, False, False, True, False]
    assert [r.getMessage() for r in caplog.records] == [
        "bad frame from p",
        "bad frame from p (4 similar lines suppressed)",
    ]


def test_limits_must_be_positive() -> None:
    for bad in ({"lines": 0}, {"interval_s": 0.0}, {"max_peers": 0}):
        with pytest.raises(ValueError, match="must be positive"):
            LogRateLimit(**{"lines": 1, "interval_s": 1.0, **bad})  # type: ignore[arg-type]
