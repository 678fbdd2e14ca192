"""Test-only hooks: exact digests of the KV a transfer moved, on both sides; failed steps.

Enabled by `enable_test_hooks` (the TRTDISAGG_TEST_HOOKS=1 environment variable), never in
production. ctx records the digest of a request's prompt KV when it starts the send; gen records
the digest of the same token range when the KV has landed, before decoding writes anything. A
test compares the two for the same transfer key: equal digests mean equal bytes.

The digest is independent of layout and of how an instance is cut: each rank hashes every
(global layer, global kv head) it holds, and rank 0 composes the instance's digest from all of
them (`rank_plan.compose_digest`). So a TP1 ctx and a TP2 or PP2 gen holding the same bytes give
the same digest.

They also arm failed model steps (`POST /debug/step_failures`): the next N steps of a single-rank
executor raise `InjectedStepFailure` in the step's worker thread, where a real failure (a CUDA
error, a sampling bug) would raise, so a test sees exactly what such a failure does to requests.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence
from typing import NoReturn

import attrs
import torch

from trtdisagg.kv.cache import KVCache
from trtdisagg.worker.rank_plan import HeadDigest, compose_digest

MAX_DIGESTS = 4096


class InjectedStepFailure(RuntimeError):
    """A model step failed on purpose (test hooks only)."""


def fail_step(*_args: object) -> NoReturn:
    """Stands in for `ModelRunner.execute` in a step armed to fail."""
    raise InjectedStepFailure("step failure injected by the test hooks")


def head_digests(
    cache: KVCache,
    *,
    layer_ids: Sequence[int],
    head_ids: Sequence[int],
    block_ids: Sequence[int],
    num_tokens: int,
) -> tuple[HeadDigest, ...]:
    """sha256 of K then V of tokens [0, num_tokens) for every local (layer, kv head).

    `layer_ids` and `head_ids` are the global ids of the pool's local layers and heads.
    """
    blocks = torch.tensor(list(block_ids), dtype=torch.long, device=cache.pool.device)
    parts = []
    for local_layer, layer in enumerate(layer_ids):
        keys, values = cache.gather(local_layer, blocks, num_tokens)  # [H, T, D] each
        for local_head, head in enumerate(head_ids):
            digest = hashlib.sha256()
            for part in (keys[local_head], values[local_head]):
                digest.update(part.contiguous().view(torch.uint8).cpu().numpy().tobytes())
            parts.append(HeadDigest(layer=layer, head=head, digest=digest.hexdigest()))
    return tuple(parts)


@attrs.define(eq=False, kw_only=True)
class TestHooks:
    __test__ = False  # not a pytest class

    layer_ids: tuple[int, ...]  # this rank's global layer ids, in pool order
    head_ids: tuple[int, ...]  # this rank's global kv head ids, in pool order
    digests: collections.OrderedDict[int, str] = attrs.Factory(collections.OrderedDict)
    step_failures: int = 0  # model steps still to fail on purpose

    def take_step_failure(self) -> bool:
        """Whether the step about to run must fail; uses up one armed failure if so."""
        if self.step_failures <= 0:
            return False
        self.step_failures -= 1
        return True

    def local_parts(
        self, cache: KVCache, block_ids: Sequence[int], num_tokens: int
    ) -> tuple[HeadDigest, ...]:
        return head_digests(
            cache,
            layer_ids=self.layer_ids,
            head_ids=self.head_ids,
            block_ids=block_ids,
            num_tokens=num_tokens,
        )

    def record(self, key: int, cache: KVCache, block_ids: Sequence[int], num_tokens: int) -> None:
        """Single rank: digest the whole KV of `key` now."""
        self.store(key, self.local_parts(cache, block_ids, num_tokens))

    def store(self, key: int, parts: Iterable[HeadDigest]) -> None:
        self.digests[key] = compose_digest(parts)
        while len(self.digests) > MAX_DIGESTS:
            self.digests.popitem(last=False)
