"""The KV block pool: which request holds which block, and the prefix cache over them.

A rank's KV memory is ``num_blocks`` blocks of ``tokens_per_block`` tokens. Each block is in
exactly one of three sets:

1. FREE: holds nothing worth keeping (never written, or its cached content was evicted).
2. USED: referenced by at least one live ``BlockTable``. A block of a shared cached prefix, or of
   a forked table (a request's ``n`` choices), has one reference per table that holds it.
3. REUSABLE: no references, but it holds a full, computed block registered in the prefix cache
   under its chained hash (see ``hashing``). A new request with the same prefix takes it back
   (USED again); allocation evicts these, least recently used first, when FREE runs out.

Invariant: ``free + reusable + used == total`` at all times; with no live tables, ``used == 0``.

Free blocks are kept as runs of consecutive block ids, and allocation hands out runs: first the
run right after the table's last block (so a growing request stays contiguous), then the smallest
run that fits, then the largest runs first. A run of consecutive blocks is one contiguous byte
range of the KV pool and one descriptor in a KV transfer (DESIGN.md §7), which matters more for
transfer speed than anything else.

A fork (``fork``) shares every block of a table with a new one; a shared block is copied on
write: before a table writes tokens into blocks it shares, ``unshare`` swaps them for new blocks
and says which KV to copy (``BlockCopy``), so that two sequences never write the same block. Only
a fork's last, partly filled block is ever copied: full blocks are never written again.

With ``enable_block_reuse``, the pool records a KV event for every change to the set of cached
hashes (STORED when a block is registered, REMOVED when one is evicted), for the KV-aware router.

Pure: no I/O, no torch. The executor owns the pool and is its only caller.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Final

import attrs

from trtdisagg.kv.event_log import KvEvent, KvEventKind, KvEventLog
from trtdisagg.kv.free_runs import FreeRuns
from trtdisagg.kv.hashing import hash_block

__all__ = ["BlockPool", "BlockTable", "KvEvent", "KvEventKind"]

DEFAULT_MAX_PENDING_EVENTS: Final = 65536


@attrs.frozen(kw_only=True)
class BlockPoolStatistics:
    total_blocks: int
    free_blocks: int  # never cached, or evicted
    reusable_blocks: int  # cached prefix blocks with no references: evictable, LRU
    used_blocks: int  # referenced by at least one live table
    num_dropped_events: int = 0  # KV events discarded because nobody drained them


@attrs.frozen(kw_only=True)
class BlockCopy:
    """Copy block `src`'s KV into block `dst` before the step that writes `dst` (a fork's
    copy-on-write: `BlockPool.unshare`)."""

    src: int
    dst: int


@attrs.define(eq=False, kw_only=True)
class BlockTable:
    """The blocks of one request, in token order. Created by ``BlockPool.open_table`` only.

    ``block_ids[i]`` holds tokens ``[i * T, (i + 1) * T)``. The first ``num_cached_tokens // T``
    blocks were taken from the prefix cache when the table was opened.
    """

    block_ids: list[int] = attrs.field(factory=list)
    num_cached_tokens: int = 0
    # Chained hashes of the leading blocks that are full and computed; commit() extends it.
    _hashes: list[int] = attrs.field(factory=list, alias="hashes")
    _root: int | None = attrs.field(default=None, alias="root")  # its chain's (`salt_root`)
    _num_committed_blocks: int = attrs.field(default=0, alias="num_committed_blocks")
    _released: bool = attrs.field(default=False, alias="released")

    @property
    def num_committed_blocks(self) -> int:
        """Leading blocks that are full and computed (hashed if reuse is on)."""
        return self._num_committed_blocks

    @property
    def is_released(self) -> bool:
        return self._released


class BlockPool:
    """Allocator, reference counts and prefix cache over one rank's KV blocks.

    Args:
        num_blocks: blocks in the pool.
        tokens_per_block: tokens per block.
        enable_block_reuse: keep computed full blocks as a prefix cache and emit KV events.
        max_pending_events: KV events kept (`event_log.KvEventLog`); older ones are dropped, and
            counted when no drain returned them, so that a worker nobody polls does not grow
            without bound.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        tokens_per_block: int,
        enable_block_reuse: bool,
        max_pending_events: int = DEFAULT_MAX_PENDING_EVENTS,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
        self._num_blocks = num_blocks
        self._tokens_per_block = tokens_per_block
        self._reuse = enable_block_reuse
        self._free = FreeRuns(num_blocks)
        self._ref_counts = [0] * num_blocks
        # The hash a block is registered under in the prefix cache (None: not cached).
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # hash -> the one canonical block holding it
        self._reusable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._num_used = 0
        self._events = KvEventLog(max_pending_events)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def tokens_per_block(self) -> int:
        return self._tokens_per_block

    @property
    def enable_block_reuse(self) -> bool:
        return self._reuse

    @property
    def num_available_blocks(self) -> int:
        """Blocks a table could still grow into: free ones plus evictable cached ones."""
        return len(self._free) + len(self._reusable)

    def statistics(self) -> BlockPoolStatistics:
        return BlockPoolStatistics(
            total_blocks=self._num_blocks,
            free_blocks=len(self._free),
            reusable_blocks=len(self._reusable),
            used_blocks=self._num_used,
            num_dropped_events=self._events.num_dropped,
        )

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self._tokens_per_block)

    # ---- prefix cache ----

    def lookup_prefix(self, token_ids: Sequence[int], *, root: int | None = None) -> int:
        """How many tokens a new request would reuse from the prefix cache; no side effects.

        Only full blocks count, and never the whole sequence: at least one token is left to
        compute, because its logits give the next token.
        """
        return len(self._match_prefix(token_ids, root)) * self._tokens_per_block

    def open_table(
        self, token_ids: Sequence[int], *, reuse: bool = True, root: int | None = None
    ) -> BlockTable:
        """A new table holding the cached prefix of ``token_ids`` (if ``reuse``); no new blocks.

        Takes one reference on each reused block. Call ``grow`` for the rest, and ``release``
        when done (also when ``grow`` fails).
        """
        matched = self._match_prefix(token_ids, root) if reuse else []
        for _, block in matched:
            self._take_ref(block)
        return BlockTable(
            block_ids=[block for _, block in matched],
            num_cached_tokens=len(matched) * self._tokens_per_block,
            hashes=[h for h, _ in matched],
            root=root,
            num_committed_blocks=len(matched),
        )

    def _match_prefix(self, token_ids: Sequence[int], root: int | None) -> list[tuple[int, int]]:
        """(hash, block) of the leading cached full blocks, stopping at the first miss."""
        if not self._reuse or not self._cached:
            return []
        t = self._tokens_per_block
        matched: list[tuple[int, int]] = []
        parent = root
        for i in range((len(token_ids) - 1) // t):
            parent = hash_block(parent, token_ids[i * t : (i + 1) * t])
            block = self._cached.get(parent)
            if block is None:
                break
            matched.append((parent, block))
        return matched

    # ---- allocation ----

    def can_grow(self, table: BlockTable, num_tokens: int) -> bool:
        """Whether ``grow(table, num_tokens)`` would succeed now."""
        self._check_live(table)
        return self.blocks_for(num_tokens) - len(table.block_ids) <= self.num_available_blocks

    def grow(self, table: BlockTable, num_tokens: int) -> bool:
        """Make ``table`` cover ``num_tokens`` tokens.

        Takes free blocks first (continuing the table's last run when possible), then evicts
        reusable blocks, least recently used first, emitting one REMOVED event.

        Returns:
            True if the table now covers ``num_tokens``; False, with nothing changed, if the
            pool cannot supply the blocks now.
        """
        self._check_live(table)
        needed = self.blocks_for(num_tokens) - len(table.block_ids)
        if needed <= 0:
            return True
        if needed > self.num_available_blocks:
            return False
        after = table.block_ids[-1] if table.block_ids else None
        table.block_ids.extend(self._allocate(needed, after))
        return True

    # ---- forks (copy-on-write) ----

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table holding the same blocks as `table`: a sequence that goes on from the same
        tokens (one of a request's `n` choices). Each block gets one more reference; none is
        copied now. Before either table writes into a block they share, `unshare` gives it a
        private copy, so that the two sequences never write into each other's KV.
        """
        self._check_live(table)
        for block in table.block_ids:
            self._ref_counts[block] += 1  # held by `table`, so used already
        return BlockTable(
            block_ids=list(table.block_ids),
            num_cached_tokens=table.num_cached_tokens,
            hashes=list(table._hashes),
            root=table._root,
            num_committed_blocks=table._num_committed_blocks,
        )

    def unshare(self, table: BlockTable, first_token: int) -> list[BlockCopy] | None:
        """Make the table's blocks that hold tokens from `first_token` on its own, ready to be
        written: each one another table also holds is replaced by a new block.

        Only a fork shares a block that is still written (its last, partly filled one): the
        prefix cache shares full, computed blocks, which nobody writes again.

        Returns:
            The KV copies to make, old block into new, before the step that writes them (empty
            when nothing was shared); None, with nothing changed, when the pool cannot supply
            the new blocks now.
        """
        self._check_live(table)
        first = first_token // self._tokens_per_block
        ids = table.block_ids
        shared = [i for i in range(first, len(ids)) if self._ref_counts[ids[i]] > 1]
        if not shared:
            return []
        if len(shared) > self.num_available_blocks:
            return None
        copies: list[BlockCopy] = []
        for index, new in zip(shared, self._allocate(len(shared), None), strict=True):
            old = table.block_ids[index]
            if index < table._num_committed_blocks:
                raise AssertionError(f"block {old} is computed and full: nobody writes it again")
            self._ref_counts[old] -= 1  # still held by the other tables
            table.block_ids[index] = new
            copies.append(BlockCopy(src=old, dst=new))
        return copies

    def commit(self, table: BlockTable, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the table's blocks that are now full and computed in the prefix cache.

        ``token_ids`` are the request's tokens from its first (prompt, then output); only the
        first ``num_computed_tokens`` count. Idempotent. A block whose hash is already cached in
        another block stays private to this table (it becomes free on release): the cache keeps
        one canonical copy, and this table's block ids never change under a running request.
        """
        self._check_live(table)
        t = self._tokens_per_block
        num_full = min(min(num_computed_tokens, len(token_ids)) // t, len(table.block_ids))
        first = table._num_committed_blocks
        if num_full <= first:
            return
        table._num_committed_blocks = num_full
        if not self._reuse:
            return
        parent = table._hashes[-1] if table._hashes else table._root
        run: list[int] = []  # newly stored hashes that chain onto run_parent
        run_parent = parent
        for i in range(first, num_full):
            h = hash_block(parent, token_ids[i * t : (i + 1) * t])
            table._hashes.append(h)
            block = table.block_ids[i]
            if self._hash_of[block] is not None:
                raise AssertionError(f"block {block} committed twice ({self._hash_of[block]}, {h})")
            if h in self._cached:
                # A STORED event's hashes must chain, so a gap starts a new event.
                self._flush_stored(run, run_parent)
                run = []
            else:
                self._cached[h] = block
                self._hash_of[block] = h
                if not run:
                    run_parent = parent
                run.append(h)
            parent = h
        self._flush_stored(run, run_parent)

    def release(self, table: BlockTable) -> None:
        """Drop the table's references; a second release is a no-op.

        Blocks left without references become reusable if cached, free otherwise. The table's
        last block is queued for eviction first: evicting the head of a cached chain would strand
        the rest, since a lookup stops at the first miss.
        """
        if table._released:
            return
        table._released = True
        for block in reversed(table.block_ids):
            count = self._ref_counts[block] - 1
            if count < 0:
                raise AssertionError(f"block {block} released more often than taken")
            self._ref_counts[block] = count
            if count > 0:
                continue
            self._num_used -= 1
            if self._hash_of[block] is not None:
                self._reusable[block] = None
            else:
                self._free.add(block)
        table.block_ids.clear()

    # ---- events ----

    def drain_events(self) -> list[KvEvent]:
        """KV events since the last drain, oldest first."""
        return self._events.drain()

    def events_after(self, cursor: int) -> list[KvEvent]:
        """KV events after id `cursor`, oldest first, for a reader with a cursor of its own
        (`KvEventLog.after`); drains do not change what it reads."""
        return self._events.after(cursor)

    # ---- checks ----

    def check_invariants(self, tables: Sequence[BlockTable] = ()) -> None:
        """Recount every block's set, O(num_blocks); for tests.

        With ``tables`` (every live table), also check that the reference counts match them.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        free = {b for start, n in self._free.runs() for b in range(start, start + n)}
        reusable = set(self._reusable)
        used = {b for b, count in enumerate(self._ref_counts) if count > 0}
        _check(len(free) == len(self._free), f"free count {len(self._free)} != {len(free)}")
        _check(len(used) == self._num_used, f"used count {self._num_used} != {len(used)}")
        _check(not free & reusable, f"free and reusable: {sorted(free & reusable)}")
        _check(not free & used, f"free and used: {sorted(free & used)}")
        _check(not reusable & used, f"reusable and used: {sorted(reusable & used)}")
        _check(
            len(free) + len(reusable) + len(used) == self._num_blocks,
            f"{len(free)} free + {len(reusable)} reusable + {len(used)} used "
            f"!= {self._num_blocks} total",
        )
        for block in reusable:
            _check(self._hash_of[block] is not None, f"reusable block {block} has no hash")
        for block in free:
            _check(self._hash_of[block] is None, f"free block {block} is still cached")
        for h, block in self._cached.items():
            _check(self._hash_of[block] == h, f"hash {h} maps to block {block} holding another")
        _check(
            len(self._cached) == sum(h is not None for h in self._hash_of),
            "cached hashes and hashed blocks differ",
        )
        if tables:
            refs = collections.Counter(b for t in tables if not t.is_released for b in t.block_ids)
            for block, count in enumerate(self._ref_counts):
                _check(refs[block] == count, f"block {block}: refcount {count}, {refs[block]} refs")

    # ---- internals ----

    def _allocate(self, n: int, after: int | None) -> list[int]:
        """`n` new blocks (n <= num_available_blocks), one reference each: free ones first, from
        the block right after `after` when it is free (a growing table stays one run), then
        reusable ones, least recently used first, with one REMOVED event."""
        new: list[int] = []
        if after is not None:
            new += self._free.take_at(after + 1, n)
        from_free = min(n - len(new), len(self._free))
        if from_free > 0:
            new += self._free.take(from_free)
        evicted: list[int] = []
        while len(new) < n:
            block, _ = self._reusable.popitem(last=False)
            evicted.append(self._uncache(block))
            new.append(block)
        if evicted:
            self._emit(KvEventKind.REMOVED, evicted, None)
        for block in new:
            self._ref_counts[block] = 1
        self._num_used += len(new)
        return new

    def _check_live(self, table: BlockTable) -> None:
        if table._released:
            raise ValueError("block table was already released")

    def _take_ref(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            # A cached block with no references is reusable; taking it makes it used again.
            del self._reusable[block]
            self._num_used += 1
        self._ref_counts[block] += 1

    def _uncache(self, block: int) -> int:
        h = self._hash_of[block]
        if h is None:
            raise AssertionError(f"reusable block {block} has no hash")
        del self._cached[h]
        self._hash_of[block] = None
        return h

    def _flush_stored(self, hashes: list[int], parent: int | None) -> None:
        if hashes:
            self._emit(KvEventKind.STORED, hashes, parent)

    def _emit(self, kind: KvEventKind, hashes: list[int], parent: int | None) -> None:
        self._events.append(kind, tuple(hashes), parent)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
