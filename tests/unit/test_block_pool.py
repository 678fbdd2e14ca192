from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trtdisagg.kv.block_pool import BlockPool, BlockTable, KvEvent, KvEventKind
from trtdisagg.kv.hashing import block_hashes, salt_root

T = 4


def make_pool(num_blocks: int = 32, *, reuse: bool = True, **kwargs: int) -> BlockPool:
    return BlockPool(num_blocks=num_blocks, tokens_per_block=T, enable_block_reuse=reuse, **kwargs)


def run_request(pool: BlockPool, tokens: list[int]) -> BlockTable:
    """Open, grow to cover the tokens, compute and commit them all: a finished prefill."""
    table = pool.open_table(tokens)
    assert pool.grow(table, len(tokens))
    pool.commit(table, tokens, len(tokens))
    return table


def is_run(ids: list[int]) -> bool:
    return ids == list(range(ids[0], ids[0] + len(ids)))


def test_fresh_pool() -> None:
    pool = make_pool(8)
    stats = pool.statistics()
    assert (stats.total_blocks, stats.free_blocks, stats.reusable_blocks, stats.used_blocks) == (
        8,
        8,
        0,
        0,
    )
    assert pool.num_blocks == 8
    assert pool.tokens_per_block == T
    assert pool.drain_events() == []


@pytest.mark.parametrize(
    ("num_blocks", "tokens_per_block", "events"), [(0, 4, 1), (4, 0, 1), (4, 4, 0)]
)
def test_rejects_bad_sizes(num_blocks: int, tokens_per_block: int, events: int) -> None:
    with pytest.raises(ValueError):
        BlockPool(
            num_blocks=num_blocks,
            tokens_per_block=tokens_per_block,
            enable_block_reuse=True,
            max_pending_events=events,
        )


def test_consecutive_allocation() -> None:
    pool = make_pool(64)
    a = pool.open_table([])
    assert pool.grow(a, 10 * T)
    assert a.block_ids == list(range(10))
    b = pool.open_table([])
    assert pool.grow(b, 3 * T)
    assert b.block_ids == [10, 11, 12]
    # Growing one block at a time continues the table's own run.
    assert pool.grow(b, 5 * T)
    assert b.block_ids == [10, 11, 12, 13, 14]


def test_growth_continues_own_run_when_free() -> None:
    pool = make_pool(16)
    a = pool.open_table([])
    assert pool.grow(a, 2 * T)
    b = pool.open_table([])
    assert pool.grow(b, 2 * T)
    pool.release(a)  # frees 0, 1 in front of b
    assert pool.grow(b, 4 * T)
    assert b.block_ids == [2, 3, 4, 5]


def test_best_fit_over_runs() -> None:
    pool = make_pool(16)
    tables = []
    for _ in range(8):
        t = pool.open_table([])
        assert pool.grow(t, 2 * T)
        tables.append(t)
    # Free runs: [0, 2) and [4, 10) (merged from three tables), [14, 16).
    for i in (0, 2, 3, 4, 7):
        pool.release(tables[i])
    c = pool.open_table([])
    assert pool.grow(c, 2 * T)
    assert c.block_ids == [0, 1]  # smallest run that fits, lowest id on ties
    d = pool.open_table([])
    assert pool.grow(d, 5 * T)
    assert d.block_ids == [4, 5, 6, 7, 8]
    # Nothing fits 3 in one run now ([9, 10) and [14, 16)): largest run first.
    e = pool.open_table([])
    assert pool.grow(e, 3 * T)
    assert e.block_ids == [14, 15, 9]
    pool.check_invariants([*tables[1:2], *tables[5:7], c, d, e])


def test_grow_failure_changes_nothing() -> None:
    pool = make_pool(4)
    a = pool.open_table([])
    assert pool.grow(a, 3 * T)
    assert not pool.can_grow(a, 5 * T)
    assert not pool.grow(a, 5 * T)
    assert a.block_ids == [0, 1, 2]
    assert pool.statistics().free_blocks == 1
    assert pool.can_grow(a, 4 * T)
    assert pool.grow(a, 3 * T + 1)
    assert pool.grow(a, 2 * T)  # already covered
    assert a.block_ids == [0, 1, 2, 3]


def test_release_is_idempotent_and_ends_the_table() -> None:
    pool = make_pool(4)
    a = pool.open_table([])
    assert pool.grow(a, 4 * T)
    pool.release(a)
    pool.release(a)
    assert a.is_released
    assert a.block_ids == []
    assert pool.statistics().free_blocks == 4
    with pytest.raises(ValueError, match="released"):
        pool.grow(a, T)
    with pytest.raises(ValueError, match="released"):
        pool.commit(a, [1] * T, T)


