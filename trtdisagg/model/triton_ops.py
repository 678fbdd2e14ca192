# mypy: disable-error-code="no-untyped-def"
"""Triton kernels for the fused path (CUDA, bf16/fp16): one kernel per operation.

Each kernel reproduces the rounding of the torch reference (`trtdisagg.model.ops.TorchOps`): a
bf16 op in torch computes in float32 and rounds once, so the kernels round to the activation
dtype at the same points. Only reduction order differs.

Attention, for every kind of step, is the paged attention kernel of
`trtdisagg.model.paged_attention`, fed by `AttentionMeta` (built once per forward by
`prepare_attention`). Its grid depends only on tensor sizes and it reads lengths from device
memory, so a captured CUDA graph serves any context length.

No kernel compiles while serving: arguments that vary from step to step are kept out of Triton's
specialisation key (`do_not_specialize*`), so each kernel meets a fixed set of variants, and
`warm_up` compiles every one of them at start-up. `compiled_variants` counts what is compiled.

Kernels are imported only on CUDA with Triton installed. Under `TRITON_INTERPRET=1` (CPU) they
run on CPU tensors, with dots in float32: the interpreter cannot multiply bf16 matrices.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import triton  # type: ignore[import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

from trtdisagg.kv.cache import KVCache
from trtdisagg.model import attention_meta
from trtdisagg.model.batch import AttentionMeta, DecodeMeta, ForwardBatch
from trtdisagg.model.dependent_launch import INTERPRET, await_previous, dependent_launch
from trtdisagg.model.gemm_plan import GemmPlan, WeightGemms, planned_linear, tune
from trtdisagg.model.ops import TorchOps
from trtdisagg.model.paged_attention import (
    KERNELS as ATTENTION_KERNELS,
)
from trtdisagg.model.paged_attention import (
    SPLIT_CHOICES,
    AttentionTiles,
    head_token_strides,
    paged_attention,
    short_tile,
)

if TYPE_CHECKING:
    from trtdisagg.model.llama import CausalLM

log = logging.getLogger(__name__)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    out_ptr,
    res_out_ptr,
    w_ptr,
    n_cols,
    x_stride,
    res_stride,
    out_stride,
    res_out_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    await_previous(DEPENDENT)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / n_cols
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * out_stride + cols, y, mask=mask)


@triton.jit
def _silu_mul_kernel(
    gu_ptr, out_ptr, n_cols, gu_stride, out_stride, BLOCK: tl.constexpr, DEPENDENT: tl.constexpr
):
    await_previous(DEPENDENT)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * gu_stride + n_cols + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    y = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * out_stride + cols, y, mask=mask)


# A step's slot mapping may be a view at any offset of a packed int buffer.
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _rope_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    q_out_ptr,
    kv_ptr,  # the pool, already offset to this layer's K
    q_row,
    k_row,
    v_row,
    cs_row,
    s_block,
    s_kv,
    s_head,
    s_tok,
    tokens_per_block,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    await_previous(DEPENDENT)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    half = D // 2
    partner_d = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    cos = tl.load(cos_ptr + t * cs_row + d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * cs_row + d, mask=dmask, other=0.0).to(tl.float32)

    hq = tl.arange(0, BLOCK_HQ)
    qmask = (hq[:, None] < HQ) & dmask[None, :]
    q_offs = t * q_row + hq[:, None] * D
    q = tl.load(q_ptr + q_offs + d[None, :], mask=qmask, other=0.0)
    qp = tl.load(q_ptr + q_offs + partner_d[None, :], mask=qmask, other=0.0)
    qa = (q.to(tl.float32) * cos[None, :]).to(q.dtype)
    qb = (qp.to(tl.float32) * sign[None, :] * sin[None, :]).to(q.dtype)
    q_rot = (qa.to(tl.float32) + qb.to(tl.float32)).to(q.dtype)
    tl.store(q_out_ptr + t * (HQ * D) + hq[:, None] * D + d[None, :], q_rot, mask=qmask)

    hk = tl.arange(0, BLOCK_HKV)
    kmask = (hk[:, None] < HKV) & dmask[None, :]
    k_offs = t * k_row + hk[:, None] * D
    k = tl.load(k_ptr + k_offs + d[None, :], mask=kmask, other=0.0)
    kp = tl.load(k_ptr + k_offs + partner_d[None, :], mask=kmask, other=0.0)
    ka = (k.to(tl.float32) * cos[None, :]).to(k.dtype)
    kb = (kp.to(tl.float32) * sign[None, :] * sin[None, :]).to(k.dtype)
    k_rot = (ka.to(tl.float32) + kb.to(tl.float32)).to(k.dtype)
    v = tl.load(v_ptr + t * v_row + hk[:, None] * D + d[None, :], mask=kmask, other=0.0)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    write = kmask & (slot >= 0)
    safe = tl.maximum(slot, 0)
    block = safe // tokens_per_block
    offset = safe % tokens_per_block
    dst = kv_ptr + block * s_block + offset * s_tok + hk[:, None] * s_head + d[None, :]
    tl.store(dst, k_rot, mask=write)
    tl.store(dst + s_kv, v, mask=write)


def _norm_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


class TritonOps(TorchOps):
    """The fused path's operations as Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""

    name = "triton"
    graph_safe = True

    def __init__(self, tiles: AttentionTiles | None = None) -> None:
        super().__init__()
        self.tiles = tiles or AttentionTiles()
        self.gemm_plan = GemmPlan()  # torch's own choices until `plan_gemms`

    def plan_gemms(self, gemms: Sequence[WeightGemms], rows: Sequence[int]) -> None:
        """Time the weight GEMMs of steps of `rows` rows and run them as the timings say from
        now on (`trtdisagg.model.gemm_plan`); call it before capturing graphs of such steps."""
        device = gemms[0].weights[0].device if gemms else torch.device("cpu")
        if device.type == "cuda" and not INTERPRET:
            self.gemm_plan = tune(gemms, rows, device)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return planned_linear(self.gemm_plan, x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm(x, None, weight, eps)[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, summed = self._norm(x, residual, weight, eps)
        assert summed is not None
        return normed, summed

    def _norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows, cols = x.shape
        assert x.stride(1) == 1
        out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
        summed = None if residual is None else torch.empty_like(out)
        block = triton.next_power_of_2(cols)
        dependent = dependent_launch(x.device)
        _rms_norm_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            out,
            summed if summed is not None else out,
            weight,
            cols,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            summed.stride(0) if summed is not None else 0,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            DEPENDENT=dependent,
            num_warps=_norm_warps(block),
            launch_pdl=dependent,
        )
        return out, summed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        cols = width // 2
        assert gate_up.stride(1) == 1
        # Spare rows: the down projection may run at more rows than the step has (gemm_plan).
        alloc = self.gemm_plan.alloc_rows(rows)
        out = torch.empty((alloc, cols), dtype=gate_up.dtype, device=gate_up.device)[:rows]
        block = 1024
        dependent = dependent_launch(gate_up.device)
        _silu_mul_kernel[(rows, triton.cdiv(cols, block))](
            gate_up, out, cols, gate_up.stride(0), out.stride(0), BLOCK=block,
            DEPENDENT=dependent, num_warps=4, launch_pdl=dependent,
        )  # fmt: skip
        return out

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
        n, num_heads, d = q.shape
        num_kv_heads = k.shape[1]
        for t in (q, k, v):
            assert t.stride(2) == 1 and t.stride(1) == d, "heads must be dense within a token"
        assert cos.stride(1) == 1 and cos.stride(0) == sin.stride(0)
        q_out = torch.empty((n, num_heads, d), dtype=q.dtype, device=q.device)
        if n == 0:
            return q_out
        pool = cache.pool
        s_head, s_tok = head_token_strides(cache)
        dependent = dependent_launch(q.device)
        _rope_kv_kernel[(n,)](
            q,
            k,
            v,
            cos,
            sin,
            slot_mapping,
            q_out,
            pool.select(1, layer),
            q.stride(0),
            k.stride(0),
            v.stride(0),
            cos.stride(0),
            pool.stride(0),
            pool.stride(2),
            s_head,
            s_tok,
            cache.tokens_per_block,
            HQ=num_heads,
            HKV=num_kv_heads,
            D=d,
            BLOCK_HQ=triton.next_power_of_2(num_heads),
            BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(d),
            DEPENDENT=dependent,
            num_warps=4,
            launch_pdl=dependent,
        )
        return q_out

    def prepare_attention(self, batch: ForwardBatch) -> AttentionMeta | None:
        return attention_meta.for_batch(batch)

    def paged_attention(
        self,
        q: torch.Tensor,
        cache: KVCache,
        layer: int,
        meta: AttentionMeta,
        *,
        num_splits: int | None = None,
    ) -> torch.Tensor:
        return paged_attention(
            q, cache, layer, meta, tiles=self.tiles, dot_fp32=INTERPRET, num_splits=num_splits,
            alloc_rows=self.gemm_plan.alloc_rows(q.shape[0]),
        )  # fmt: skip

    def decode_attention(
        self, q: torch.Tensor, cache: KVCache, layer: int, meta: DecodeMeta
    ) -> torch.Tensor:
        return self.paged_attention(q, cache, layer, attention_meta.from_decode(meta))

    def warm_up(self, model: CausalLM, cache: KVCache) -> None:
        """Launch every kernel over every variant that `model`'s forward can meet (compiling
        them), the way the forward calls it. Writes nothing into `cache`: slots are -1 and
        attention only reads."""
        layers = model.decoder_layers
        if not layers:
            return
        block = layers[0]
        attn, mlp = block.self_attn, block.mlp
        assert attn.qkv_weight is not None and mlp.gate_up_weight is not None, "call fuse() first"
        device, dtype, rows = cache.device, model.dtype, 3
        norm = block.input_layernorm
        x = torch.randn(rows, model.args.hidden_size, device=device, dtype=dtype)
        self.rms_norm(x, norm.weight, norm.eps)
        self.add_rms_norm(x, torch.randn_like(x), norm.weight, norm.eps)
        gate_up = mlp.gate_up_weight.shape[0]
        self.silu_mul(torch.randn(rows, gate_up, device=device, dtype=dtype))
        qkv = torch.randn(rows, attn.qkv_weight.shape[0], device=device, dtype=dtype)
        q, k, v = attn.split_qkv(qkv)
        cos = torch.randn(rows, attn.head_dim, device=device, dtype=dtype)
        sin = torch.randn_like(cos)
        for slot_dtype in (torch.int32, torch.int64):  # staging buffers send int32, runners int64
            slots = torch.full((rows,), -1, dtype=slot_dtype, device=device)
            q = self.rope_write_kv(
                q, k, v, cos=cos, sin=sin, cache=cache, layer=0, slot_mapping=slots
            )
        self.warm_up_attention(q, cache)

    def warm_up_attention(self, q: torch.Tensor, cache: KVCache) -> None:
        """Every variant of the attention kernels, for queries shaped like `q` [_, Hq, D]."""
        group = q.shape[1] // cache.num_kv_heads
        long_q = short_tile(group).tokens + 1
        tpb = cache.tokens_per_block
        table = [0] * -(-long_q // tpb)  # block 0: only read
        for q_lens in ([1], [1, long_q]):  # decode-only; with a long sequence
            meta = attention_meta.from_lists(
                q_lens, q_lens, [table] * len(q_lens), device=cache.device
            )
            x = torch.randn(sum(q_lens), *q.shape[1:], device=q.device, dtype=q.dtype)
            for splits in SPLIT_CHOICES:
                self.paged_attention(x, cache, 0, meta, num_splits=splits)


def compiled_variants() -> dict[str, int]:
    """How many variants of each kernel are compiled in this process (0 under the
    interpreter, which compiles nothing)."""
    kernels: dict[str, Any] = {
        "rms_norm": _rms_norm_kernel,
        "silu_mul": _silu_mul_kernel,
        "rope_kv": _rope_kv_kernel,
        **ATTENTION_KERNELS,
    }
    return {
        name: sum(len(entry[0]) for entry in getattr(kernel, "device_caches", {}).values())
        for name, kernel in kernels.items()
    }
