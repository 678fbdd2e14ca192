"""Fragments: the contiguous writes of one transfer, as one `[n, 3]` int64 array; block runs. Pure.

Mappers produce `Fragments`; agents consume them. A head-mismatched transfer of a long prompt is
10^5 to 10^7 fragments, so they stay one numpy array (`rows`: src_addr, dst_addr, size) end to
end.

A pool that is not fragmented hands a prompt consecutive blocks on both sides, and its
homogeneous transfer is then one fragment (mappers.py). Checking that id by id is linear in the
prompt and sits between gen's REQUEST_DATA and the post, so gen's packed list is checked in C
(`packed_run`), and ctx's own list once, when its KV is ready (`sessions.SourceBlocks.runs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

# [n, 3] int64 rows of (source, destination, size): addresses, or offsets inside one block.
Runs = npt.NDArray[np.int64]


def empty_runs() -> Runs:
    return np.zeros((0, 3), dtype=np.int64)


class Fragments:
    """The contiguous writes of one transfer: `rows` (`[n, 3]` int64, read-only)."""

    __slots__ = ("_num_bytes", "rows")

    def __init__(self, rows: Runs) -> None:
        if rows.ndim != 2 or rows.shape[1] != 3:
            raise ValueError(f"fragment rows must be [n, 3], got {rows.shape}")
        self.rows = rows.astype(np.int64, copy=False)
        self.rows.flags.writeable = False
        self._num_bytes: int | None = None

    @classmethod
    def one(cls, src_addr: int, dst_addr: int, size: int) -> Fragments:
        """A single fragment, made with as few numpy calls as can be (a write's path)."""
        fragments = cls.__new__(cls)
        fragments.rows = np.array([(src_addr, dst_addr, size)], dtype=np.int64)
        fragments.rows.flags.writeable = False
        fragments._num_bytes = size
        return fragments

    @property
    def num_bytes(self) -> int:
        # Summed once: a write's path asks several times, each sum costing microseconds.
        if self._num_bytes is None:
            self._num_bytes = int(self.rows[:, 2].sum())
        return self._num_bytes

    def __len__(self) -> int:
        return len(self.rows)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Fragments):
            return NotImplemented
        return bool(np.array_equal(self.rows, other.rows))

    def __repr__(self) -> str:
        return f"Fragments({len(self)} fragments, {self.num_bytes} bytes)"


def merge_runs(runs: Runs) -> Runs:
    """Sort rows by source and join rows contiguous on BOTH sides into one."""
    if len(runs) <= 1:
        return runs
    runs = runs[np.argsort(runs[:, 0], kind="stable")]
    src, dst, size = runs[:, 0], runs[:, 1], runs[:, 2]
    continues = (src[:-1] + size[:-1] == src[1:]) & (dst[:-1] + size[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return np.stack([src[starts], dst[starts], np.add.reduceat(size, starts)], axis=1)


@attrs.frozen
class BlockRun:
    """Block ids `first, first + 1, ..., first + count - 1`."""

    first: int
    count: int


def run_of(ids: Sequence[int]) -> BlockRun | None:
    """The run `ids` form, or None (empty, or not ascending by one)."""
    return packed_run(np.asarray(ids, dtype="<i8").tobytes())


def packed_run(data: bytes) -> BlockRun | None:
    """`run_of` for ids packed as little-endian int64 (`wire.pack_block_ids`), compared in C."""
    count, odd = divmod(len(data), 8)
    if not count or odd:
        return None
    first = int.from_bytes(data[:8], "little", signed=True)
    if int.from_bytes(data[-8:], "little", signed=True) != first + count - 1:
        return None  # most lists that are not a run end elsewhere: no need to look further
    if data != np.arange(first, first + count, dtype="<i8").tobytes():
        return None
    return BlockRun(first, count)