def test_a_salted_prefix_is_reused_only_under_its_salt() -> None:
    """A table rooted at a salt (`Request.root`) finds only blocks committed under the same
    root; its forks keep the root, so their blocks chain on alike."""
    pool = make_pool(32)
    prefix = list(range(100, 100 + 3 * T))
    salted = pool.open_table([*prefix, 1, 2], root=salt_root("a"))
    assert pool.grow(salted, 3 * T + 2)
    pool.commit(salted, [*prefix, 1, 2], 3 * T + 2)
    assert pool.lookup_prefix([*prefix, 7]) == 0  # unsalted: nothing
    assert pool.lookup_prefix([*prefix, 7], root=salt_root("b")) == 0
    assert pool.lookup_prefix([*prefix, 7], root=salt_root("a")) == 3 * T
    again = pool.open_table([*prefix, 7], root=salt_root("a"))
    assert again.block_ids == salted.block_ids[:3]
    fork = pool.fork(salted)
    longer = [*prefix, 1, 2, 3, 4, 5, 6]
    assert pool.grow(fork, len(longer))
    pool.unshare(fork, 3 * T)
    pool.commit(fork, longer, len(longer))
    assert pool.lookup_prefix([*longer, 9], root=salt_root("a")) == 4 * T
    for table in (salted, again, fork):
        pool.release(table)
    pool.check_invariants([])


def test_prefix_reuse() -> None:
    pool = make_pool(32)
    prefix = list(range(100, 100 + 3 * T))
    first = run_request(pool, [*prefix, 1, 2])
    shared = first.block_ids[:3]
    assert pool.lookup_prefix([*prefix, 7]) == 3 * T

    second = pool.open_table([*prefix, 7, 8, 9])
    assert second.block_ids == shared
    assert second.num_cached_tokens == 3 * T
    assert second.num_committed_blocks == 3
    # Two live owners of the shared blocks: refcount 2, counted once as used.
    pool.check_invariants([first, second])
    assert pool.statistics().used_blocks == 4
    assert pool.grow(second, 3 * T + 3)
    pool.release(first)
    pool.check_invariants([second])
    pool.release(second)
    assert pool.statistics().used_blocks == 0


def test_reuse_never_covers_the_whole_prompt() -> None:
    pool = make_pool(32)
    prompt = list(range(3 * T))
    pool.release(run_request(pool, [*prompt, 5]))
    # The prompt is exactly 3 full cached blocks, but its last token must be computed.
    assert pool.lookup_prefix(prompt) == 2 * T
    assert pool.open_table(prompt).num_cached_tokens == 2 * T
    assert pool.lookup_prefix([*prompt, 9]) == 3 * T
    assert pool.lookup_prefix(prompt[:1]) == 0
    assert pool.lookup_prefix([]) == 0


def test_reuse_off_on_request() -> None:
    pool = make_pool(32)
    tokens = list(range(3 * T + 1))
    pool.release(run_request(pool, tokens))
    table = pool.open_table(tokens, reuse=False)
    assert table.block_ids == []
    assert table.num_cached_tokens == 0
    assert pool.lookup_prefix(tokens) == 3 * T  # still cached for others


def test_lookup_prefix_stops_at_first_miss_and_has_no_side_effects() -> None:
    pool = make_pool(32)
    tokens = list(range(4 * T + 1))
    pool.release(run_request(pool, tokens))
    pool.drain_events()
    before = pool.statistics()
    assert pool.lookup_prefix([*tokens[:T], 999, *tokens[T + 1 :]]) == T
    assert pool.lookup_prefix([999, *tokens[1:]]) == 0
    assert pool.statistics() == before
    assert pool.drain_events() == []


def test_commit_emits_chained_stored_events_and_is_idempotent() -> None:
    pool = make_pool(32)
    tokens = list(range(3 * T + 2))
    table = pool.open_table(tokens)
    assert pool.grow(table, len(tokens))
    pool.commit(table, tokens, T + 1)  # one full computed block
    pool.commit(table, tokens, T + 1)
    pool.commit(table, tokens, 3 * T + 2)  # blocks 1 and 2; the partial block 3 never
    pool.commit(table, tokens, 3 * T + 2)
    hashes = block_hashes(tokens, T)
    events = pool.drain_events()
    assert events == [
        KvEvent(kind=KvEventKind.STORED, block_hashes=(hashes[0],), parent_hash=None, event_id=0),
        KvEvent(
            kind=KvEventKind.STORED,
            block_hashes=tuple(hashes[1:3]),
            parent_hash=hashes[0],
            event_id=1,
        ),
    ]
    assert pool.drain_events() == []
    # Only tokens that exist count, however many are claimed computed.
    pool.commit(table, tokens, 100)
    assert table.num_committed_blocks == 3


