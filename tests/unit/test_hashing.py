from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trtdisagg.kv.hashing import (
    HASH_ALGORITHM,
    block_hashes,
    hash_block,
    reusable_block_hashes,
    salt_root,
)

tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=64)


def reference_hash(parent: int | None, block: list[int]) -> int:
    """The documented definition, written out independently: the router may reimplement it."""
    data = b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little")
    data += b"".join(t.to_bytes(4, "little") for t in block)
    digest = hashlib.blake2b(data, digest_size=8, person=b"trtdisagg-kv-v1").digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def test_algorithm_name() -> None:
    assert HASH_ALGORITHM == "blake2b-63-chained-v1"


def test_golden_values() -> None:
    # Pinned: changing these breaks every router and every cache that speaks this algorithm.
    assert block_hashes(list(range(10)), 4) == [116350790798939021, 5299233033936854968]


@given(tokens, st.integers(min_value=1, max_value=8))
def test_matches_documented_definition(token_ids: list[int], t: int) -> None:
    expected: list[int] = []
    parent = None
    for start in range(0, len(token_ids) // t * t, t):
        parent = reference_hash(parent, token_ids[start : start + t])
        expected.append(parent)
    assert block_hashes(token_ids, t) == expected


@given(tokens, st.integers(min_value=1, max_value=8))
def test_only_full_blocks_and_63_bits(token_ids: list[int], t: int) -> None:
    hashes = block_hashes(token_ids, t)
    assert len(hashes) == len(token_ids) // t
    assert all(0 <= h < 2**63 for h in hashes)


@given(tokens, tokens, st.integers(min_value=1, max_value=8))
def test_prefix_property_and_parent_continuation(a: list[int], b: list[int], t: int) -> None:
    a = a[: len(a) // t * t]
    joined = block_hashes(a + b, t)
    head = block_hashes(a, t)
    assert joined[: len(head)] == head
    parent = head[-1] if head else None
    assert joined[len(head) :] == block_hashes(b, t, parent=parent)


def test_chain_depends_on_everything_before() -> None:
    first = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    other = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert first[0] != other[0]
    assert first[1] != other[1]  # same tokens, different prefix
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert hash_block(None, [0]) != hash_block(0, [0])  # a first block is not parent 0


def test_stable_across_processes() -> None:
    code = "from trtdisagg.kv.hashing import block_hashes; print(block_hashes(list(range(64)), 16))"
    outputs = set()
    for seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout)
    assert outputs == {f"{block_hashes(list(range(64)), 16)}\n"}


def test_reusable_block_hashes_leaves_the_last_token() -> None:
    assert reusable_block_hashes(list(range(8)), 4) == block_hashes(list(range(4)), 4)
    assert reusable_block_hashes(list(range(9)), 4) == block_hashes(list(range(8)), 4)
    assert reusable_block_hashes([], 4) == []


def test_a_salted_chain_is_rooted_at_the_documented_salt_hash() -> None:
    """vLLM's cache_salt: the first block's parent is the salt's own hash, so salted chains
    share nothing with unsalted ones nor with other salts; an unsalted chain is as pinned."""
    prompt = list(range(9))
    digest = hashlib.blake2b(b"tenant-a", digest_size=8, person=b"trtdisagg-salt").digest()
    root = int.from_bytes(digest, "little") & (2**63 - 1)
    assert salt_root("tenant-a") == root and salt_root(None) is None
    salted = reusable_block_hashes(prompt, 4, salt="tenant-a")
    assert salted == block_hashes(prompt[:8], 4, parent=root)
    assert salted[0] == reference_hash(root, prompt[:4])
    plain = reusable_block_hashes(prompt, 4)
    other = reusable_block_hashes(prompt, 4, salt="tenant-b")
    assert not {*salted} & {*plain} and not {*salted} & {*other}
    assert reusable_block_hashes(prompt, 4, salt=None) == plain


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="tokens_per_block"):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="token id -1"):
        block_hashes([-1, 2], 2)
    with pytest.raises(ValueError, match="token id 4294967296"):
        block_hashes([2**32, 2], 2)
    with pytest.raises(ValueError, match="parent hash"):
        block_hashes([1, 2], 2, parent=2**63)
    with pytest.raises(ValueError, match="parent hash"):
        hash_block(-1, [1])
