"""The bounce (staging) path: one contiguous write instead of many small ones. Pure.

Some pairings cut the KV so finely that a direct transfer is thousands of tiny fragments (HND
against NHD; NHD head mismatches). With `kv_cache_bounce_size_mb` > 0 on both sides such a
transfer goes through staging buffers: gen reserves room for its share in the *canonical* layout
`[its layers, K/V, its kv heads, tokens, head_dim]` and names it in REQUEST_DATA; each ctx rank
packs the runs it owns (`staged_runs`) into its own staging buffer and writes them with one
descriptor per run (merged where they continue each other); once every ctx rank has reported,
gen scatters the region into its blocks. gen decides whether a pairing bounces (gen.py), from
the smallest piece its mapper would write against the agreed `threshold_bytes`; ctx follows the
REQUEST_DATA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import numpy as np

from trtdisagg.transfer.protocol.fragments import Fragments, merge_runs
from trtdisagg.transfer.protocol.rank_info import RankInfo, intersect


@attrs.frozen(kw_only=True)
class StagedRun:
    """One piece of a ctx rank's share: local layer `src_layer`, K (0) or V (1), local heads
    [src_head, src_head + num_heads), every token of the range; `dst_offset` in gen's region."""

    src_layer: int
    kv: int
    src_head: int
    num_heads: int
    dst_offset: int
    num_bytes: int


def skipped_tokens(num_tokens: int, num_blocks: int, tokens_per_block: int) -> int:
    """The leading tokens of a request that gen holds already (prefix reuse): it asks for the
    last `num_blocks` blocks of `num_tokens`; ctx stages and gen reserves only the rest."""
    return (-(-num_tokens // tokens_per_block) - num_blocks) * tokens_per_block


def canonical_bytes(receiver: RankInfo, num_tokens: int) -> int:
    """Bytes of the receiver's staged region for `num_tokens` tokens of one request."""
    row = receiver.head_dim * receiver.element_bytes
    return len(receiver.layers) * 2 * len(receiver.heads) * num_tokens * row


def staged_runs(sender: RankInfo, receiver: RankInfo, *, num_tokens: int) -> tuple[StagedRun, ...]:
    """The runs `sender` contributes to `receiver`'s canonical region, in the order it packs
    them (receiver layer order, then K/V). Empty when the two share no layer or no head."""
    heads = intersect(sender.heads, receiver.heads)
    if not heads or num_tokens <= 0:
        return ()
    num_heads, row = len(receiver.heads), receiver.head_dim * receiver.element_bytes
    first_head = heads.start - receiver.heads.start  # in each of gen's (layer, K/V) slabs
    return tuple(
        StagedRun(src_layer=sender.layers.index(layer), kv=kv,
                  src_head=heads.start - sender.heads.start, num_heads=len(heads),
                  dst_offset=((dst_layer * 2 + kv) * num_heads + first_head) * num_tokens * row,
                  num_bytes=len(heads) * num_tokens * row)
        for dst_layer, layer in enumerate(receiver.layers)
        if layer in sender.layers
        for kv in (0, 1)
    )  # fmt: skip


def staged_fragments(runs: Sequence[StagedRun], *, src_address: int, dst_address: int) -> Fragments:
    """The writes of packed `runs` (back to back from `src_address`) into the region at
    `dst_address`, merged where they continue each other on both sides."""
    sizes = np.array([run.num_bytes for run in runs], dtype=np.int64)
    dst = np.array([run.dst_offset for run in runs], dtype=np.int64) + dst_address
    src = src_address + np.cumsum(sizes) - sizes  # packed back to back
    return Fragments(merge_runs(np.stack([src, dst, sizes], axis=1)))


@attrs.define(kw_only=True)
class StagingAllocator:
    """First-fit ranges of one staging buffer: the lowest gap between the ranges in use that
    fits. FIFO fairness is the caller's (one queue)."""

    capacity: int
    alignment: int = 256
    _used: dict[int, int] = attrs.field(init=False, factory=dict)  # offset -> size

    def __attrs_post_init__(self) -> None:
        # Sizes are rounded up to the alignment, so in a buffer with a ragged end a request of
        # the whole capacity would round past it and wait forever (found by
        # tests/unit/test_transfer_staging_fuzz.py). Real buffers are whole MiB.
        if self.alignment <= 0 or self.capacity < 0 or self.capacity % self.alignment:
            raise ValueError(
                f"staging capacity {self.capacity} is not a multiple of the alignment "
                f"{self.alignment}"
            )

    def allocate(self, num_bytes: int) -> int | None:
        """An offset of `num_bytes` free bytes, or None while nothing that large is free."""
        if num_bytes <= 0 or num_bytes > self.capacity:
            raise ValueError(f"cannot stage {num_bytes} bytes in a buffer of {self.capacity}")
        size = -(-num_bytes // self.alignment) * self.alignment
        start = 0  # of the gap before the next range in use
        for offset, used in sorted(self._used.items()):
            if offset - start >= size:
                break
            start = offset + used
        if start + size > self.capacity:
            return None
        self._used[start] = size
        return start

    def release(self, offset: int) -> None:
        del self._used[offset]

    @property
    def free_bytes(self) -> int:
        return self.capacity - sum(self._used.values())


class Stager(Protocol):
    """A rank's staging buffer and its copies (`kv.staging.StagingBuffer`); blocking calls."""

    @property
    def address(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    @property
    def memory_type(self) -> str: ...  # "VRAM" or "DRAM"

    def pack(self, offset: int, runs: Sequence[StagedRun], block_ids: Sequence[int], *,
             first_token: int, num_tokens: int) -> None: ...  # fmt: skip

    def unpack(self, offset: int, block_ids: Sequence[int], *, first_token: int,
               num_tokens: int) -> None: ...  # fmt: skip
