"""ctx's per-remote write rates, whether a write is announced before its post, gen's notice spin."""

from __future__ import annotations

import pytest

from trtdisagg.transfer.pacing import (
    ANNOUNCE_AFTER_S,
    NOTICE_SPIN_MAX_S,
    NOTICE_SPIN_S,
    WriteRates,
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
