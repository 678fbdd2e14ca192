"""Test-only introspection: exact digests of the KV a transfer moved, on both sides.

Enabled by `enable_test_hooks` (the TRTDISAGG_TEST_HOOKS=1 environment variable), never in
production. ctx records the digest of a request's prompt KV when it starts the send; gen records
the digest of the same token range when the KV has landed, before decoding writes anything. A
test compares the two for the same transfer key: equal digests mean equal bytes.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import attrs
import torch

from trtdisagg.kv.cache import KVCache

MAX_DIGESTS = 4096


def kv_digest(cache: KVCache, block_ids: Sequence[int], num_tokens: int) -> str:
    """sha256 over every local layer's K then V of tokens [0, num_tokens), layout-independent."""
    blocks = torch.tensor(list(block_ids), dtype=torch.long, device=cache.pool.device)
    digest = hashlib.sha256()
    for layer in range(cache.num_layers):
        for part in cache.gather(layer, blocks, num_tokens):
            raw = part.contiguous().view(torch.uint8).cpu().numpy().tobytes()
            digest.update(raw)
    return digest.hexdigest()


@attrs.define(eq=False, kw_only=True)
class TestHooks:
    __test__ = False  # not a pytest class

    digests: collections.OrderedDict[int, str] = attrs.Factory(collections.OrderedDict)

    def record(self, key: int, cache: KVCache, block_ids: Sequence[int], num_tokens: int) -> None:
        self.digests[key] = kv_digest(cache, block_ids, num_tokens)
        while len(self.digests) > MAX_DIGESTS:
            self.digests.popitem(last=False)
