"""Forks of a block table (a request's `n` choices) and their copy-on-write, in the block pool.

The state machine keeps a model of the KV memory (which token each slot of each block holds) and
plays what the engine does: prefill, fork, decode one token (unshare, copy, grow, write, commit),
release. Whatever the order, every sequence reads back its own tokens through its table, no block
is written while another table holds it, and the references return to zero.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trtdisagg.kv.block_pool import BlockCopy, BlockPool, BlockTable

T = 4


def make_pool(num_blocks: int = 16, *, reuse: bool = True) -> BlockPool:
    return BlockPool(num_blocks=num_blocks, tokens_per_block=T, enable_block_reuse=reuse)


def prefilled(pool: BlockPool, tokens: list[int]) -> BlockTable:
    table = pool.open_table(tokens, reuse=False)
    assert pool.grow(table, len(tokens))
    pool.commit(table, tokens, len(tokens))
    return table


def test_fork_shares_every_block_and_copies_only_the_written_one() -> None:
    pool = make_pool()
    parent = prefilled(pool, list(range(10)))  # blocks: full, full, 2 of 4 tokens
    child = pool.fork(parent)
    assert child.block_ids == parent.block_ids
    assert child.num_committed_blocks == parent.num_committed_blocks == 2
    assert pool.statistics().used_blocks == 3
    pool.check_invariants([parent, child])

    copies = pool.unshare(child, 10)  # the child writes token 10: into the shared third block
    assert copies == [BlockCopy(src=parent.block_ids[2], dst=child.block_ids[2])]
    assert child.block_ids[:2] == parent.block_ids[:2] and child.block_ids[2] != parent.block_ids[2]
    assert pool.unshare(parent, 10) == []  # the last holder writes in place
    assert pool.unshare(child, 10) == []
    pool.check_invariants([parent, child])
    pool.release(parent)
    pool.release(child)
    assert pool.statistics().used_blocks == 0
    pool.check_invariants()


def test_fork_at_a_block_boundary_copies_nothing() -> None:
    pool = make_pool()
    parent = prefilled(pool, list(range(8)))
    children = [pool.fork(parent) for _ in range(3)]
    for table in (parent, *children):
        assert pool.unshare(table, 8) == []
        assert pool.grow(table, 9)
    assert len({table.block_ids[2] for table in (parent, *children)}) == 4  # each its own
    pool.check_invariants([parent, *children])


def test_unshare_without_room_changes_nothing() -> None:
    pool = make_pool(3)
    parent = prefilled(pool, list(range(10)))  # every block taken
    child = pool.fork(parent)
    before = list(child.block_ids)
    assert pool.unshare(child, 10) is None
    assert child.block_ids == before
    pool.release(parent)  # now the child alone holds them: nothing to copy
    assert pool.unshare(child, 10) == []
    pool.release(child)
    pool.check_invariants()


def test_unshare_evicts_a_reusable_block_for_the_copy() -> None:
    pool = make_pool(4)
    cached = prefilled(pool, [7] * 4)
    pool.release(cached)  # its block is reusable now, the only one not free
    parent = prefilled(pool, list(range(10)))
    child = pool.fork(parent)
    pool.drain_events()
    assert pool.unshare(child, 10) is not None
    [removed] = pool.drain_events()
    assert removed.kind.value == "removed"
    pool.check_invariants([parent, child])


def test_a_released_table_cannot_fork() -> None:
    pool = make_pool()
    table = prefilled(pool, [1, 2, 3])
    pool.release(table)
    with pytest.raises(ValueError):
        pool.fork(table)


@attrs.define(eq=False)
class Sequence:
    table: BlockTable
    tokens: list[int]  # what it has written into its KV, in order


class ForkMachine(RuleBasedStateMachine):
    """Prefill, fork, decode and release at random over a pool that also caches prefixes."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(10)
        self.live: list[Sequence] = []
        self.kv: dict[tuple[int, int], int] = {}  # (block, slot) -> the token written there

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=3 * T))
    def prefill(self, tokens: list[int]) -> None:
        table = self.pool.open_table(tokens)
        if not self.pool.grow(table, len(tokens)):
            self.pool.release(table)
            return
        assert self.pool.unshare(table, table.num_cached_tokens) == []  # nothing shared to write
        for position in range(table.num_cached_tokens, len(tokens)):
            self._write(table, position, tokens[position])
        self.pool.commit(table, tokens, len(tokens))
        self.live.append(Sequence(table=table, tokens=list(tokens)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.live))
        self.live.append(Sequence(table=self.pool.fork(parent.table), tokens=list(parent.tokens)))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        """The scheduler's order: unshare, then grow; the runner copies, then writes."""
        sequence = data.draw(st.sampled_from(self.live))
        table, position = sequence.table, len(sequence.tokens)
        copies = self.pool.unshare(table, position)
        if copies is None:
            return
        for copy in copies:
            for slot in range(T):
                if (copy.src, slot) in self.kv:
                    self.kv[(copy.dst, slot)] = self.kv[(copy.src, slot)]
        if not self.pool.grow(table, position + 1):
            return  # the copy stands: the block is the table's own from now on
        self._write(table, position, token)
        sequence.tokens.append(token)
        self.pool.commit(table, sequence.tokens, len(sequence.tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        sequence = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.pool.release(sequence.table)
        self.pool.release(sequence.table)  # a second release is a no-op, never a double free

    def _write(self, table: BlockTable, position: int, token: int) -> None:
        block = table.block_ids[position // T]
        holders = sum(block in s.table.block_ids for s in self.live)
        assert holders == 0 or (holders == 1 and any(s.table is table for s in self.live)), (
            f"block {block} written while {holders} tables hold it"
        )
        self.kv[(block, position % T)] = token

    @invariant()
    def each_sequence_reads_its_own_tokens(self) -> None:
        for sequence in self.live:
            ids = sequence.table.block_ids
            read = [self.kv.get((ids[p // T], p % T)) for p in range(len(sequence.tokens))]
            assert read == sequence.tokens

    @invariant()
    def references_balance(self) -> None:
        self.pool.check_invariants([s.table for s in self.live])
        if not self.live:
            assert self.pool.statistics().used_blocks == 0


ForkMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestForkMachine = ForkMachine.TestCase
