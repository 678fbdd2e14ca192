"""StagingBuffer: the device memory of the bounce path (`transfer/bounce.py`), and its copies.

One per rank, allocated and registered with the transfer agent once at start, next to the KV
pool and on the same device. ctx packs the runs it owns from its pool into it (`pack`); gen
scatters its canonical region back into its blocks (`unpack`). Both are torch copies on the
pool's device; neither touches a transfer agent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trtdisagg.kv.cache import KVCache
from trtdisagg.transfer.protocol.bounce import StagedRun


class StagingBuffer:
    def __init__(self, cache: KVCache, num_bytes: int) -> None:
        self.cache = cache
        self.tensor = torch.zeros(num_bytes, dtype=torch.uint8, device=cache.pool.device)

    @property
    def address(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def capacity(self) -> int:
        return int(self.tensor.numel())

    @property
    def memory_type(self) -> str:
        return "VRAM" if self.tensor.device.type == "cuda" else "DRAM"

    @property
    def device_id(self) -> int:
        return self.tensor.device.index or 0

    def pack(
        self,
        offset: int,
        runs: Sequence[StagedRun],
        block_ids: Sequence[int],
        *,
        first_token: int,
        num_tokens: int,
    ) -> None:
        """Copy tokens [first_token, num_tokens) of each run into the buffer from `offset` on,
        back to back; returns once the bytes are in memory (the agent reads them next)."""
        blocks = torch.tensor(list(block_ids), dtype=torch.long, device=self.tensor.device)
        position = offset
        gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for run in runs:
            if run.src_layer not in gathered:
                gathered[run.src_layer] = self.cache.gather(run.src_layer, blocks, num_tokens)
            part = gathered[run.src_layer][run.kv][
                run.src_head : run.src_head + run.num_heads, first_token:num_tokens
            ]
            raw = part.contiguous().view(torch.uint8).reshape(-1)
            if raw.numel() != run.num_bytes:
                raise ValueError(f"run of {raw.numel()} bytes, expected {run.num_bytes}")
            self.tensor[position : position + run.num_bytes].copy_(raw)
            position += run.num_bytes
        self.synchronize()

    def unpack(
        self,
        offset: int,
        block_ids: Sequence[int],
        *,
        first_token: int,
        num_tokens: int,
    ) -> None:
        """Scatter the canonical region at `offset` (`[layers, K/V, heads, tokens, head_dim]`,
        tokens [first_token, num_tokens)) into the blocks holding those tokens. `block_ids` are
        the request's blocks from `first_token // tokens_per_block` on."""
        cache = self.cache
        count = num_tokens - first_token
        shape = (cache.num_layers, 2, cache.num_kv_heads, count, cache.head_dim)
        size = cache.element_bytes * cache.num_layers * 2 * cache.num_kv_heads * count
        region = self.tensor[offset : offset + size * cache.head_dim]  # bytes of `shape`
        staged = region.view(cache.dtype).view(shape)
        tpb = cache.tokens_per_block
        skip = first_token // tpb
        positions = torch.arange(first_token, num_tokens, device=self.tensor.device)
        blocks = torch.tensor(list(block_ids), dtype=torch.long, device=self.tensor.device)
        slots = blocks[positions // tpb - skip] * tpb + positions % tpb
        for layer in range(cache.num_layers):
            keys = staged[layer, 0].transpose(0, 1)  # [tokens, heads, head_dim]
            values = staged[layer, 1].transpose(0, 1)
            cache.write(layer, keys, values, slots)

    def synchronize(self) -> None:
        if self.tensor.device.type == "cuda":
            torch.cuda.synchronize(self.tensor.device)