def test_release_makes_hashed_blocks_reusable_and_others_free() -> None:
    pool = make_pool(8)
    table = run_request(pool, list(range(2 * T + 1)))  # 2 full blocks + 1 partial
    pool.release(table)
    stats = pool.statistics()
    assert (stats.free_blocks, stats.reusable_blocks, stats.used_blocks) == (6, 2, 0)


def test_eviction_is_lru_emits_removed_and_evicts_chain_tails_first() -> None:
    pool = make_pool(4)
    a_tokens = [1] * (2 * T) + [0]
    b_tokens = [2] * (2 * T) + [0]
    a = run_request(pool, a_tokens[: 2 * T])
    pool.release(a)  # a's blocks: reusable, released first (least recent)
    b = run_request(pool, b_tokens[: 2 * T])
    pool.release(b)
    pool.drain_events()
    a_hashes = block_hashes(a_tokens, T)
    b_hashes = block_hashes(b_tokens, T)
    assert pool.statistics().reusable_blocks == 4

    c = pool.open_table([])
    assert pool.grow(c, T)
    # a is the least recently used; its tail block goes before its head.
    assert pool.drain_events() == [
        KvEvent(kind=KvEventKind.REMOVED, block_hashes=(a_hashes[1],), event_id=2)
    ]
    assert pool.lookup_prefix(a_tokens) == T
    assert pool.lookup_prefix(b_tokens) == 2 * T
    assert pool.grow(c, 3 * T)
    (removed,) = pool.drain_events()
    assert removed.kind is KvEventKind.REMOVED
    assert removed.block_hashes == (a_hashes[0], b_hashes[1])
    assert removed.event_id == 3
    assert pool.lookup_prefix(b_tokens) == T
    pool.check_invariants([c])


def test_reusing_a_block_refreshes_it_in_lru_order() -> None:
    pool = make_pool(2)
    a_tokens = [1] * T + [0]
    b_tokens = [2] * T + [0]
    pool.release(run_request(pool, a_tokens[:T]))
    pool.release(run_request(pool, b_tokens[:T]))
    pool.release(pool.open_table(a_tokens))  # a used again: now b is least recent
    pool.drain_events()
    c = pool.open_table([])
    assert pool.grow(c, T)
    (removed,) = pool.drain_events()
    assert removed.block_hashes == tuple(block_hashes(b_tokens[:T], T))


def test_duplicate_hash_keeps_one_canonical_copy() -> None:
    pool = make_pool(16)
    tokens = list(range(2 * T + 1))
    # Two requests with the same prompt prefill at once: neither can reuse the other's blocks.
    a = pool.open_table(tokens)
    b = pool.open_table(tokens)
    assert pool.grow(a, len(tokens))
    assert pool.grow(b, len(tokens))
    pool.commit(a, tokens, len(tokens))
    pool.commit(b, tokens, len(tokens))
    (stored,) = pool.drain_events()
    assert stored.block_hashes == tuple(block_hashes(tokens, T))
    pool.release(b)
    pool.release(a)
    stats = pool.statistics()
    assert (stats.reusable_blocks, stats.used_blocks) == (2, 0)
    assert pool.open_table(tokens).block_ids == [0, 1]  # a's copies, registered first


def test_duplicate_in_the_middle_splits_stored_events() -> None:
    pool = make_pool(16)
    tokens = list(range(3 * T + 1))
    a = pool.open_table(tokens)
    assert pool.grow(a, len(tokens))
    pool.commit(a, tokens, 2 * T)  # blocks 0 and 1 cached by a
    b = pool.open_table([])
    assert pool.grow(b, len(tokens))
    pool.commit(b, tokens[:T], T)  # b's block 0 duplicates a's
    pool.drain_events()
    pool.release(a)  # a's cached blocks stay reusable
    pool.commit(b, tokens, 3 * T)  # b: block 1 duplicate, block 2 new
    hashes = block_hashes(tokens, T)
    assert pool.drain_events() == [
        KvEvent(
            kind=KvEventKind.STORED, block_hashes=(hashes[2],), parent_hash=hashes[1], event_id=1
        )
    ]
    pool.check_invariants([b])


