"""When a transfer is watched at every scheduling round, and when a write is announced. Pure.

Trio's timers are millisecond-grained: a 1 ms sleep returns up to ~1.2 ms later, and a loop
asleep in epoll takes 0.1-0.3 ms to wake for a message on a virtual machine. The transceiver
therefore spins (yields at every round) only where an event is due: ctx around a write's start
and its expected end (`polls_every_round`), gen a little past ctx's estimate of a write it was
told of (`notice_spin_s`). ctx learns how fast its writes to each remote go (`WriteRates`), which
sets both those estimates and whether WRITE_POSTED goes before or after the post.

A side that expects its peer's next move within milliseconds watches for it (`Watches`), but
only while its executor runs no step (the step's thread would share the interpreter with a
spinning loop, and a request waits for the step to end anyway): ctx from its response until
gen's REQUEST_DATA (context_first), gen from ctx's WRITE_PREPARED until the write's notification
(generation_first: the write waits only for the prefill step running at ctx).
"""

from __future__ import annotations

from collections.abc import Hashable

import attrs

SPIN_POLL_S = 0.002
# gen, after WRITE_POSTED: drain notifications at every round for this long past twice ctx's
# estimate of the write (or the maximum when ctx has no estimate yet).
NOTICE_SPIN_S = 0.002
NOTICE_SPIN_MAX_S = 0.05
# ctx: a quick write expected to take at least this long is announced (WRITE_POSTED) after its
# post, a shorter one before it. About a ZMQ hop between two local processes (0.25-0.45 ms on the
# device); on 2 x H200, announcing 256 MiB on one GPU (0.25 ms) after the post cost 0.2 ms.
ANNOUNCE_AFTER_S = 0.0005
# ctx, after responding: watch this long for gen's REQUEST_DATA (the coordinator's hop to gen
# and gen's admission take a few ms).
REQUEST_WATCH_S = 0.05
# gen, told that ctx prepared its write (WRITE_PREPARED): watch this long for the notification.
# It covers the last prefill step of a prompt of a few thousand tokens (16-60 ms for an 8B model
# on an H200), after which the write goes at once.
WRITE_WATCH_S = 0.1
# A 1 ms Trio sleep returns up to ~1.2 ms later (epoll's millisecond timeout, rounded up): a long
# write is polled at every round from this long before its expected end.
TIMER_SLACK_S = 0.0015
# ctx: a write that gen watches for and that should end within this long goes unannounced
# (`WriteRates.announce_after`); gen drains at every round for SPIN_POLL_S after its request.
SILENT_WRITE_S = 0.001
# ctx, having just posted a write expected to end within DONE_SPIN_MAX_S: poll it without
# yielding until it ends, or until DONE_SPIN_SLACK_S past its expected end. NIXL sends a
# write's notification from the poll that finds it done, so gen hears of it only then; on one
# H200 the post call itself returns 0.03-0.05 ms before a 256 MiB write ends, and the loop's
# next round came 0.05-0.09 ms after that.
DONE_SPIN_MAX_S = 0.0003
DONE_SPIN_SLACK_S = 0.00005
# A side that spins while watching drains its notifications for up to this long between two
# rounds of its loop (which then waits no longer than this for anything else).
DRAIN_BURST_S = 0.0001


def spins_for_done(now: float, posted: float, expected: float) -> float | None:
    """How long to spin for the end of a write posted at `posted` and expected to end at
    `expected` (`expected == posted`: its peer's rate is not known yet), from `now`; None: not
    at all (unknown, or too far off)."""
    if expected <= posted:
        return None
    until = expected + DONE_SPIN_SLACK_S
    return until if until - now <= DONE_SPIN_MAX_S else None


def polls_every_round(now: float, posted: float, expected: float) -> bool:
    """Whether a write posted at `posted`, expected to end at `expected`, is polled at every
    scheduling round now (else after a 1 ms sleep): during its first SPIN_POLL_S, when a short
    write usually ends, and around its expected end. Trio's timers are millisecond-grained, so
    only this catches the end promptly; the sleeps in between keep a long write from spinning a
    core throughout."""
    near_end = expected - TIMER_SLACK_S <= now < expected + SPIN_POLL_S
    return now < posted + SPIN_POLL_S or near_end


