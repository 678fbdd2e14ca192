"""The fused-path operations: RMSNorm (+ residual add), SiLU-and-mul, RoPE + KV write, and
paged attention (batched for decode steps here; for every step in `TritonOps`).

`TorchOps` computes each with plain torch ops, in exactly the order of operations of the
reference modules (`RMSNorm`, `MLP`, `apply_rope` + `KVCache.write`), and runs on any device.
`TritonOps` (`trtdisagg.model.triton_ops`) does each in one kernel on CUDA; it is what makes a
decode step a few kernels per layer, and the only implementation that can be captured in a CUDA
graph (its attention reads lengths from device memory, never from the host).

`select_ops` picks one for a device and dtype.
"""

from __future__ import annotations

import importlib.util
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from trtdisagg.kv.cache import KVCache
from trtdisagg.kv.page_table import Layout
from trtdisagg.model.batch import AttentionMeta, DecodeMeta, ForwardBatch
from trtdisagg.model.rope import apply_rope

if TYPE_CHECKING:
    from trtdisagg.model.llama import CausalLM


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm.forward`: normalise in float32, scale in the activation dtype (HF's order)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def gather_decode_kv(
    cache: KVCache, layer: int, meta: DecodeMeta
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V of every sequence of a decode batch, padded: [S, H, L, D] each, and the bool
    mask [S, L] of real keys, L = `meta.max_context_len`."""
    tpb = cache.tokens_per_block
    length = meta.max_context_len
    num_blocks = math.ceil(length / tpb)
    table = meta.block_table[:, :num_blocks]
    s = table.shape[0]
    # index_select on the layer's view: several times faster on CPU than pool[table, layer].
    per_block = cache.pool.shape[2:]
    kv = cache.pool[:, layer].index_select(0, table.reshape(-1)).view(s, num_blocks, *per_block)
    if cache.layout is Layout.HND:
        kv = kv.permute(2, 0, 3, 1, 4, 5)  # [2, S, H, n, T, D]
    else:
        kv = kv.permute(2, 0, 4, 1, 3, 5)
    kv = kv.reshape(2, s, cache.num_kv_heads, num_blocks * tpb, cache.head_dim)[:, :, :, :length]
    positions = torch.arange(length, device=table.device)
    mask = positions[None, :] < meta.context_lens[:, None].to(positions.dtype)
    return kv[0], kv[1], mask


def decode_attention_torch(
    q: torch.Tensor, cache: KVCache, layer: int, meta: DecodeMeta
) -> torch.Tensor:
    """Batched decode attention: q [S, Hq, D] (one token per sequence) -> [S, Hq, D].

    The `Hq / H` query heads that share a kv head are that head's queries, so one SDPA call over
    [S, H, group, D] against the padded [S, H, L, D] keys needs no GQA expansion and no causal
    mask (a decode token sees every cached key), only the length mask. Every sequence must have
    `context_lens >= 1`.
    """
    s, num_heads, d = q.shape
    keys, values, mask = gather_decode_kv(cache, layer, meta)
    group = num_heads // cache.num_kv_heads
    out = F.scaled_dot_product_attention(
        q.view(s, cache.num_kv_heads, group, d), keys, values, attn_mask=mask[:, None, None, :]
    )
    return out.reshape(s, num_heads, d)


class TorchOps:
    """The fused path's operations in plain torch (any device, any dtype)."""

    name = "torch"
    # Whether a forward through these ops may be captured in a CUDA graph.
    graph_safe = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual): the residual add and the next norm."""
        summed = residual + x
        return rms_norm(summed, weight, eps), summed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[N, 2I] (gate then up) -> silu(gate) * up [N, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

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
        """Rotate q [N, Hq, D] and k [N, H, D], store k and v at their slots; return rotated q."""
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(layer, k, v, slot_mapping)
        return q

    def decode_attention(
        self, q: torch.Tensor, cache: KVCache, layer: int, meta: DecodeMeta
    ) -> torch.Tensor:
        return decode_attention_torch(q, cache, layer, meta)

    def prepare_attention(self, batch: ForwardBatch) -> AttentionMeta | None:
        """The step's metadata for `paged_attention`, built once per forward; None where these
        ops attend per sequence instead (the torch ops: `Attention._attend_mixed`)."""
        return None

    def paged_attention(
        self, q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMeta
    ) -> torch.Tensor:
        """Every sequence of the step in one call (q [N, Hq, D] -> [N, Hq, D])."""
        raise NotImplementedError(f"{self.name} ops attend per sequence")

    def warm_up(self, model: CausalLM, cache: KVCache) -> None:
        """Compile whatever the ops compile, before serving (nothing to do in torch)."""


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_ops(device: torch.device, dtype: torch.dtype) -> TorchOps:
    """Triton kernels on CUDA in half precision when Triton is installed, else plain torch."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and triton_available():
        from trtdisagg.model.triton_ops import TritonOps

        return TritonOps()
    return TorchOps()
