"""Free KV block ids kept as runs of consecutive ids, for the block pool's allocator (pure).

A run of consecutive blocks is one contiguous byte range of the KV pool and one descriptor in a KV
transfer (DESIGN.md §7), so the allocator hands out runs, and this keeps them merged.
"""

from __future__ import annotations


class FreeRuns:
    """Free block ids as maximal runs of consecutive ids, bucketed by run length.

    A run is ``[start, start + length)``. Adjacent runs are always merged, so the number of
    distinct lengths is at most about ``sqrt(2 * num_blocks)``, which bounds a best-fit search.
    """

    def __init__(self, num_blocks: int) -> None:
        self._length_at: dict[int, int] = {}  # start -> length
        self._start_of_end: dict[int, int] = {}  # end (exclusive) -> start
        self._starts_by_length: dict[int, set[int]] = {}
        self._count = 0
        if num_blocks > 0:
            self._insert(0, num_blocks)
            self._count = num_blocks

    def __len__(self) -> int:
        return self._count

    def runs(self) -> list[tuple[int, int]]:
        """(start, length) of every run, by start; for tests and invariant checks."""
        return sorted(self._length_at.items())

    def add(self, block: int) -> None:
        """Return one block (not currently free) to the free runs, merging with its neighbours."""
        start, length = block, 1
        left = self._start_of_end.get(block)
        if left is not None:
            length += self._remove(left)
            start = left
        if block + 1 in self._length_at:
            length += self._remove(block + 1)
        self._insert(start, length)
        self._count += 1

    def take_at(self, start: int, n: int) -> list[int]:
        """Up to ``n`` blocks from the front of the run starting exactly at ``start``, if any."""
        length = self._length_at.get(start)
        if length is None:
            return []
        k = min(n, length)
        self._remove(start)
        if length > k:
            self._insert(start + k, length - k)
        self._count -= k
        return list(range(start, start + k))

    def take(self, n: int) -> list[int]:
        """``n`` blocks (``n <= len(self)``) in as few runs as possible, lowest ids on ties."""
        taken: list[int] = []
        while len(taken) < n:
            need = n - len(taken)
            fitting = [length for length in self._starts_by_length if length >= need]
            length = min(fitting) if fitting else max(self._starts_by_length)
            taken += self.take_at(min(self._starts_by_length[length]), need)
        return taken

    def _insert(self, start: int, length: int) -> None:
        self._length_at[start] = length
        self._start_of_end[start + length] = start
        self._starts_by_length.setdefault(length, set()).add(start)

    def _remove(self, start: int) -> int:
        length = self._length_at.pop(start)
        del self._start_of_end[start + length]
        starts = self._starts_by_length[length]
        starts.discard(start)
        if not starts:
            del self._starts_by_length[length]
        return length
