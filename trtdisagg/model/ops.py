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
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import attrs
import torch
import torch.nn.functional as F

from trtdisagg.kv.cache import KVCache, SlotIndex
from trtdisagg.model.batch import AttentionMeta, DecodeMeta, ForwardBatch

if TYPE_CHECKING:
    from trtdisagg.model.gemm_plan import WeightGemms
    from trtdisagg.model.llama import CausalLM


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm.forward`: normalise in float32, scale in the activation dtype (HF's order).
    In float32 that is `F.rms_norm`'s arithmetic, in one op instead of six."""
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = _float(x)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


@attrs.frozen(eq=False)
class DecodeGather:
    """What every layer of a decode step reads its keys and values with: the blocks to gather
    (row-major over the batch's block table, `length` tokens per sequence) and the additive mask
    that hides the positions past each sequence's context ([S, 1, length])."""

    blocks: torch.Tensor
    bias: torch.Tensor
    length: int

    @classmethod
    def of(cls, meta: DecodeMeta, tokens_per_block: int, device: torch.device) -> DecodeGather:
        num_blocks = math.ceil(meta.max_context_len / tokens_per_block)
        length = num_blocks * tokens_per_block
        positions = torch.arange(length, device=device)
        beyond = positions[None, :] >= meta.context_lens[:, None].to(positions.dtype)
        bias = torch.zeros(beyond.shape[0], 1, length, device=device)
        return cls(
            blocks=meta.block_table[:, :num_blocks].reshape(-1).long(),
            bias=bias.masked_fill_(beyond[:, None, :], -math.inf),
            length=length,
        )


def decode_attention_torch(
    q: torch.Tensor,
    cache: KVCache,
    layer: int,
    meta: DecodeMeta,
    gather: DecodeGather | None = None,
) -> torch.Tensor:
    """Batched decode attention: q [S, Hq, D] (one token per sequence) -> [S, Hq, D].

    One kv head at a time: its keys and values of every sequence are gathered from the pool in
    one `index_select` each ([S, L, D], contiguous, L = the longest context padded to whole
    blocks), and the `Hq / H` query heads that share it attend with two batched matmuls and an
    additive length mask; no GQA expansion, no causal mask (a decode token sees every cached
    key). Gathering per head skips the copy that putting every head's keys side by side takes,
    the larger part of a CPU decode step. Every sequence must have `context_lens >= 1`.
    `gather` is `DecodeGather.of(meta, ...)`, when the caller has it already.
    """
    s, num_heads, d = q.shape
    if gather is None:
        gather = DecodeGather.of(meta, cache.tokens_per_block, q.device)
    blocks, bias, length = gather.blocks, gather.bias, gather.length
    num_kv_heads = cache.num_kv_heads
    group = num_heads // num_kv_heads
    outs = []
    for head, (k, v) in enumerate(cache.head_planes(layer)):  # [blocks, T, D] each
        keys = _float(k.index_select(0, blocks).view(s, length, d))
        values = _float(v.index_select(0, blocks).view(s, length, d))
        queries = _float(q[:, head * group : (head + 1) * group])  # [S, group, D]
        scores = torch.baddbmm(bias, queries, keys.transpose(1, 2), alpha=d**-0.5)
        outs.append(torch.bmm(scores.softmax(dim=-1), values))
    out = torch.cat(outs, dim=1)
    return out if out.dtype == q.dtype else out.to(q.dtype)


class RopeTables(NamedTuple):
    """`apply_rope`'s tables for one step's tokens, made once for every layer: rotating half of
    x is rolling it by half the head dim and negating the first half of sin, so a rotation is
    four ops, with the same arithmetic (`apply_rope`: x * cos + rotate_half(x) * sin). (A named
    tuple: `torch.compile` traces its construction, as it does not an attrs class's.)"""

    cos: torch.Tensor  # [N, 1, D]
    signed_sin: torch.Tensor  # [N, 1, D]: -sin on the first half, sin on the second
    half: int

    @classmethod
    def of(cls, cos: torch.Tensor, sin: torch.Tensor) -> RopeTables:
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cls(cos=cos[:, None, :], signed_sin=signed[:, None, :], half=half)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, heads, D] rotated."""
        return x * self.cos + x.roll(self.half, dims=-1) * self.signed_sin


def _float(x: torch.Tensor) -> torch.Tensor:
    # (a float32 tensor's `.float()` is still one op to dispatch)
    return x if x.dtype == torch.float32 else x.float()


class TorchOps:
    """The fused path's operations in plain torch (any device, any dtype).

    Every layer of a forward passes the same batch tensors (`slot_mapping`, `DecodeMeta`): what
    the layers derive from them (the slots' blocks and offsets, the decode gather) is built at the
    first layer and kept for the others, since on the CPU a small step costs what its op
    launches do. One runner's forwards run one at a time, so one slot each suffices. The keys
    are the objects themselves: a caller that refills one `slot_mapping` tensor or `DecodeMeta`
    for another step would be served the last step's slots and gather.
    """

    name = "torch"
    # Whether a forward through these ops may be captured in a CUDA graph.
    graph_safe = False

    def __init__(self) -> None:
        self._slots: tuple[torch.Tensor, SlotIndex] | None = None
        self._gather: tuple[DecodeMeta, DecodeGather] | None = None
        self._rope: tuple[torch.Tensor, RopeTables] | None = None

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

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A weight GEMM: x W^T (+ b)."""
        return F.linear(x, weight, bias)

    def plan_gemms(self, gemms: Sequence[WeightGemms], rows: Sequence[int]) -> None:
        """Choose how the weight GEMMs of small steps run, by timing them (CUDA ops only)."""

    def silu_mul_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The MLP's down projection of `silu_mul(gate_up)`."""
        return self.linear(self.silu_mul(gate_up), weight)

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
        num_heads = q.shape[1]
        if self._rope is None or self._rope[0] is not cos:
            self._rope = (cos, RopeTables.of(cos, sin))
        rotated = self._rope[1].apply(torch.cat((q, k), dim=1))  # one rotation for both
        q, k = rotated.split((num_heads, rotated.shape[1] - num_heads), dim=1)
        if self._slots is None or self._slots[0] is not slot_mapping:
            self._slots = (slot_mapping, cache.slot_index(slot_mapping))
        cache.write(layer, k, v, slot_mapping, index=self._slots[1])
        return q

    def decode_attention(
        self, q: torch.Tensor, cache: KVCache, layer: int, meta: DecodeMeta
    ) -> torch.Tensor:
        if self._gather is None or self._gather[0] is not meta:
            self._gather = (meta, DecodeGather.of(meta, cache.tokens_per_block, q.device))
        return decode_attention_torch(q, cache, layer, meta, self._gather[1])

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
