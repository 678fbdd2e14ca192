"""cpu_affinity: each rank's slice of the CPUs listed, and where an engine's fronts run."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from trtdisagg import cpu_affinity
from trtdisagg.cpu_affinity import format_cpu_list, parse_cpu_list, rank_share


@pytest.mark.parametrize(
    ("cpus", "world", "shares"),
    [
        ((4,), 1, [(4,)]),
        ((0, 1, 2, 3), 2, [(0, 1), (2, 3)]),
        ((0, 1, 2), 2, [(0,), (1, 2)]),
        ((0, 1, 2, 3, 4, 5, 6, 7), 4, [(0, 1), (2, 3), (4, 5), (6, 7)]),
        ((8, 9), 2, [(8,), (9,)]),
    ],
)
def test_each_rank_takes_its_own_slice(
    cpus: tuple[int, ...], world: int, shares: list[tuple[int, ...]]
) -> None:
    assert [rank_share(cpus, rank, world) for rank in range(world)] == shares


@given(st.sets(st.integers(0, 300), min_size=1, max_size=64), st.integers(1, 8))
def test_the_slices_cover_every_cpu_once_and_none_is_empty(cpus: set[int], world: int) -> None:
    assume(len(cpus) >= world)  # config validation refuses fewer CPUs than ranks
    ordered = tuple(sorted(cpus))
    shares = [rank_share(ordered, rank, world) for rank in range(world)]
    assert all(shares)
    assert [cpu for share in shares for cpu in share] == list(ordered)


@given(st.sets(st.integers(0, 5000), min_size=1, max_size=80))
def test_the_kernel_s_cpu_list_text_reads_back(cpus: set[int]) -> None:
    assert parse_cpu_list(format_cpu_list(cpus)) == tuple(sorted(cpus))


def test_cpu_list_text_joins_runs() -> None:
    assert format_cpu_list([8, 0, 1, 2, 3, 10]) == "0-3,8,10"


def test_fronts_run_off_the_engine_s_cpus_or_anywhere_if_none_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_affinity, "_unpinned", None)
    assert cpu_affinity.front_cpus((1,)) is None  # the engine never pinned: fronts as spawned
    monkeypatch.setattr(cpu_affinity, "_unpinned", frozenset({0, 1, 2, 3}))
    assert cpu_affinity.front_cpus((1, 2)) == {0, 3}
    assert cpu_affinity.front_cpus((0, 1, 2, 3)) == {0, 1, 2, 3}
