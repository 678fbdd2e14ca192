"""Paged self-attention: project, rotate, write K/V into the cache, attend.

Projections run over all N flat tokens. On the reference path (and the fused path on torch ops,
i.e. CPU) the attention itself runs one sequence at a time, on K/V gathered from that sequence's
blocks. Query i of a sequence sits at position
`kv_len - q_len + i` and sees keys 0..that position, which covers prefill chunks, decode steps and
tails after a prefix-cache hit with one rule.

Under TP the q/k/v projections are column-split by heads and o_proj is row-split; its partial
sums are all-reduced before the (replicated) o_proj bias is added.

A decode-only batch (`batch.decode` set) attends batched instead: one padded gather and one SDPA
for all sequences. A mixed batch with `batch.decode_head` attends its leading decode rows the same
way and only its prefill chunks one sequence at a time. The fused path (`forward_fused`, after
`fuse()`) runs one q/k/v GEMM and the model's `TorchOps`/`TritonOps` for RoPE, the KV write and
attention; with `TritonOps` every step, of any mix, attends in one paged attention launch
(`trtdisagg.model.paged_attention`), and nothing runs per sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trtdisagg.kv.cache import KVCache
from trtdisagg.model.args import ModelArgs
from trtdisagg.model.batch import AttentionMeta, DecodeMeta, ForwardBatch, SeqSlice
from trtdisagg.model.layers import Linear, RMSNorm, all_reduce
from trtdisagg.model.ops import TorchOps, decode_attention_torch
from trtdisagg.model.parallel import Parallel
from trtdisagg.model.rope import apply_rope

DecodeAttention = Callable[[torch.Tensor, KVCache, int, DecodeMeta], torch.Tensor]
"""Batched decode attention: q [S, heads, D] of single-token sequences -> [S, heads, D]."""
WeightGemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, W) -> x W^T


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


def _causal_lower_right(q_len: int, kv_len: int) -> torch.Tensor:
    """torch's lower-right causal bias. Imported here, not at the top: its module imports
    torch._dynamo, about 2 s of CPU in every process, and only CUDA prefill uses it (a CUDA
    model imports it when built, so that no request pays it)."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(q_len, kv_len)