def notice_spin_s(expected_us: int) -> float:
    """gen, told of a write (WRITE_POSTED) that ctx expects to take `expected_us` (0: no
    estimate yet): how long to drain notifications at every scheduling round from now."""
    spin = min(NOTICE_SPIN_MAX_S, NOTICE_SPIN_S + 2 * expected_us * 1e-6)
    if not expected_us:
        spin = NOTICE_SPIN_MAX_S
    return spin


@attrs.define(eq=False)
class WriteRates:
    """ctx: how fast writes to each remote go (bytes/s, a moving average)."""

    _rates: dict[str, float] = attrs.Factory(dict)

    def expected_s(self, remote: str, num_bytes: int) -> float | None:
        """How long a write of `num_bytes` to `remote` should take; None while unknown."""
        rate = self._rates.get(remote)
        return num_bytes / rate if rate else None

    def announce_first(
        self, remote: str, num_bytes: int, *, quick: bool, gen_watching: bool = False
    ) -> bool:
        """Whether WRITE_POSTED goes before the post rather than after it. Before a slow post,
        which may copy a host pool's bytes inside the call; before a quick one when the write
        is expected to end within a message hop (or its time is unknown yet), else the message
        would land after the notification and wake gen late. A longer write is better off with
        its bytes moving first, and so is any quick write that gen watches for (its
        notification says what WRITE_POSTED says, and gen drains it at once)."""
        if not quick:
            return True
        if gen_watching:
            return False
        expected = self.expected_s(remote, num_bytes)
        return expected is None or expected < ANNOUNCE_AFTER_S

    def announce_after(self, remote: str, num_bytes: int, *, gen_watching: bool) -> bool:
        """Whether WRITE_POSTED follows a quick write posted without it. Not when gen watches
        for the write and it should end within SILENT_WRITE_S: its notification says all that
        WRITE_POSTED says, and the message, landing about when the bytes do, would only take
        gen's loop away from handing the outcome over (0.05-0.15 ms on the device). A longer
        write is announced: gen then keeps draining until a little past its expected end."""
        if not gen_watching:
            return True
        expected = self.expected_s(remote, num_bytes)
        return expected is None or expected >= SILENT_WRITE_S

    def learn(self, remote: str, num_bytes: int, seconds: float) -> None:
        """Track how fast writes to `remote` go (bytes/s, a moving average), so that the next
        one is polled at every round only near its expected end. The measured time is at most
        one slow poll late, which the next estimate then corrects (TIMER_SLACK_S covers it)."""
        if seconds <= 0 or num_bytes <= 0:
            return
        rate = num_bytes / seconds
        old = self._rates.get(remote)
        self._rates[remote] = rate if old is None else 0.75 * old + 0.25 * rate


def gen_watches(now: float, told_at: float | None) -> bool:
    """ctx: whether gen, told at `told_at` that a write is coming (WRITE_PREPARED), watches for
    its notification now: the message has had a hop's time to arrive, and gen's watch has not
    run out. (gen watches only while its executor is idle, which ctx cannot know.)"""
    if told_at is None:
        return False
    return told_at + ANNOUNCE_AFTER_S <= now < told_at + WRITE_WATCH_S - ANNOUNCE_AFTER_S


@attrs.define
class Watches:
    """What this side watches for, each until a deadline."""

    _until: dict[Hashable, float] = attrs.field(factory=dict)

    def watch(self, what: Hashable, until: float) -> None:
        self._until[what] = max(until, self._until.get(what, until))

    def forget(self, what: Hashable) -> None:
        self._until.pop(what, None)

    def active(self, now: float) -> bool:
        """Whether anything is watched now; forgets what ran out."""
        return self.count(now) > 0

    def count(self, now: float) -> int:
        """How many things are watched now; forgets what ran out."""
        if self._until:
            for what in [w for w, until in self._until.items() if until <= now]:
                del self._until[what]
        return len(self._until)
