"""KVCache: the KV pool tensor of one rank, and the page table that describes it to peers.

One contiguous tensor holds every block:

    HND: [num_blocks, num_layers, 2, H, T, D]      NHD: [num_blocks, num_layers, 2, T, H, D]

(H local kv heads, T tokens per block, D head dim; index 0 of the third dim is K, 1 is V). All
local layers of one block are adjacent, so a run of consecutive block ids is one contiguous byte
range: a homogeneous KV transfer of that run is a single descriptor (DESIGN.md §7).

The cache knows nothing about which request owns which block; the block pool decides that.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from trtdisagg.kv.page_table import (
    BufferEntry,
    LayerGroup,
    Layout,
    MapperKind,
    PageTable,
    PhysicalPool,
    PoolView,
)

BlockIds = torch.Tensor | Sequence[int]


@attrs.frozen(eq=False)
class SlotIndex:
    """Slots [N] as pool coordinates: block ids and offsets within the block, [N] each."""

    blocks: torch.Tensor
    offsets: torch.Tensor


class KVCache:
    def __init__(
        self,
        *,
        num_blocks: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        tokens_per_block: int,
        layout: Layout,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if min(num_blocks, num_layers, num_kv_heads, head_dim, tokens_per_block) <= 0:
            raise ValueError(
                f"KV cache dimensions must be positive: num_blocks={num_blocks} "
                f"num_layers={num_layers} num_kv_heads={num_kv_heads} head_dim={head_dim} "
                f"tokens_per_block={tokens_per_block}"
            )
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.tokens_per_block = tokens_per_block
        self.layout = layout
        self.dtype = dtype
        self.device = device
        if layout is Layout.HND:
            entry_shape = (num_kv_heads, tokens_per_block, head_dim)
        else:
            entry_shape = (tokens_per_block, num_kv_heads, head_dim)
        # Zeroed, not empty: a block read before it is written must not leak old memory into
        # byte-exact transfer comparisons.
        self.pool = torch.zeros(
            (num_blocks, num_layers, 2, *entry_shape), dtype=dtype, device=device
        )
        # Views made once: on the CPU a small step costs what its ops do, indexing included.
        # Per layer, K and V ([blocks, H, T, D] or [blocks, T, H, D]); per layer and kv head,
        # K and V [blocks, T, D] (what batched decode attention gathers from).
        self._planes = [(self.pool[:, i, 0], self.pool[:, i, 1]) for i in range(num_layers)]
        head_dim_of_plane = 1 if layout is Layout.HND else 2
        self._head_planes = [
            [
                (k.select(head_dim_of_plane, h), v.select(head_dim_of_plane, h))
                for h in range(num_kv_heads)
            ]
            for k, v in self._planes
        ]

    @staticmethod
    def bytes_per_block(
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        tokens_per_block: int,
        dtype: torch.dtype,
    ) -> int:
        """Bytes one block takes in a pool of this geometry (for sizing the pool)."""
        element = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * num_kv_heads * tokens_per_block * head_dim * element

    @property
    def element_bytes(self) -> int:
        return self.pool.element_size()

    @property
    def entry_bytes(self) -> int:
        """Bytes of K (or V) of one layer of one block."""
        return self.num_kv_heads * self.tokens_per_block * self.head_dim * self.element_bytes

    @property
    def layer_bytes(self) -> int:
        return 2 * self.entry_bytes

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def slot_index(self, slot_mapping: torch.Tensor) -> SlotIndex:
        """The blocks and in-block offsets of slots [N]."""
        return SlotIndex(
            blocks=torch.div(slot_mapping, self.tokens_per_block, rounding_mode="floor"),
            offsets=slot_mapping % self.tokens_per_block,
        )

    def write(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        index: SlotIndex | None = None,
    ) -> None:
        """Store new tokens' K and V ([N, H, D] each) at their slots ([N]); `index` is
        `slot_index(slot_mapping)`, when the caller has it already."""
        if index is None:
            index = self.slot_index(slot_mapping)
        blocks, offsets = index.blocks, index.offsets
        keys, values = self._planes[layer]
        # Advanced indices split by a slice put the token dim first: both index to [N, H, D].
        if self.layout is Layout.HND:
            keys[blocks, :, offsets] = k
            values[blocks, :, offsets] = v
        else:
            keys[blocks, offsets] = k
            values[blocks, offsets] = v

    def head_planes(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per kv head of `layer`, its K and V planes [blocks, T, D] (views of the pool)."""
        return self._head_planes[layer]

    def gather(
        self, layer: int, block_ids: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first `length` tokens held in `block_ids`, each [H, length, D]."""
        n = block_ids.shape[0]
        kv = self.pool[block_ids, layer]  # [n, 2, H, T, D] or [n, 2, T, H, D]
        if self.layout is Layout.HND:
            # [2, H, n, T, D] -> [2, H, n*T, D]
            kv = kv.permute(1, 2, 0, 3, 4).reshape(
                2, self.num_kv_heads, n * self.tokens_per_block, -1
            )
            kv = kv[:, :, :length]
        else:
            # [2, n*T, H, D] -> [2, H, length, D]
            kv = kv.transpose(0, 1).reshape(2, n * self.tokens_per_block, self.num_kv_heads, -1)
            kv = kv[:, :length].transpose(1, 2)
        return kv[0], kv[1]

    def page_table(self, global_layer_ids: Sequence[int]) -> PageTable:
        """Describe the pool to peers: one layer group holding `global_layer_ids` (local order)."""
        if len(global_layer_ids) != self.num_layers:
            raise ValueError(
                f"{len(global_layer_ids)} global layer ids for a pool of {self.num_layers} layers"
            )
        entries: list[BufferEntry] = []
        for layer in range(self.num_layers):
            entries.append(BufferEntry(local_layer_id=layer, offset=0, size=self.entry_bytes))
            entries.append(
                BufferEntry(local_layer_id=layer, offset=self.entry_bytes, size=self.entry_bytes)
            )
        on_gpu = self.pool.device.type == "cuda"
        pool = PhysicalPool(
            base_address=self.pool.data_ptr(),
            slot_bytes=self.block_bytes,
            num_slots=self.num_blocks,
            slot_stride_bytes=self.block_bytes,
            layer_stride_bytes=self.layer_bytes,
            memory_type="VRAM" if on_gpu else "DRAM",
            device_id=(self.pool.device.index or 0) if on_gpu else 0,
        )
        view = PoolView(
            pool_role=frozenset({"kv"}),
            mapper_kind=MapperKind.HND if self.layout is Layout.HND else MapperKind.NHD,
            buffer_entries=tuple(entries),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            tokens_per_block=self.tokens_per_block,
            element_bytes=self.element_bytes,
        )
        group = LayerGroup(
            group_id=0, global_layer_ids=tuple(global_layer_ids), pool=pool, views=(view,)
        )
        return PageTable(layer_groups=(group,))

    def read_block_bytes(self, block_id: int) -> bytes:
        """The raw bytes of one block (every local layer, K and V), for exact comparisons."""
        block = self.pool[block_id].contiguous().view(torch.uint8)
        return bytes(block.cpu().numpy().tobytes())

    def copy_blocks(
        self, src_block_ids: BlockIds, dst_block_ids: BlockIds, *, src: KVCache | None = None
    ) -> None:
        """Copy whole blocks from `src` (default: this cache) into this cache's `dst_block_ids`."""
        source = self if src is None else src
        if source.pool.shape[1:] != self.pool.shape[1:] or source.dtype != self.dtype:
            raise ValueError(
                f"block geometry differs: {tuple(source.pool.shape[1:])} {source.dtype} vs "
                f"{tuple(self.pool.shape[1:])} {self.dtype}"
            )
        src_ids = torch.as_tensor(src_block_ids, dtype=torch.long, device=source.pool.device)
        dst_ids = torch.as_tensor(dst_block_ids, dtype=torch.long, device=self.pool.device)
        if src_ids.shape != dst_ids.shape:
            raise ValueError(f"{src_ids.numel()} source blocks but {dst_ids.numel()} destinations")
        self.pool[dst_ids] = source.pool[src_ids].to(self.pool.device)
