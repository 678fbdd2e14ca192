# mypy: disable-error-code="no-untyped-def"
"""Triton kernels for the fused path (CUDA, bf16/fp16): one kernel per operation.

Each kernel reproduces the rounding of the torch reference (`trtdisagg.model.ops.TorchOps`): a
bf16 op in torch computes in float32 and rounds once, so the kernels round to the activation
dtype at the same points. Only reduction order differs.

Paged decode attention is split-K ("flash decoding"): program (sequence, kv head, split) walks
its share of the sequence's tokens through the block table, keeps an online softmax for the
`group` query heads of that kv head, and writes a partial result that a second kernel combines.
The grid depends only on the batch size, and lengths are read from device memory, so a captured
CUDA graph serves any context length. Token addresses come from the pool's strides, which covers
both the HND and NHD layouts and any tokens_per_block.

Kernels are imported only on CUDA with Triton installed. Under `TRITON_INTERPRET=1` (CPU) they
run on CPU tensors, with dots in float32: the interpreter cannot multiply bf16 matrices.
"""

from __future__ import annotations

import functools
import os

import torch
import triton  # type: ignore[import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

from trtdisagg.kv.cache import KVCache
from trtdisagg.kv.page_table import Layout
from trtdisagg.model.batch import DecodeMeta
from trtdisagg.model.ops import TorchOps

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
):
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
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, gu_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * gu_stride + n_cols + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    y = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * out_stride + cols, y, mask=mask)


@triton.jit
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
):
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


@triton.jit
def _decode_attn_kernel(
    q_ptr,
    kv_ptr,  # the pool, already offset to this layer's K
    table_ptr,
    lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    table_row,
    s_block,
    s_kv,
    s_head,
    s_tok,
    tokens_per_block,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + seq).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, length)

    rows = tl.arange(0, BLOCK_G)
    rmask = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    heads = kv_head * GROUP + rows
    q = tl.load(
        q_ptr + (seq * HQ + heads[:, None]) * D + d[None, :],
        mask=rmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    head_ptr = kv_ptr + kv_head * s_head
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        valid = toks < end
        page = tl.load(table_ptr + seq * table_row + toks // tokens_per_block, mask=valid, other=0)
        addr = page.to(tl.int64) * s_block + (toks % tokens_per_block) * s_tok
        lmask = valid[:, None] & dmask[None, :]
        k = tl.load(head_ptr + addr[:, None] + d[None, :], mask=lmask, other=0.0)
        v = tl.load(head_ptr + s_kv + addr[:, None] + d[None, :], mask=lmask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k)) * qk_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    omask = rmask[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / safe_l[:, None]
        tl.store(
            out_ptr + (seq * HQ + heads[:, None]) * D + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=omask,
        )
    else:
        part = (seq * HQ + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=omask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=rmask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=rmask)


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # seq * HQ + head
    sp = tl.arange(0, BLOCK_SPLITS)
    smask = sp < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    part = row * NUM_SPLITS + sp
    m = tl.load(part_ml_ptr + part * 2, mask=smask, other=float("-inf"))
    ell = tl.load(part_ml_ptr + part * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    has = m > float("-inf")
    weight = tl.where(has, tl.exp2(tl.where(has, m, 0.0) - tl.where(has, m_max, 0.0)), 0.0)
    total = tl.sum(weight * ell, 0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * D + d[None, :],
        mask=smask[:, None] & dmask[None, :],
        other=0.0,
    )
    out = tl.sum(weight[:, None] * acc, 0)
    out = out / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def decode_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per (sequence, kv head): enough programs for about two waves of the chip."""
    target = 2 * _num_sms(device)
    splits = 1
    while num_seqs * num_kv_heads * splits < target and splits < 32:
        splits *= 2
    return splits


def _norm_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


class TritonOps(TorchOps):
    """The fused path's operations as Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""

    name = "triton"
    graph_safe = True
    block_n = 64  # keys per inner iteration of decode attention

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
            num_warps=_norm_warps(block),
        )
        return out, summed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        cols = width // 2
        assert gate_up.stride(1) == 1
        out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(cols, block))](
            gate_up, out, cols, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
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
        s_head, s_tok = _head_token_strides(cache)
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
            num_warps=4,
        )
        return q_out

    def decode_attention(
        self, q: torch.Tensor, cache: KVCache, layer: int, meta: DecodeMeta
    ) -> torch.Tensor:
        return self.decode_attention_splits(q, cache, layer, meta, num_splits=None)

    def decode_attention_splits(
        self,
        q: torch.Tensor,
        cache: KVCache,
        layer: int,
        meta: DecodeMeta,
        *,
        num_splits: int | None,
        block_n: int | None = None,
    ) -> torch.Tensor:
        """`decode_attention` with the split count and key tile given (for tuning)."""
        s, num_heads, d = q.shape
        assert q.is_contiguous()
        num_kv_heads = cache.num_kv_heads
        group = num_heads // num_kv_heads
        splits = num_splits or decode_num_splits(s, num_kv_heads, q.device)
        out = torch.empty_like(q)
        if s == 0:
            return out
        if splits > 1:
            part_acc = torch.empty(
                (s * num_heads * splits, d), dtype=torch.float32, device=q.device
            )
            part_ml = torch.empty((s * num_heads * splits, 2), dtype=torch.float32, device=q.device)
        else:
            part_acc = part_ml = out  # unused
        table = meta.block_table
        assert table.stride(1) == 1
        pool = cache.pool
        s_head, s_tok = _head_token_strides(cache)
        block_d = triton.next_power_of_2(d)
        _decode_attn_kernel[(s, num_kv_heads, splits)](
            q,
            pool.select(1, layer),
            table,
            meta.context_lens,
            out,
            part_acc,
            part_ml,
            table.stride(0),
            pool.stride(0),
            pool.stride(2),
            s_head,
            s_tok,
            cache.tokens_per_block,
            d**-0.5 * 1.4426950408889634,
            HQ=num_heads,
            GROUP=group,
            D=d,
            BLOCK_G=max(16, triton.next_power_of_2(group)),
            BLOCK_D=block_d,
            BLOCK_N=block_n or self.block_n,
            NUM_SPLITS=splits,
            DOT_FP32=_INTERPRET,
            num_warps=4,
        )
        if splits > 1:
            _combine_splits_kernel[(s * num_heads,)](
                part_acc,
                part_ml,
                out,
                D=d,
                BLOCK_D=block_d,
                NUM_SPLITS=splits,
                BLOCK_SPLITS=triton.next_power_of_2(splits),
                num_warps=4,
            )
        return out


def _head_token_strides(cache: KVCache) -> tuple[int, int]:
    """Pool strides (elements) of one kv head and of one token within a block."""
    pool = cache.pool
    if cache.layout is Layout.HND:  # [blocks, layers, 2, H, T, D]
        return pool.stride(3), pool.stride(4)
    return pool.stride(4), pool.stride(3)  # [blocks, layers, 2, T, H, D]
