"""Float64 reference of paged attention over an `AttentionMeta` batch, for the kernel tests.

One sequence at a time through `KVCache.gather`, with the causal rule of `trtdisagg.model.batch`
(query i of a sequence sits at position kv_len - q_len + i and sees keys 0..that position).
"""

from __future__ import annotations

import math

import torch

from trtdisagg.kv.cache import KVCache
from trtdisagg.model.batch import AttentionMeta


def reference_attention(
    q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMeta
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 [N, Hq, D] output, bool [N] rows that belong to a sequence). Rows of a sequence
    with kv_len 0 are 0; padding rows are 0 and not marked."""
    n, num_heads, d = q.shape
    group = num_heads // cache.num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    owned = torch.zeros(n, dtype=torch.bool)
    cu_q = meta.cu_q.cpu().tolist()
    kv_lens = meta.kv_lens.cpu().tolist()
    table = meta.block_table.cpu()
    for s, kv_len in enumerate(kv_lens):
        start, end = cu_q[s], cu_q[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        owned[start:end] = True
        if kv_len == 0:
            continue
        blocks = table[s, : math.ceil(kv_len / cache.tokens_per_block)].long()
        keys, values = cache.gather(layer, blocks.to(cache.device), kv_len)
        keys = keys.double().cpu().repeat_interleave(group, dim=0)  # [Hq, L, D]
        values = values.double().cpu().repeat_interleave(group, dim=0)
        queries = q[start:end].double().cpu().transpose(0, 1)  # [Hq, q_len, D]
        scores = queries @ keys.transpose(1, 2) / math.sqrt(d)
        positions = torch.arange(kv_len - q_len, kv_len)
        hidden = torch.arange(kv_len)[None, :] > positions[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ values).transpose(0, 1)
    return out, owned
