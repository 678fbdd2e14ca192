"""The bandwidth floor on ctx's KV writes (worker/slow_writes.py)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, Counter

from trtdisagg.config import CacheTransceiverConfig, ConfigError
from trtdisagg.transfer.runtime.collector import WriteTally
from trtdisagg.worker.slow_writes import JUDGED_BYTES, JUDGED_SECONDS, WARN_EVERY_S, SlowWrites

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def floor(min_gbps: float = 10.0) -> tuple[SlowWrites, Counter, Clock]:
    counter = Counter("kv_slow_writes", "test", registry=CollectorRegistry())
    clock = Clock()
    return SlowWrites(min_gbps=min_gbps, counter=counter, clock=clock), counter, clock


def count(counter: Counter) -> float:
    return counter._value.get()


def test_a_write_under_the_floor_is_counted_and_one_over_it_is_not() -> None:
    slow, counter, _ = floor(10.0)
    slow.observe(64 * MIB, 64 * MIB / 9e9, "gen-a#0")  # 9 GB/s
    assert count(counter) == 1
    slow.observe(64 * MIB, 64 * MIB / 11e9, "gen-a#0")  # 11 GB/s
    assert count(counter) == 1


def test_writes_too_small_or_too_short_to_judge_are_not_counted() -> None:
    slow, counter, _ = floor(10.0)
    slow.observe(JUDGED_BYTES - 1, 1.0, "gen-a#0")  # tiny bytes, however slow
    slow.observe(64 * MIB, JUDGED_SECONDS / 2, "gen-a#0")  # far over the floor anyway
    slow.observe(JUDGED_BYTES, JUDGED_SECONDS / 2, "gen-a#0")  # 8 GB/s, but only 0.5 ms
    assert count(counter) == 0
    slow.observe(JUDGED_BYTES, JUDGED_SECONDS, "gen-a#0")  # 4 GB/s over 1 ms: judged
    assert count(counter) == 1


def test_one_warning_a_minute_per_gen_instance_with_the_writes_since(
    caplog: pytest.LogCaptureFixture,
) -> None:
    slow, counter, clock = floor(10.0)
    with caplog.at_level(logging.WARNING, logger="trtdisagg.worker.slow_writes"):
        for rank in (0, 1, 0):
            slow.observe(32 * MIB, 0.032, f"gen-a#{rank}")  # ~1 GB/s
        slow.observe(32 * MIB, 0.032, "gen-b#0")
        clock.now += WARN_EVERY_S
        slow.observe(32 * MIB, 0.032, "gen-a#1")
    assert count(counter) == 5
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "gen gen-a " in lines[0] and "to rank 0 at 1.05 GB/s" in lines[0], lines[0]
    assert "kv_transfer_min_gbps (10 GB/s)" in lines[0] and "since" not in lines[0]
    assert "gen gen-b " in lines[1]
    assert "to rank 1" in lines[2] and "2 more slow writes to it since" in lines[2], lines[2]


def test_many_gen_instances_are_remembered_within_a_bound() -> None:
    slow, counter, _ = floor(10.0)
    for i in range(3000):
        slow.observe(8 * MIB, 0.008, f"gen-{i}#0")
    assert count(counter) == 3000
    assert len(slow._warned) <= 1024


def test_the_tally_hands_each_write_to_its_watch() -> None:
    seen: list[tuple[int, float, str]] = []
    tally = WriteTally(watch=lambda *write: seen.append(write))
    tally.count(8 * MIB, 3, 0.5, "gen-a#2")
    assert seen == [(8 * MIB, 0.5, "gen-a#2")]
    assert tally.bytes._value.get() == 8 * MIB


@pytest.mark.parametrize("value", [0, -1.5])
def test_the_floor_must_be_positive(value: float) -> None:
    with pytest.raises(ConfigError, match="kv_transfer_min_gbps: must be positive"):
        CacheTransceiverConfig(kv_transfer_min_gbps=value)