def test_reuse_disabled_caches_nothing() -> None:
    pool = make_pool(8, reuse=False)
    tokens = list(range(3 * T + 1))
    table = run_request(pool, tokens)
    assert table.num_committed_blocks == 3
    pool.release(table)
    assert pool.statistics().free_blocks == 8
    assert pool.lookup_prefix(tokens) == 0
    assert pool.open_table(tokens).block_ids == []
    assert pool.drain_events() == []


def test_event_buffer_is_bounded() -> None:
    pool = make_pool(32, max_pending_events=2)
    for i in range(5):
        pool.release(run_request(pool, [i] * T))
    events = pool.drain_events()
    assert [e.event_id for e in events] == [3, 4]
    assert pool.statistics().num_dropped_events == 3


# A few shared prefixes with random tails, so that prefix hits, duplicates and evictions happen.
_PREFIXES = ([1] * (6 * T), [2, 3] * (3 * T), list(range(6 * T)))
token_lists = st.builds(
    lambda prefix, cut, tail: _PREFIXES[prefix][:cut] + tail,
    st.integers(0, len(_PREFIXES) - 1),
    st.integers(0, 6 * T),
    st.lists(st.integers(0, 3), max_size=3 * T),
).filter(bool)


class PoolMachine(RuleBasedStateMachine):
    """Random open/grow/commit/release; the pool's books must always balance."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(12)
        # Live tables with their token sequences; a small alphabet makes prefixes collide.
        self.live: list[tuple[BlockTable, list[int]]] = []

    @rule(tokens=token_lists, reuse=st.booleans())
    def open(self, tokens: list[int], reuse: bool) -> None:
        self._open(tokens, reuse)

    @rule(tokens=token_lists)
    def prefill(self, tokens: list[int]) -> None:
        """What the scheduler does: open with reuse, grow to the prompt, compute, commit."""
        table = self._open(tokens, True)
        if self.pool.grow(table, len(tokens)):
            self.pool.commit(table, tokens, len(tokens))

    def _open(self, tokens: list[int], reuse: bool) -> BlockTable:
        expected = self.pool.lookup_prefix(tokens) if reuse else 0
        table = self.pool.open_table(tokens, reuse=reuse)
        assert table.num_cached_tokens == expected == len(table.block_ids) * T
        assert table.num_cached_tokens <= len(tokens) - 1
        self.live.append((table, tokens))
        return table

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        table, tokens = data.draw(st.sampled_from(self.live))
        num_tokens = data.draw(st.integers(0, len(tokens)))
        before = list(table.block_ids)
        possible = self.pool.can_grow(table, num_tokens)
        assert self.pool.grow(table, num_tokens) == possible
        if possible:
            assert len(table.block_ids) >= -(-num_tokens // T)
            assert table.block_ids[: len(before)] == before
        else:
            assert table.block_ids == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        table, tokens = data.draw(st.sampled_from(self.live))
        covered = min(len(tokens), len(table.block_ids) * T)
        self.pool.commit(table, tokens, data.draw(st.integers(0, covered)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.live) - 1))
        table, _ = self.live.pop(index)
        self.pool.release(table)
        self.pool.release(table)

    @rule()
    def drain(self) -> None:
        ids = [e.event_id for e in self.pool.drain_events()]
        assert ids == sorted(ids)

    @invariant()
    def books_balance(self) -> None:
        tables = [t for t, _ in self.live]
        self.pool.check_invariants(tables)
        stats = self.pool.statistics()
        assert stats.free_blocks + stats.reusable_blocks + stats.used_blocks == stats.total_blocks
        if not self.live:
            assert stats.used_blocks == 0

    @invariant()
    def only_cached_blocks_are_shared(self) -> None:
        owners: dict[int, list[tuple[BlockTable, int]]] = {}
        for table, _ in self.live:
            for index, block in enumerate(table.block_ids):
                owners.setdefault(block, []).append((table, index))
        for block, holders in owners.items():
            if len(holders) > 1:
                # A shared block is a committed prefix block at the same position in each.
                assert len({index for _, index in holders}) == 1, block
                assert all(index < t.num_committed_blocks for t, index in holders), block

    @invariant()
    def shared_content_matches(self) -> None:
        # A block held by two tables must hold the same tokens for both.
        content: dict[int, list[int]] = {}
        for table, tokens in self.live:
            for index, block in enumerate(table.block_ids[: table.num_committed_blocks]):
                chunk = tokens[: (index + 1) * T]
                assert content.setdefault(block, chunk) == chunk


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
