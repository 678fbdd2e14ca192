"""Decode operations that `torch.compile` can trace whole: the CPU's compiled decode step.

`TorchOps` keeps per-forward caches keyed on object identity and writes the KV pool with
indexing assignments; neither survives tracing (a write into a graph input would be
functionalised into a copy of the whole pool per layer). These ops derive everything from the
batch tensors, in the graph, and store KV through `trtdisagg::write_kv_slots`, an operator
whose schema declares the pool it mutates, so the compiled step writes the new tokens' slots in
place.

Decode attention reads the keys and values of every kv head of a layer in one gather from the
pool (`pool[block_table, layer]`), attends with two matmuls per layer and masks the positions
past each sequence's context. The arithmetic is `TorchOps`'s: float32 attention, the same
RoPE and norms, so greedy tokens agree with the eager step within float rounding.
"""

from __future__ import annotations

import torch

from trtdisagg.kv.cache import KVCache, Layout
from trtdisagg.model.batch import AttentionMeta, DecodeMeta, ForwardBatch
from trtdisagg.model.ops import RopeTables, TorchOps

# Defined through the dispatcher directly, with a CPU kernel: `torch.library.custom_op`'s Python
# wrappers (defaults, autograd, version bumps) cost more per call than the write itself.
_LIBRARY = torch.library.Library("trtdisagg", "DEF")
_LIBRARY.define(
    "write_kv_slots(Tensor(a!) pool, int layer, Tensor blocks, Tensor offsets, Tensor kv, "
    "bool heads_first) -> ()"
)


def _write_kv_slots(
    pool: torch.Tensor,
    layer: int,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    kv: torch.Tensor,
    heads_first: bool,
) -> None:
    """Store kv [N, 2, H, D] at (blocks, offsets) [N] of `layer` in `pool` ([blocks, layers, 2,
    H, T, D] when `heads_first`, else [blocks, layers, 2, T, H, D])."""
    if heads_first:
        pool[blocks, layer, :, :, offsets] = kv
    else:
        pool[blocks, layer, :, offsets] = kv


_LIBRARY.impl("write_kv_slots", _write_kv_slots, "CPU")
_LIBRARY.impl("write_kv_slots", lambda *args: None, "Meta")  # tracing: nothing to compute


class TracedOps(TorchOps):
    """`TorchOps` for a decode step traced by `torch.compile` (decode batches only)."""

    name = "traced"

    def rope_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        layer: int,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        num_heads = q.shape[1]
        rotated = RopeTables.of(cos, sin).apply(torch.cat((q, k), dim=1))  # q and k in one
        q, k = rotated.split((num_heads, rotated.shape[1] - num_heads), dim=1)
        t = cache.tokens_per_block
        slots = slot_mapping.long()
        blocks = torch.div(slots, t, rounding_mode="floor")
        torch.ops.trtdisagg.write_kv_slots(
            cache.pool,
            layer,
            blocks,
            slots - blocks * t,
            torch.stack((k, v), dim=1),
            cache.layout is Layout.HND,
        )
        return q

    def decode_attention(
        self, q: torch.Tensor, cache: KVCache, layer: int, meta: DecodeMeta
    ) -> torch.Tensor:
        """q [S, Hq, D] -> [S, Hq, D], every sequence's keys read through its block table row
        (its whole width: positions past `context_lens` are masked, not skipped)."""
        s, num_heads, d = q.shape
        table = meta.block_table.long()
        width = table.shape[1]
        t, h = cache.tokens_per_block, cache.num_kv_heads
        length = width * t
        kv = cache.pool[table.reshape(-1), layer].float()  # [S*W, 2, H, T, D] or [.., T, H, D]
        if cache.layout is Layout.HND:
            kv = kv.view(s, width, 2, h, t, d).permute(2, 0, 3, 1, 4, 5)
        else:
            kv = kv.view(s, width, 2, t, h, d).permute(2, 0, 4, 1, 3, 5)
        kv = kv.reshape(2, s, h, length, d)
        queries = q.float().view(s, h, num_heads // h, d)
        scores = torch.matmul(queries, kv[0].transpose(-1, -2)) * d**-0.5  # [S, H, group, L]
        beyond = torch.arange(length, device=q.device)[None, :] >= meta.context_lens[:, None]
        scores = scores.masked_fill(beyond[:, None, None, :], float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1), kv[1]).reshape(s, num_heads, d)
        return out.to(q.dtype)

    def prepare_attention(self, batch: ForwardBatch) -> AttentionMeta | None:
        if batch.decode is None:
            raise ValueError("traced ops run decode steps only")
        return None
