"""When the transceiver polls a write at every scheduling round, and when it sleeps 1 ms."""

from __future__ import annotations

from trtdisagg.transfer.transceiver import SPIN_POLL_S, TIMER_SLACK_S, polls_every_round

MS = 1e-3


def test_a_write_is_polled_every_round_at_first() -> None:
    # Unknown rate (expected == posted): only the first SPIN_POLL_S spins.
    assert polls_every_round(0.0, 0.0, 0.0)
    assert polls_every_round(SPIN_POLL_S - MS / 10, 0.0, 0.0)
    assert not polls_every_round(SPIN_POLL_S, 0.0, 0.0)
    assert not polls_every_round(1.0, 0.0, 0.0)


def test_a_long_write_sleeps_until_near_its_expected_end() -> None:
    posted, expected = 0.0, 20 * MS
    assert polls_every_round(posted, posted, expected)  # its first SPIN_POLL_S, as any write
    assert not polls_every_round(10 * MS, posted, expected)  # mid-way: 1 ms sleeps
    # From the timer's slack before the expected end (a 1 ms sleep can return 1.2 ms late) ...
    assert not polls_every_round(expected - TIMER_SLACK_S - MS / 10, posted, expected)
    assert polls_every_round(expected - TIMER_SLACK_S, posted, expected)
    assert polls_every_round(expected, posted, expected)
    # ... to SPIN_POLL_S after it; a write that late goes back to 1 ms polls.
    assert polls_every_round(expected + SPIN_POLL_S - MS / 10, posted, expected)
    assert not polls_every_round(expected + SPIN_POLL_S, posted, expected)
