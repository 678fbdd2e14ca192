"""The `cpu_affinity` key: which CPUs a worker's engine runs on.

A CPU worker's step thread and its event loop take turns holding the GIL (every torch op lets
go of it), so a small step hands the GIL between the two threads many times. Between two cores
each hand-over wakes a sleeping core; on one core it is a context switch. Pinning the engine
process to a core therefore speeds small steps up (docs/BENCHMARKS.md, "CPU serving"), as it
does the hops of a KV transfer between the notification pump and the loop ("KV transfer", "On
CPU"), and keeps workers that share a machine off each other's cores.

The list is parsed from YAML (a list of ints, or the kernel's cpu-list text, "0-3,8") and from
the CLI (the text). Rank r of an instance of W ranks takes the r-th of W equal slices of it; an
instance's API fronts run on the CPUs its engine left free (all of them, if it left none).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NewType

log = logging.getLogger(__name__)

CpuList = NewType("CpuList", tuple[int, ...])
MAX_CPUS = 1 << 16  # ids at or past this are typos (Linux builds for at most 8192 CPUs)

_unpinned: frozenset[int] | None = None  # this process's CPUs before `pin_process`, if it ran


class CpuAffinityError(ValueError):
    """A cpu_affinity value that cannot be parsed or is not available here."""


def parse_cpu_list(value: object) -> CpuList:
    """`[0, 2]`, `"0-3,8"` or `3` as a sorted tuple of distinct CPU ids."""
    if isinstance(value, bool):
        raise CpuAffinityError(f"expected CPU ids, got {value!r}")
    if isinstance(value, int):
        items: Iterable[object] = (value,)
    elif isinstance(value, str):
        items = _expand_ranges(value)
    elif isinstance(value, list | tuple):
        items = value
    else:
        raise CpuAffinityError(f"expected a list of CPU ids or text like '0-3,8', got {value!r}")
    cpus: list[int] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < MAX_CPUS:
            raise CpuAffinityError(f"CPU ids are integers in [0, {MAX_CPUS}), got {item!r}")
        cpus.append(item)
    if not cpus:
        raise CpuAffinityError("lists no CPU (leave the key out to run anywhere)")
    if len(set(cpus)) != len(cpus):
        raise CpuAffinityError(f"lists a CPU twice: {value!r}")
    return CpuList(tuple(sorted(cpus)))


def _expand_ranges(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise CpuAffinityError(f"not a CPU list like '0-3,8': {text!r}")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise CpuAffinityError(f"range {part!r} runs backwards")
        if high >= MAX_CPUS:
            raise CpuAffinityError(f"CPU ids are below {MAX_CPUS}, got {high} in {text!r}")
        cpus.extend(range(low, high + 1))
    return cpus


def rank_share(cpus: Sequence[int], rank: int, world_size: int) -> tuple[int, ...]:
    """Rank `rank`'s slice of `cpus` (at least one CPU each: config validation checks it)."""
    n = len(cpus)
    return tuple(cpus[rank * n // world_size : (rank + 1) * n // world_size])


def check_available(cpus: Sequence[int]) -> None:
    """Raise CpuAffinityError naming any of `cpus` this process may not run on now (call it
    before pinning: a rank spawned by a pinned rank 0 inherits rank 0's slice)."""
    if not hasattr(os, "sched_setaffinity"):
        raise CpuAffinityError("CPU affinity is not supported on this platform")
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise CpuAffinityError(
            f"CPU {', '.join(map(str, missing))} not available to this process "
            f"(it may use {format_cpu_list(allowed)})"
        )


def pin_process(cpus: Sequence[int], *, threads: int = 1) -> None:
    """Run every thread of this process (and the threads and processes it starts later) on
    `cpus` (`check_available` first)."""
    global _unpinned
    if _unpinned is None:
        _unpinned = frozenset(os.sched_getaffinity(0))
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue  # that thread has ended
    if threads > len(cpus):
        log.warning(
            "cpu_threads %d on %d pinned CPU(s): torch's threads will share cores", threads,
            len(cpus),
        )  # fmt: skip
    log.info("engine pinned to CPU %s", format_cpu_list(cpus))


def pin_engine(cpus: Sequence[int], world_size: int, *, threads: int = 1) -> None:
    """Rank 0's process (or an offline engine's): check every rank's CPUs, then pin this
    process to rank 0's slice. Raises CpuAffinityError before pinning anything."""
    check_available(cpus)  # every rank's: the others are spawned from this process, pinned
    pin_process(rank_share(cpus, 0, world_size), threads=threads)


def front_cpus(engine: Sequence[int]) -> frozenset[int] | None:
    """Where an API front of an engine pinned to `engine` runs: the CPUs the engine's process
    could use before it was pinned, less the engine's own (all of them, if none are left).
    None: the engine is not pinned, the front runs where it was started."""
    if _unpinned is None:
        return None
    return (_unpinned - set(engine)) or _unpinned


def format_cpu_list(cpus: Iterable[int]) -> str:
    """Sorted ids as the kernel writes them: "0-3,8"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _thread_ids() -> list[int]:
    try:
        return [int(entry.name) for entry in Path("/proc/self/task").iterdir()]
    except OSError:
        return [0]  # no procfs: the calling thread only (others start after it, and inherit)
