"""Chained block hashes: the identity of a block of KV by the tokens that produced it.

The KV of a block depends on its own tokens and on every token before it, so a block's hash chains
the previous block's hash with its own tokens: ``hash_i = H(hash_{i-1}, tokens of block i)``. Two
prompts that share a prefix share the hashes of its full blocks, and a hash identifies a whole
prefix, not just one block.

This is a shared contract: the block pool registers these hashes, the KV events carry them, and
the coordinator's KV-aware router computes them from prompt tokens to predict cache hits on each
worker. They must therefore be stable across processes, machines and Python versions (no
``hash()``, which is salted per process). The exact definition, ``HASH_ALGORITHM``:

* ``H`` is BLAKE2b with ``digest_size=8`` and ``person=b"trtdisagg-kv-v1"``;
* its input is ``b"\\x00"`` for the first block, or ``b"\\x01"`` followed by the parent hash as
  8 little-endian bytes, then each token id as 4 little-endian unsigned bytes;
* the result is the digest read as a little-endian unsigned integer with the top bit cleared, so
  that it fits a signed 64-bit integer in JSON and msgpack.

Only full blocks are hashed: a partial block's KV is still growing and cannot be shared.

A request's ``cache_salt`` (vLLM's) roots its chain elsewhere: its first block is hashed with
``salt_root(salt)`` as parent, the BLAKE2b digest of the salt's UTF-8 bytes with
``person=b"trtdisagg-salt"``, read as above. Its blocks then match only requests of the same
salt: one tenant cannot find out, by timing, what another's prompts held. Unsalted chains are
unchanged.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Final

HASH_ALGORITHM: Final = "blake2b-63-chained-v1"

_PERSON: Final = b"trtdisagg-kv-v1"
_SALT_PERSON: Final = b"trtdisagg-salt"
_MASK_63: Final = (1 << 63) - 1
_NO_PARENT: Final = b"\x00"
_HAS_PARENT: Final = b"\x01"


def hash_block(parent: int | None, tokens: Sequence[int]) -> int:
    """Hash one block's tokens, chained to its parent block's hash.

    Args:
        parent: the previous block's hash, or None for the first block of a sequence.
        tokens: the block's token ids, each in ``[0, 2**32)``.

    Returns:
        A non-negative 63-bit integer.

    Raises:
        ValueError: a token id or the parent hash is out of range.
    """
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    if parent is None:
        h.update(_NO_PARENT)
    else:
        if not 0 <= parent <= _MASK_63:
            raise ValueError(f"parent hash {parent} is not a 63-bit non-negative integer")
        h.update(_HAS_PARENT + parent.to_bytes(8, "little"))
    try:
        h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    except struct.error:
        bad = next((t for t in tokens if not 0 <= t < 1 << 32), None)
        raise ValueError(f"token id {bad} is not in [0, 2**32)") from None
    return int.from_bytes(h.digest(), "little") & _MASK_63


def salt_root(salt: str | None) -> int | None:
    """The parent of a salted chain's first block; None (no parent) without a salt."""
    if salt is None:
        return None
    digest = hashlib.blake2b(salt.encode(), digest_size=8, person=_SALT_PERSON).digest()
    return int.from_bytes(digest, "little") & _MASK_63


def block_hashes(
    token_ids: Sequence[int], tokens_per_block: int, *, parent: int | None = None
) -> list[int]:
    """Chained hashes of every full block of ``token_ids``; a trailing partial block is ignored.

    Args:
        token_ids: the sequence, from its first token (or from the first token after the block
            whose hash is ``parent``).
        tokens_per_block: block size in tokens; must match the worker's ``tokens_per_block``.
        parent: the hash of the block before ``token_ids[0]``, to continue a chain.

    Returns:
        ``len(token_ids) // tokens_per_block`` hashes, in block order.

    Raises:
        ValueError: ``tokens_per_block`` is not positive, or a token id is out of range.
    """
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
    hashes: list[int] = []
    for start in range(0, len(token_ids) - tokens_per_block + 1, tokens_per_block):
        parent = hash_block(parent, token_ids[start : start + tokens_per_block])
        hashes.append(parent)
    return hashes


def reusable_block_hashes(
    prompt_token_ids: Sequence[int], tokens_per_block: int, *, salt: str | None = None
) -> list[int]:
    """Hashes of the blocks a new request with this prompt (and `salt`, its ``cache_salt``)
    could take from a prefix cache.

    A worker always computes at least the prompt's last token itself (its logits give the first
    output token), so only the full blocks of ``prompt[:-1]`` can be reused. This is what the
    block pool matches in ``lookup_prefix``, and what a KV-aware router should match against a
    worker's stored hashes.
    """
    return block_hashes(prompt_token_ids[:-1], tokens_per_block, parent=salt_root(salt))
