"""How much slower gen's hand-over runs after the process spun on other code for a while, and
how much of that the rehearsal (trtdisagg/transfer/rehearsal.py) wins back.

The hand-over measured is one twin transfer (`HandoverRehearsal.run`: a WRITE_NOTICE decoded,
noticed, ended and checked through gen's receiver code). It runs after `--idle-ms` of spinning on
the clock, as gen spins while ctx's last prefill step runs:

- cold: nothing else ran meanwhile;
- rehearsed: a second twin ran the same hand-over every REHEARSE_EVERY_S meanwhile (what gen does);
- warm: right after another run of it (the floor).

Prints p50/p90 per case in microseconds and the ratio cold / rehearsed. No device needed.

    python tools/cold_path.py [--idle-ms 10] [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from tests.rank_infos import make_instance
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.rehearsal import REHEARSE_EVERY_S, HandoverRehearsal

clock = time.perf_counter


def _local() -> RankInfo:
    """A gen rank's RankInfo (no pool behind it: the hand-over touches no KV)."""
    (info,) = make_instance(
        instance_name="gen", tp_size=1, pp_size=1, layer_num_per_pp=(2,), num_kv_heads=2,
        head_dim=8, tokens_per_block=4, num_slots=8, base_address=lambda rank: 1 << 20,
    )  # fmt: skip
    return info


def _twin() -> HandoverRehearsal:
    return HandoverRehearsal.of(_local(), timeout_s=30, clock=clock)


def _spin(seconds: float, rehearse: Callable[[float], None] | None) -> None:
    until = clock() + seconds
    due = 0.0
    while (now := clock()) < until:
        if rehearse is not None and now >= due:
            rehearse(now)
            due = now + REHEARSE_EVERY_S


def measure(idle_s: float, rounds: int) -> dict[str, list[float]]:
    real, rehearsal = _twin(), _twin()
    times: dict[str, list[float]] = {"cold": [], "rehearsed": [], "warm": []}
    for _ in range(rounds):
        for case in ("cold", "rehearsed"):
            _spin(idle_s, rehearsal.run if case == "rehearsed" else None)
            start = clock()
            real.run(start)
            times[case].append(clock() - start)
        start = clock()
        real.run(start)
        times["warm"].append(clock() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-ms", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    times = measure(args.idle_ms / 1e3, args.rounds)
    p50 = {case: statistics.median(seconds) * 1e6 for case, seconds in times.items()}
    for case, seconds in times.items():
        p90 = statistics.quantiles(seconds, n=10)[-1] * 1e6
        print(f"{case:10} p50 {p50[case]:7.1f} us  p90 {p90:7.1f} us")
    print(f"cold_over_rehearsed={p50['cold'] / p50['rehearsed']:.2f}")


if __name__ == "__main__":
    main()
