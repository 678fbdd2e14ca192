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


def decode_attention_torch(
    q: torch.Tensor, cache: KVCache, layer: int, meta: DecodeMeta
) -> torch.Tensor:
    """Batched decode attention: q [S, Hq, D] (one token per sequence) -> [S, Hq, D].

    One kv head at a time: its keys and values of every sequence are gathered from the pool in
    one `index_select` each ([S, L, D], contiguous, L = the longest context padded to whole
    blocks), and the `Hq / H` query heads that share it attend with two batched matmuls and an
    additive length mask; no GQA expansion, no causal mask (a decode token sees every cached
    key). Gathering per head skips the copy that putting every head's keys side by side takes,
    the larger part of a CPU decode step. Every sequence must have `context_lens >= 1`.
    """
    s, num_heads, d = q.shape
    tpb = cache.tokens_per_block
    num_blocks = math.ceil(meta.max_context_len / tpb)
    blocks = meta.block_table[:, :num_blocks].reshape(-1).long()
    length = num_blocks * tpb
    positions = torch.arange(length, device=q.device)
    beyond = positions[None, :] >= meta.context_lens[:, None].to(positions.dtype)
    bias = torch.zeros(s, 1, length, device=q.device).masked_fill_(beyond[:, None, :], -math.inf)
    num_kv_heads = cache.num_kv_heads
    group = num_heads // num_kv_heads
    layer_pool = cache.pool[:, layer]  # [blocks, 2, H, T, D] (HND) or [blocks, 2, T, H, D]
    outs = []
    for head in range(num_kv_heads):
        if cache.layout is Layout.HND:
            k, v = layer_pool[:, 0, head], layer_pool[:, 1, head]  # [blocks, T, D]
        else:
            k, v = layer_pool[:, 0, :, head], layer_pool[:, 1, :, head]
        keys = k.index_select(0, blocks).view(s, length, d).float()
        values = v.index_select(0, blocks).view(s, length, d).float()
        queries = q[:, head * group : (head + 1) * group].float()  # [S, group, D]
        scores = torch.baddbmm(bias, queries, keys.transpose(1, 2), alpha=d**-0.5)
        outs.append(torch.bmm(scores.softmax(dim=-1), values))
    return torch.cat(outs, dim=1).to(q.dtype)


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
