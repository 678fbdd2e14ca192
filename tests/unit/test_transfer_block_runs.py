"""Runs of block ids: found the same from a Python list and from its packed bytes."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from trtdisagg.transfer.protocol.fragments import BlockRun, packed_run, run_of
from trtdisagg.transfer.protocol.sessions import SourceBlocks
from trtdisagg.transfer.protocol.wire import pack_block_ids


def _reference(ids: list[int]) -> BlockRun | None:
    if ids and all(b == a + 1 for a, b in itertools.pairwise(ids)):
        return BlockRun(ids[0], len(ids))
    return None


runs = st.builds(
    lambda first, count: list(range(first, first + count)),
    st.integers(-(2**40), 2**40),
    st.integers(1, 300),
)
# Lists that are runs but for one id: what a cheap check of the ends alone would miss.
near_runs = st.builds(
    lambda run, at, by: [i + by if n == at % len(run) else i for n, i in enumerate(run)],
    runs,
    st.integers(0, 299),
    st.integers(-3, 3).filter(bool),
)


@given(st.one_of(runs, near_runs, st.lists(st.integers(-(2**62), 2**62), max_size=40)))
def test_a_list_and_its_packed_bytes_give_the_same_run(ids: list[int]) -> None:
    expected = _reference(ids)
    assert run_of(ids) == expected
    assert run_of(tuple(ids)) == expected
    assert packed_run(pack_block_ids(ids)) == expected


def test_bytes_that_are_not_whole_ids_are_no_run() -> None:
    assert packed_run(pack_block_ids([4, 5, 6])[:-1]) is None
    assert packed_run(b"") is None


def test_the_source_knows_each_groups_run() -> None:
    source = SourceBlocks(block_ids=((7, 8, 9), (3, 1), ()), num_tokens=40)
    assert source.runs == (BlockRun(7, 3), None, None)
    assert source == SourceBlocks(block_ids=((7, 8, 9), (3, 1), ()), num_tokens=40)
