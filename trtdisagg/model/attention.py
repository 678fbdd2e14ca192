"""Paged self-attention: project, rotate, write K/V into the cache, attend per sequence.

Projections run over all N flat tokens; the attention itself runs one sequence at a time, on K/V
gathered from that sequence's blocks. Query i of a sequence sits at position
`kv_len - q_len + i` and sees keys 0..that position, which covers prefill chunks, decode steps and
tails after a prefix-cache hit with one rule.

Under TP the q/k/v projections are column-split by heads and o_proj is row-split; its partial
sums are all-reduced before the (replicated) o_proj bias is added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trtdisagg.kv.cache import KVCache
from trtdisagg.model.args import ModelArgs
from trtdisagg.model.batch import ForwardBatch, SeqSlice
from trtdisagg.model.layers import Linear, RMSNorm, all_reduce
from trtdisagg.model.parallel import Parallel
from trtdisagg.model.rope import apply_rope


def causal_mask(seq: SeqSlice, device: torch.device) -> torch.Tensor | None:
    """bool [q_len, kv_len], True where a query may attend.

    None when no explicit mask is needed: a single query sees every key, and when no key is
    cached before the queries SDPA's own `is_causal` (which aligns the diagonal top-left) is the
    same mask and lets fused kernels run.
    """
    if seq.q_len == 1 or seq.q_len == seq.kv_len:
        return None
    mask = torch.ones(seq.q_len, seq.kv_len, dtype=torch.bool, device=device)
    return mask.tril(diagonal=seq.kv_len - seq.q_len)


class Attention(nn.Module):
    def __init__(
        self, args: ModelArgs, *, parallel: Parallel, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.head_dim = args.head_dim
        q_start, q_end = parallel.even_range(args.num_heads, what="num_attention_heads")
        kv_start, kv_end = parallel.kv_head_range(args.num_kv_heads)
        self.num_heads = q_end - q_start
        self.num_kv_heads = kv_end - kv_start
        hidden, d = args.hidden_size, args.head_dim
        bias = args.attention_bias
        self.q_proj = Linear(hidden, self.num_heads * d, bias=bias, dtype=dtype, device=device)
        self.k_proj = Linear(hidden, self.num_kv_heads * d, bias=bias, dtype=dtype, device=device)
        self.v_proj = Linear(hidden, self.num_kv_heads * d, bias=bias, dtype=dtype, device=device)
        self.o_proj = Linear(
            self.num_heads * d, hidden, bias=args.o_proj_bias, dtype=dtype, device=device
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if args.qk_norm:
            self.q_norm = RMSNorm(d, eps=args.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(d, eps=args.rms_norm_eps, dtype=dtype, device=device)

    def forward(
        self,
        x: torch.Tensor,
        *,
        cos: torch.Tensor,
        sin: torch.Tensor,
        masks: tuple[torch.Tensor | None, ...],
        batch: ForwardBatch,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]; writes this layer's new K/V into `cache` at `layer`."""
        n, d = x.shape[0], self.head_dim
        q = self.q_proj(x).view(n, self.num_heads, d)
        k = self.k_proj(x).view(n, self.num_kv_heads, d)
        v = self.v_proj(x).view(n, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(layer, k, v, batch.slot_mapping)

        out = torch.empty_like(q)  # [N, heads, D]
        for seq, mask in zip(batch.seqs, masks, strict=True):
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            keys, values = cache.gather(layer, seq.block_ids, seq.kv_len)  # [kv_heads, kv_len, D]
            if self.num_heads != self.num_kv_heads:
                # Expanded by hand: SDPA's enable_gqa needs torch 2.5, and we support 2.4.
                group = self.num_heads // self.num_kv_heads
                keys = keys.repeat_interleave(group, dim=0)
                values = values.repeat_interleave(group, dim=0)
            attended = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1),  # [heads, q_len, D]
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None and seq.q_len > 1,
            )
            out[rows] = attended.transpose(0, 1)

        y = all_reduce(F.linear(out.view(n, -1), self.o_proj.weight), self.parallel)
        if self.o_proj.bias is not None:
            y = y + self.o_proj.bias
        return y