class Attention(nn.Module):
    def __init__(
        self, args: ModelArgs, *, parallel: Parallel, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        if device.type == "cuda":
            import torch.nn.attention.bias  # noqa: F401  (see _causal_lower_right)
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
        # Set by fuse(): [q; k; v] weights (and biases) in one tensor, q/k/v_proj become views.
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        """Concatenate the q/k/v weights into one GEMM operand; the projections' parameters
        become views of it, so the memory is not doubled and names are unchanged."""
        if self.qkv_weight is not None:
            return
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = _concat_into_views([p.weight for p in projections], projections, "weight")
        if self.q_proj.bias is not None:
            self.qkv_bias = _concat_into_views(
                [p.bias for p in projections if p.bias is not None], projections, "bias"
            )

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
        if batch.decode is not None:
            out = decode_attention_torch(q, cache, layer, batch.decode)
        else:
            out = self._attend_mixed(
                q, decode_attention_torch, masks=masks, batch=batch, cache=cache, layer=layer
            )
        return self._project_out(out)

    def forward_fused(
        self,
        x: torch.Tensor,
        *,
        ops: TorchOps,
        cos: torch.Tensor,
        sin: torch.Tensor,
        masks: tuple[torch.Tensor | None, ...],
        attention: AttentionMeta | None,
        batch: ForwardBatch,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        """`forward` after `fuse()`: one q/k/v GEMM, then `ops` for RoPE, KV write, attention.

        With `attention` (the Triton ops) every step attends in one `ops.paged_attention`
        call; without it (the torch ops) as `forward` does.
        """
        assert self.qkv_weight is not None, "call fuse() first"
        q, k, v = self.split_qkv(ops.linear(x, self.qkv_weight, self.qkv_bias))
        q = ops.rope_write_kv(
            q, k, v, cos=cos, sin=sin, cache=cache, layer=layer, slot_mapping=batch.slot_mapping
        )
        if attention is not None:
            out = ops.paged_attention(q, cache, layer, attention)
        elif batch.decode is not None:
            out = ops.decode_attention(q, cache, layer, batch.decode)
        else:
            out = self._attend_mixed(
                q, ops.decode_attention, masks=masks, batch=batch, cache=cache, layer=layer
            )
        return self._project_out(out, ops.linear)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection's output [N, (Hq + 2H) D] as q [N, Hq, D], k and v [N, H, D]
        (views, or the q/k norms' outputs)."""
        assert self.qkv_weight is not None, "call fuse() first"
        heads, kv_heads = self.num_heads, self.num_kv_heads
        q, k, v = qkv.view(qkv.shape[0], heads + 2 * kv_heads, self.head_dim).split(
            (heads, kv_heads, kv_heads), dim=1
        )
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _project_out(self, out: torch.Tensor, linear: WeightGemm = F.linear) -> torch.Tensor:
        y = all_reduce(linear(out.reshape(out.shape[0], -1), self.o_proj.weight), self.parallel)
        if self.o_proj.bias is not None:
            y = y + self.o_proj.bias
        return y

    def _attend_mixed(
        self,
        q: torch.Tensor,
        decode_attention: DecodeAttention,
        *,
        masks: tuple[torch.Tensor | None, ...],
        batch: ForwardBatch,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        """q [N, heads, D] -> [N, heads, D]: the leading single-token sequences batched
        (`batch.decode_head`), the others one at a time."""
        out = torch.empty_like(q)
        head = batch.decode_head
        first = 0
        if head is not None:
            first = head.block_table.shape[0]
            out[:first] = decode_attention(q[:first], cache, layer, head)
        self._attend_per_sequence(
            q, out, seqs=batch.seqs[first:], masks=masks[first:], cache=cache, layer=layer
        )
        return out

    def _attend_per_sequence(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        *,
        seqs: tuple[SeqSlice, ...],
        masks: tuple[torch.Tensor | None, ...],
        cache: KVCache,
        layer: int,
    ) -> None:
        """Attention one sequence at a time (any q_len), into the sequences' rows of `out`."""
        for seq, mask in zip(seqs, masks, strict=True):
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            keys, values = cache.gather(layer, seq.block_ids, seq.kv_len)  # [kv_heads, kv_len, D]
            if self.num_heads != self.num_kv_heads:
                # Expanded by hand: SDPA's enable_gqa needs torch 2.5, and we support 2.4.
                group = self.num_heads // self.num_kv_heads
                keys = keys.repeat_interleave(group, dim=0)
                values = values.repeat_interleave(group, dim=0)
            # SDPA's fused (flash) kernels, on CUDA and on the CPU, take 4-D inputs only: with
            # [heads, q_len, D] it falls back to its math kernel, which materialises
            # [heads, q_len, kv_len] scores (gigabytes for an 8k chunk of an 8B model; on the
            # CPU a 2048-token prompt of `tiny` prefilled several times slower: docs/BENCHMARKS.md,
            # "Prefill on the CPU"). On CUDA the flash kernel takes no explicit mask either, but a
            # lower-right causal bias, the same mask as `mask` (and as is_causal when q_len ==
            # kv_len): its causal mode is lower-right. The CPU's takes the bool mask.
            queries = q[rows].transpose(0, 1)[None]  # [1, heads, q_len, D]
            if q.is_cuda:
                causal = _causal_lower_right(seq.q_len, seq.kv_len) if seq.q_len > 1 else None
                attended = F.scaled_dot_product_attention(
                    queries, keys[None], values[None], attn_mask=causal
                )
            else:
                attended = F.scaled_dot_product_attention(
                    queries, keys[None], values[None],
                    attn_mask=mask, is_causal=mask is None and seq.q_len > 1,
                )  # fmt: skip
            out[rows] = attended[0].transpose(0, 1)


def _concat_into_views(
    tensors: list[torch.Tensor], owners: tuple[Linear, ...], name: str
) -> torch.Tensor:
    """One tensor holding `tensors` stacked along dim 0; each owner's `name` parameter is
    replaced by a view of its rows (freeing the original storage)."""
    fused = torch.cat(tensors, dim=0)
    start = 0
    for owner, tensor in zip(owners, tensors, strict=True):
        end = start + tensor.shape[0]
        setattr(owner, name, nn.Parameter(fused[start:end], requires_grad=False))
        start = end
    return fused
