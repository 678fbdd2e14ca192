"""The page table: how one rank's KV memory is laid out, described so that a peer can address it.

A rank owns one physical pool per layer group. A pool is `num_slots` slots (one slot per block),
`slot_stride_bytes` apart; inside a slot the local layers follow one another `layer_stride_bytes`
apart, and inside a layer the buffer entries (K then V) sit at fixed offsets. So the bytes of
(local layer `l`, block `b`, entry `e`) start at

    base_address + b * slot_stride_bytes + l * layer_stride_bytes + e.offset

Keeping all layers of one block contiguous means a run of consecutive blocks is one contiguous
byte range on both sides of a homogeneous transfer, which NIXL moves as a single descriptor.

Pure: no torch, no I/O. The transfer layer serialises these values as they are.
"""

from __future__ import annotations

import enum

import attrs


class Layout(enum.Enum):
    """Order of one entry's elements: heads-major (HND) or tokens-major (NHD)."""

    HND = "HND"
    NHD = "NHD"


class MapperKind(enum.Enum):
    HND = "HND"
    NHD = "NHD"
    REPLICATED = "REPLICATED"


@attrs.frozen(kw_only=True)
class PhysicalPool:
    base_address: int
    slot_bytes: int
    num_slots: int
    slot_stride_bytes: int
    layer_stride_bytes: int
    memory_type: str = "DRAM"  # "DRAM" | "VRAM", as NIXL names them
    device_id: int = 0

    def __attrs_post_init__(self) -> None:
        if self.slot_stride_bytes < self.slot_bytes:
            raise ValueError(
                f"slot_stride_bytes {self.slot_stride_bytes} < slot_bytes {self.slot_bytes}"
            )
        if self.num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {self.num_slots}")

    @property
    def total_bytes(self) -> int:
        return self.slot_stride_bytes * self.num_slots


@attrs.frozen(kw_only=True)
class BufferEntry:
    """One tensor's bytes (K or V of one local layer) inside a slot, relative to the layer start."""

    local_layer_id: int
    offset: int
    size: int


@attrs.frozen(kw_only=True)
class PoolView:
    """How one layer group's pool is cut: which entries, which heads, and how to map them."""

    pool_role: frozenset[str]
    mapper_kind: MapperKind
    buffer_entries: tuple[BufferEntry, ...]
    num_kv_heads: int  # heads held by this rank (after TP split / duplication)
    head_dim: int
    tokens_per_block: int
    element_bytes: int


@attrs.frozen(kw_only=True)
class LayerGroup:
    group_id: int
    global_layer_ids: tuple[int, ...]  # local layer i holds global layer global_layer_ids[i]
    pool: PhysicalPool
    views: tuple[PoolView, ...]


@attrs.frozen(kw_only=True)
class PageTable:
    layer_groups: tuple[LayerGroup, ...]

    def region(
        self, group: int, local_layer: int, block: int, entry: BufferEntry
    ) -> tuple[int, int]:
        """(address, size) of one entry of one layer of one block."""
        g = self.layer_groups[group]
        pool = g.pool
        if not 0 <= block < pool.num_slots:
            raise ValueError(f"block {block} outside pool of {pool.num_slots} slots")
        address = (
            pool.base_address
            + block * pool.slot_stride_bytes
            + local_layer * pool.layer_stride_bytes
            + entry.offset
        )
        return address, entry.size
