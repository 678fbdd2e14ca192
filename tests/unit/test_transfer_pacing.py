"""ctx's per-remote write rates, whether a write is announced before its post, gen's notice spin,
and what each side watches for."""

from __future__ import annotations

import pytest

from trtdisagg.transfer.pacing import (
    ANNOUNCE_AFTER_S,
    NOTICE_SPIN_MAX_S,
    NOTICE_SPIN_S,
    SILENT_WRITE_S,
    WRITE_WATCH_S,
    Watches,
    WriteRates,
    gen_watches,
    notice_spin_s,
)

GB = 10**9


def test_a_rate_is_unknown_until_a_write_is_measured() -> None:
    rates = WriteRates()
    assert rates.expected_s("gen", 1 << 20) is None
    rates.learn("gen", GB, 0.0)  # no time measured: nothing learned
    rates.learn("gen", 0, 1.0)  # nothing moved: nothing learned
    assert rates.expected_s("gen", 1 << 20) is None
    rates.learn("gen", GB, 1.0)
    assert rates.expected_s("gen", GB) == pytest.approx(1.0)
    assert rates.expected_s("other", GB) is None  # per remote


def test_the_rate_is_a_moving_average() -> None:
    rates = WriteRates()
    rates.learn("gen", GB, 1.0)  # 1 GB/s
    rates.learn("gen", 2 * GB, 0.5)  # 4 GB/s: 0.75 * 1 + 0.25 * 4 = 1.75 GB/s
    assert rates.expected_s("gen", 7 * GB) == pytest.approx(4.0)


def test_a_slow_post_is_always_announced_first() -> None:
    rates = WriteRates()
    rates.learn("gen", GB, 1.0)
    assert rates.announce_first("gen", GB, quick=False)


def test_a_quick_post_is_announced_first_unless_its_write_is_long() -> None:
    rates = WriteRates()
    assert rates.announce_first("gen", GB, quick=True)  # unknown time: first
    rates.learn("gen", GB, 1.0)  # 1 GB/s
    short = int(ANNOUNCE_AFTER_S * GB) - 1000
    long = int(ANNOUNCE_AFTER_S * GB) + 1000
    assert rates.announce_first("gen", short, quick=True)
    assert not rates.announce_first("gen", long, quick=True)


def test_gen_spins_a_little_past_twice_ctx_estimate_and_no_longer_than_the_maximum() -> None:
    assert notice_spin_s(0) == NOTICE_SPIN_MAX_S  # no estimate yet
    assert notice_spin_s(1000) == pytest.approx(NOTICE_SPIN_S + 0.002)
    assert notice_spin_s(10**6) == NOTICE_SPIN_MAX_S


def test_a_quick_write_that_gen_watches_for_goes_before_its_announcement() -> None:
    rates = WriteRates()
    assert not rates.announce_first("gen", GB, quick=True, gen_watching=True)  # unknown time
    rates.learn("gen", GB, 1.0)
    assert not rates.announce_first("gen", 1000, quick=True, gen_watching=True)  # short
    assert rates.announce_first("gen", 1000, quick=False, gen_watching=True)  # a slow post


def test_a_write_gen_watches_for_goes_unannounced_only_when_it_should_end_soon() -> None:
    rates = WriteRates()
    assert rates.announce_after("gen", 1000, gen_watching=True)  # no estimate yet
    rates.learn("gen", GB, 1.0)  # 1 GB/s
    short = int(SILENT_WRITE_S * GB) - 1000
    long = int(SILENT_WRITE_S * GB) + 1000
    assert not rates.announce_after("gen", short, gen_watching=True)
    assert rates.announce_after("gen", long, gen_watching=True)  # gen needs the estimate
    assert rates.announce_after("gen", short, gen_watching=False)  # gen may sleep


def test_ctx_counts_on_gen_watching_only_between_a_hop_and_the_end_of_its_watch() -> None:
    told = 100.0
    assert not gen_watches(told + 1.0, None)  # never told
    assert not gen_watches(told, told)  # the message may not have arrived
    assert gen_watches(told + ANNOUNCE_AFTER_S, told)
    assert gen_watches(told + WRITE_WATCH_S / 2, told)
    assert not gen_watches(told + WRITE_WATCH_S - ANNOUNCE_AFTER_S, told)  # about to give up


def test_a_watch_runs_until_its_deadline_or_until_forgotten() -> None:
    watches = Watches()
    assert not watches.active(0.0)
    watches.watch(("request", 1), 1.0)
    watches.watch(("write", 2), 2.0)
    watches.watch(("write", 2), 1.5)  # a later watch never shortens an earlier one
    assert watches.count(0.5) == 2
    assert watches.count(1.0) == 1  # the request's watch ran out
    watches.forget(("write", 2))
    watches.forget(("write", 3))  # not watched: nothing happens
    assert not watches.active(1.2)
