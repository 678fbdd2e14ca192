"""Request ids: 64-bit snowflake global ids for disaggregated requests, and local ids.

A global id (`disagg_request_id`, DESIGN.md §6) names one request across the coordinator, the ctx
instance and the gen instance, for logs and ordering; two requests in flight never share one.
It is predictable (a clock and a counter), so it is not what addresses the KV transfer: that is a
transfer key (`new_transfer_key`), 64 random bits, which only the coordinator and the request's
ctx and gen know. Layout of a global id, most significant bit first::

    [0 (1) | ms since EPOCH_MS (39) | node_id (8) | process_id (6) | counter (10)]

The raw value is then rotated into ``[MIN_GLOBAL_ID, 2**63 - 1)``, so global ids never collide
with local ids, which live in ``[0, MIN_GLOBAL_ID)``.

Uniqueness rests on three things:

* ``(node_id, process_id)`` differs between every minting process (the fleet gives each front-end
  process its own ``process_id``; ``node_id`` comes from config or from a hash of host and port);
* the millisecond never goes backwards within a generator: it is a wall-clock reading taken once
  at construction, advanced by the monotonic clock, so an NTP step cannot replay a millisecond;
* at most 1024 ids per millisecond: the 1025th **waits** for the next millisecond instead of
  wrapping the counter (TensorRT-LLM wraps, which can collide under load).

Pure and thread-safe: no I/O, one lock per generator. The wait is at most one millisecond and only
happens above 1024 ids/ms, so it is done with a short `time.sleep` even on an event loop.
"""

from __future__ import annotations

import secrets
import threading
import time
import zlib
from collections.abc import Callable
from typing import Final, NewType

import attrs

DisaggRequestId = NewType("DisaggRequestId", int)


def new_transfer_key() -> int:
    """A fresh transfer key (`disaggregated_params.transfer_key`): 64 random bits, never 0."""
    return secrets.randbits(64) or 1


MIN_GLOBAL_ID: Final = 1 << 40
MAX_GLOBAL_ID: Final = (1 << 63) - 1  # exclusive
EPOCH_MS: Final = 1_704_067_200_000  # 2024-01-01T00:00:00Z

TIMESTAMP_BITS: Final = 39
NODE_BITS: Final = 8
PROCESS_BITS: Final = 6
COUNTER_BITS: Final = 10

MAX_NODE_ID: Final = (1 << NODE_BITS) - 1
MAX_PROCESS_ID: Final = (1 << PROCESS_BITS) - 1
MAX_COUNTER: Final = (1 << COUNTER_BITS) - 1
_TIMESTAMP_MASK: Final = (1 << TIMESTAMP_BITS) - 1
_SPAN: Final = MAX_GLOBAL_ID - MIN_GLOBAL_ID


def _monotonic_wall_ms() -> Callable[[], int]:
    """A clock of milliseconds since EPOCH_MS that never goes backwards within this process."""
    wall_ns = time.time_ns()
    mono_ns = time.monotonic_ns()

    def clock() -> int:
        return (wall_ns + time.monotonic_ns() - mono_ns) // 1_000_000 - EPOCH_MS

    return clock


def compose(timestamp_ms: int, node_id: int, process_id: int, counter: int) -> int:
    """The global id of one (millisecond, node, process, counter) tuple. Pure, injective."""
    raw = (
        (timestamp_ms & _TIMESTAMP_MASK) << (NODE_BITS + PROCESS_BITS + COUNTER_BITS)
        | node_id << (PROCESS_BITS + COUNTER_BITS)
        | process_id << COUNTER_BITS
        | counter
    )
    return raw % _SPAN + MIN_GLOBAL_ID


def is_global_id(value: int) -> bool:
    return MIN_GLOBAL_ID <= value < MAX_GLOBAL_ID


def next_local_id(last: int) -> int:
    """The local id after `last`, wrapping inside ``[0, MIN_GLOBAL_ID)``."""
    return (last + 1) & (MIN_GLOBAL_ID - 1)


def derive_node_id(host: str, port: int) -> int:
    """A stable node id for a process that was given none: a hash of where it listens."""
    return zlib.crc32(f"{host}:{port}".encode()) & MAX_NODE_ID


def _check_range(name: str, value: int, top: int) -> None:
    if not 0 <= value <= top:
        raise ValueError(f"{name} must be in [0, {top + 1}), got {value}")


@attrs.define(eq=False, kw_only=True)
class SnowflakeGenerator:
    """Mints global ids for one process. Safe to share between threads.

    Args:
        node_id: ``[0, 256)``; distinct per coordinator node.
        process_id: ``[0, 64)``; distinct per minting process of a node (fleet worker index).
        clock: milliseconds since EPOCH_MS; injected by tests. Default: wall clock at
            construction advanced by the monotonic clock.
        sleep: called while waiting for the next millisecond; injected by tests.
    """

    node_id: int
    process_id: int = 0
    clock: Callable[[], int] = attrs.field(factory=_monotonic_wall_ms)
    sleep: Callable[[float], None] = time.sleep
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _last_ms: int = attrs.field(default=-1, init=False)
    _counter: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        _check_range("node_id", self.node_id, MAX_NODE_ID)
        _check_range("process_id", self.process_id, MAX_PROCESS_ID)

    def next_id(self) -> DisaggRequestId:
        with self._lock:
            now = max(self.clock(), self._last_ms)
            if now == self._last_ms:
                if self._counter == MAX_COUNTER:
                    now = self._wait_next_ms()
                    self._counter = 0
                else:
                    self._counter += 1
            else:
                self._counter = 0
            self._last_ms = now
            return DisaggRequestId(compose(now, self.node_id, self.process_id, self._counter))

    def _wait_next_ms(self) -> int:
        while True:
            now = self.clock()
            if now > self._last_ms:
                return now
            self.sleep(0.0001)
