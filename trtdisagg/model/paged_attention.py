# mypy: disable-error-code="no-untyped-def"
"""Paged attention for any step in one Triton launch: a flat batch of query tokens from many
sequences (prefill chunks, decode rows, tails after a prefix-cache hit) against the KV pool.

Sequence s owns query rows `cu_q[s]..cu_q[s+1]` of the flat batch and `kv_lens[s]` keys reached
through row s of the block table; query i of it sits at position `kv_len - q_len + i` and sees keys
0..that position. Every length and offset is read from device memory and the grid depends only on
the sizes of the tensors (`AttentionMeta`), so a padded batch (sequences with q_len 0, tokens past
`cu_q[S]`) can be replayed from a CUDA graph captured for its size bucket.

A program attends a tile of rows that share one kv head: (query token, query head of that kv
head's GQA group), so every K/V tile it loads serves all the group's heads of several tokens. The
loop is FlashAttention-2's: online softmax in base 2 with float32 statistics and accumulator, and
the probabilities rounded to the activation dtype before the PV product (where the torch reference
rounds its softmax). Two kinds of program share the launch:

* a short sequence (q_len <= the short tile's tokens: decode rows) takes one 16-row tile, and its
  keys are split over up to NUM_SPLITS programs ("flash decoding") so that a small batch fills the
  chip, each taking at least MIN_SPLIT_KEYS keys. Each split stores its partial result and counts
  itself in; the split that arrives last merges them, so no second launch waits on the first;
* a longer one takes tiles of `long_rows` rows, each walking first the key blocks that every row
  of the tile sees (no mask), then the blocks on the causal diagonal. A tile finds its sequence by
  binary search over cu_q: tile t belongs to the last s with `cu_q[s] // LONG_TOKENS + s <= t`,
  which bounds the tile count by `N // LONG_TOKENS + S` without a tile map; S and N count the
  live sequences and their tokens, so a padded step's spare programs stop at once. Tiles launch
  last first, so the programs that see the most keys start earliest.

Triton compiles one variant per specialisation key: the argument types, ints equal to 1 or
divisible by 16, pointers aligned to 16 bytes, and constexprs. What varies from step to step (the
sequence count, the block-table width, the metadata pointers, which may be views into one packed
buffer) is kept out of the key, so a model meets `2 x len(SPLIT_CHOICES)` variants of the kernel;
`warm_up` compiles them all.
"""

from __future__ import annotations

import functools

import attrs
import torch
import triton  # type: ignore[import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

from trtdisagg.kv.cache import KVCache
from trtdisagg.kv.page_table import Layout
from trtdisagg.model.batch import AttentionMeta
from trtdisagg.model.dependent_launch import await_previous, dependent_launch

SPLIT_CHOICES = (1, 2, 4, 8, 16, 32)
# Keys a split takes at least: a split of fewer keys costs more in its fixed work (q, partial
# results, the combine) than it saves, so a short context uses fewer of the launched splits.
MIN_SPLIT_KEYS = tl.constexpr(128)
SHORT_ROWS = 16  # a short sequence's tile: the smallest M of a tensor-core dot

# Arguments kept out of the specialisation key (see the module docstring).
MAIN_DYNAMIC_INTS = ("num_seqs", "table_row")
MAIN_DYNAMIC_POINTERS = ("cu_q_ptr", "kv_lens_ptr", "table_ptr", "live_ptr")
# Split-arrival counters kept per device; enough for 512 sequences of 8 kv heads. A buffer
# outgrown stays allocated: CUDA graphs captured earlier keep launching on it.
MIN_ARRIVAL_COUNTERS = 4096
_arrival_buffers: dict[torch.device, list[torch.Tensor]] = {}


@attrs.frozen(kw_only=True)
class AttentionTiles:
    """Tile sizes and launch options of the attention kernel (fixed per process)."""

    # A long sequence's tile: rows (query token x group head), warps and pipeline depth. Small
    # tiles keep several programs on each SM: a step's prompt of a few hundred tokens has few
    # tiles, each walking few key blocks, so latency, not the dots, bounds it; an 8k prompt runs
    # as fast as with 128-row tiles of 8 warps (docs/BENCHMARKS.md, "Attention tiles").
    long_rows: int = 64
    block_n: int = 64  # keys per inner iteration
    long_warps: int = 4  # warps of a launch that has long tiles
    short_warps: int = 4  # warps of a launch of short tiles only (decode steps)
    num_stages: int = 2  # software pipelining depth of the key loop, with long tiles
    # A decode program walks few key blocks, so a deeper pipeline buys no overlap, and its
    # shared memory leaves fewer programs on each SM (docs/BENCHMARKS.md, "Decode step").
    short_stages: int = 2

    def __attrs_post_init__(self) -> None:
        for name in ("long_rows", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")


@attrs.frozen(kw_only=True)
class TileShape:
    rows: int  # tile rows, a power of two
    tokens: int  # query tokens per tile: rows // group


def short_tile(group: int) -> TileShape:
    rows = max(SHORT_ROWS, triton.next_power_of_2(group))
    return TileShape(rows=rows, tokens=rows // group)


def long_tile(group: int, tiles: AttentionTiles) -> TileShape:
    rows = max(tiles.long_rows, triton.next_power_of_2(group))
    return TileShape(rows=rows, tokens=rows // group)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def num_splits_for(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Key splits per short sequence: enough programs for about two waves of the chip, from
    `SPLIT_CHOICES` only (each is a compiled variant)."""
    target = 2 * _num_sms(device)
    for splits in SPLIT_CHOICES:
        if num_seqs * num_kv_heads * splits >= target:
            return splits
    return SPLIT_CHOICES[-1]


@triton.jit
def _key_block(
    acc,
    m_i,
    l_i,
    q,
    pos,
    head_ptr,
    table_row_ptr,
    n0,
    key_hi,
    s_block,
    s_kv,
    s_tok,
    tokens_per_block,
    qk_scale,
    d,
    dmask,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One step of the online softmax over keys n0..n0+BLOCK_N; MASKED applies `key < key_hi`
    and the causal rule `key <= pos` (the unmasked blocks are seen by every row)."""
    toks = n0 + tl.arange(0, BLOCK_N)
    valid = toks < key_hi
    page = tl.load(table_row_ptr + toks // tokens_per_block, mask=valid, other=0)
    addr = page.to(tl.int64) * s_block + (toks % tokens_per_block) * s_tok
    kv_mask = valid[:, None] & dmask[None, :]
    k = tl.load(head_ptr + addr[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(head_ptr + s_kv + addr[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        seen = valid[None, :] & (toks[None, :] <= pos[:, None])
        scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row that has seen no key yet keeps m = -inf; shifting by 0 then gives p = 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(scores - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _attend_tile(
    q_ptr,
    head_ptr,
    table_row_ptr,
    q_start,
    q_len,
    kv_len,
    tok0,
    key_lo,
    key_hi,
    kv_head,
    q_row,
    s_block,
    s_kv,
    s_tok,
    tokens_per_block,
    qk_scale,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Attention of one tile (query tokens tok0..tok0+TOKENS of a sequence, the GROUP heads of
    `kv_head`) over its keys in [key_lo, key_hi), key_lo a multiple of BLOCK_N. Returns the
    unnormalised accumulator, the row maxima and sums, and each row's offset and mask in q."""
    r = tl.arange(0, ROWS)
    tok = tok0 + r // GROUP
    row_ok = (r < TOKENS * GROUP) & (tok < q_len)
    heads = kv_head * GROUP + r % GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q_offs = (q_start + tok).to(tl.int64) * q_row + heads * D
    q = tl.load(
        q_ptr + q_offs[:, None] + d[None, :], mask=row_ok[:, None] & dmask[None, :], other=0.0
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    pos = kv_len - q_len + tok
    first = kv_len - q_len + tok0
    last = kv_len - q_len + tl.minimum(tok0 + TOKENS, q_len) - 1
    # Blocks below the first query's position are seen whole by every row.
    unmasked_end = tl.maximum(key_lo, tl.minimum(first + 1, key_hi) // BLOCK_N * BLOCK_N)
    masked_end = tl.minimum(key_hi, last + 1)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(key_lo, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _key_block(
            acc, m_i, l_i, q, pos, head_ptr, table_row_ptr, n0, key_hi, s_block, s_kv, s_tok,
            tokens_per_block, qk_scale, d, dmask, BLOCK_N, False, DOT_FP32,
        )  # fmt: skip
    for n0 in range(unmasked_end, masked_end, BLOCK_N):
        acc, m_i, l_i = _key_block(
            acc, m_i, l_i, q, pos, head_ptr, table_row_ptr, n0, key_hi, s_block, s_kv, s_tok,
            tokens_per_block, qk_scale, d, dmask, BLOCK_N, True, DOT_FP32,
        )  # fmt: skip
    return acc, m_i, l_i, q_offs, row_ok


@triton.jit
def _split_keys(kv_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per split of a short sequence: whole key blocks, at least MIN_SPLIT_KEYS. The
    splits past the context get none: they neither attend nor take part in the combine."""
    per_split = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    return tl.maximum(per_split, tl.cdiv(MIN_SPLIT_KEYS, BLOCK_N) * BLOCK_N)


@triton.jit
def _store_rows(out_ptr, q_offs, row_ok, acc, l_i, D: tl.constexpr, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no key seen (padding): 0
    tl.store(
        out_ptr + q_offs[:, None] + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (d < D)[None, :],
    )


@triton.jit
def _split_rows(seq, split, kv_head, num_kv_heads, NUM_SPLITS: tl.constexpr, SHORT_M: tl.constexpr):
    """Rows of the partial-result buffers that hold one split of one (sequence, kv head)."""
    part = ((seq * NUM_SPLITS + split) * num_kv_heads + kv_head) * SHORT_M
    return part.to(tl.int64) + tl.arange(0, SHORT_M)


@triton.jit
def _store_split(
    part_acc_ptr, part_ml_ptr, seq, split, kv_head, num_kv_heads, row_ok, acc, m_i, l_i,
    NUM_SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SHORT_M: tl.constexpr,
):  # fmt: skip
    part = _split_rows(seq, split, kv_head, num_kv_heads, NUM_SPLITS, SHORT_M)
    d = tl.arange(0, BLOCK_D)
    # Only the tile's real rows: with one token of a small GQA group, most of the 16 are empty.
    tl.store(
        part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & (d < D)[None, :]
    )
    tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits(
    part_acc_ptr, part_ml_ptr, out_ptr, q_offs, row_ok, seq, kv_head, num_kv_heads, used,
    NUM_SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SHORT_M: tl.constexpr,
):  # fmt: skip
    """The output rows of one (sequence, kv head) from the partial results of its `used`
    splits, read past L1: other programs wrote them."""
    d = tl.arange(0, BLOCK_D)
    acc_mask = row_ok[:, None] & (d < D)[None, :]
    m = tl.full([SHORT_M], float("-inf"), tl.float32)
    ell = tl.zeros([SHORT_M], tl.float32)
    acc = tl.zeros([SHORT_M, BLOCK_D], tl.float32)
    for split in range(0, used):
        part = _split_rows(seq, split, kv_head, num_kv_heads, NUM_SPLITS, SHORT_M)
        m_s = tl.load(
            part_ml_ptr + part * 2, mask=row_ok, other=float("-inf"), cache_modifier=".cg"
        )
        l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
        a_s = tl.load(
            part_acc_ptr + part[:, None] * D + d[None, :], mask=acc_mask, other=0.0,
            cache_modifier=".cg",
        )  # fmt: skip
        m_new = tl.maximum(m, m_s)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_shift)
        beta = tl.exp2(m_s - m_shift)
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        ell = ell * alpha + l_s * beta
        m = m_new
    _store_rows(out_ptr, q_offs, row_ok, acc, ell, D, BLOCK_D)


@triton.jit(
    do_not_specialize=MAIN_DYNAMIC_INTS, do_not_specialize_on_alignment=MAIN_DYNAMIC_POINTERS
)
def _paged_attention_kernel(
    q_ptr,
    kv_ptr,  # the pool, already offset to this layer's K
    out_ptr,
    cu_q_ptr,
    kv_lens_ptr,
    table_ptr,
    live_ptr,
    part_acc_ptr,
    part_ml_ptr,
    arrivals_ptr,
    num_seqs,
    table_row,
    q_row,
    s_block,
    s_kv,
    s_head,
    s_tok,
    tokens_per_block,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SHORT_M: tl.constexpr,
    SHORT_TOKENS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    LONG_M: tl.constexpr,
    LONG_TOKENS: tl.constexpr,
    HAS_LONG: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    await_previous(DEPENDENT)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    head_ptr = kv_ptr + kv_head * s_head
    short_programs = num_seqs * NUM_SPLITS
    if pid < short_programs:
        seq = pid // NUM_SPLITS
        split = pid % NUM_SPLITS
        # Loaded together: none of the three waits for another.
        q_start = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_start
        kv_len = tl.load(kv_lens_ptr + seq)
        if (q_len > 0) & (q_len <= SHORT_TOKENS):
            per_split = _split_keys(kv_len, NUM_SPLITS, BLOCK_N)
            used = tl.cdiv(kv_len, per_split)
            key_lo = split * per_split
            if (key_lo < kv_len) | (split == 0):  # a padding row (no keys) comes out 0
                key_hi = tl.minimum(key_lo + per_split, kv_len)
                acc, m_i, l_i, q_offs, row_ok = _attend_tile(
                    q_ptr, head_ptr, table_ptr + seq.to(tl.int64) * table_row, q_start, q_len,
                    kv_len, 0, key_lo, key_hi, kv_head, q_row, s_block, s_kv, s_tok,
                    tokens_per_block, qk_scale, GROUP, D, BLOCK_D, SHORT_M, SHORT_TOKENS,
                    BLOCK_N, DOT_FP32,
                )  # fmt: skip
                if used <= 1:
                    _store_rows(out_ptr, q_offs, row_ok, acc, l_i, D, BLOCK_D)
                else:
                    _store_split(
                        part_acc_ptr, part_ml_ptr, seq, split, kv_head, num_kv_heads, row_ok,
                        acc, m_i, l_i, NUM_SPLITS, D, BLOCK_D, SHORT_M,
                    )  # fmt: skip
                    # Every thread's partial stores come before the arrival, which releases
                    # them to the program that arrives last (CUTLASS's split-K semaphore).
                    tl.debug_barrier()
                    arrivals = arrivals_ptr + seq * num_kv_heads + kv_head
                    if tl.atomic_add(arrivals, 1, sem="acq_rel") == used - 1:
                        tl.store(arrivals, 0)  # ready for the next launch
                        _merge_splits(
                            part_acc_ptr, part_ml_ptr, out_ptr, q_offs, row_ok, seq, kv_head,
                            num_kv_heads, used, NUM_SPLITS, D, BLOCK_D, SHORT_M,
                        )  # fmt: skip
    elif HAS_LONG:
        # The first `live_tiles` long programs take the live sequences' tiles, last tile first.
        live = tl.load(live_ptr)
        live_tiles = tl.load(cu_q_ptr + num_seqs) // LONG_TOKENS + live  # padding adds no token
        tile = live_tiles - 1 - (pid - short_programs)
        if tile >= 0:
            lo = tl.full([], 0, tl.int32)
            hi = lo + live
            while hi - lo > 1:
                mid = (lo + hi) // 2
                first_tile = tl.load(cu_q_ptr + mid) // LONG_TOKENS + mid
                go_right = first_tile <= tile
                lo = tl.where(go_right, mid, lo)
                hi = tl.where(go_right, hi, mid)
            seq = lo
            q_start = tl.load(cu_q_ptr + seq)
            q_len = tl.load(cu_q_ptr + seq + 1) - q_start
            tok0 = (tile - (q_start // LONG_TOKENS + seq)) * LONG_TOKENS
            if (q_len > SHORT_TOKENS) & (tok0 < q_len):
                kv_len = tl.load(kv_lens_ptr + seq)
                acc, m_i, l_i, q_offs, row_ok = _attend_tile(
                    q_ptr, head_ptr, table_ptr + seq.to(tl.int64) * table_row, q_start, q_len,
                    kv_len, tok0, 0, kv_len, kv_head, q_row, s_block, s_kv, s_tok,
                    tokens_per_block, qk_scale, GROUP, D, BLOCK_D, LONG_M, LONG_TOKENS, BLOCK_N,
                    DOT_FP32,
                )  # fmt: skip
                _store_rows(out_ptr, q_offs, row_ok, acc, l_i, D, BLOCK_D)


def _arrival_counters(device: torch.device, needed: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (sequence, kv head) of a launch: how many of its splits
    have stored their partial results. The kernel zeroes each counter again as it merges."""
    buffers = _arrival_buffers.setdefault(device, [])
    if buffers and buffers[-1].numel() >= needed:
        return buffers[-1]
    zeroed = torch.zeros(max(needed, MIN_ARRIVAL_COUNTERS), dtype=torch.int32, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return zeroed  # the graph zeroes its own counters on each replay: correct, not shared
    buffers.append(zeroed)
    return zeroed


def head_token_strides(cache: KVCache) -> tuple[int, int]:
    """Pool strides (elements) of one kv head and of one token within a block."""
    pool = cache.pool
    if cache.layout is Layout.HND:  # [blocks, layers, 2, H, T, D]
        return pool.stride(3), pool.stride(4)
    return pool.stride(4), pool.stride(3)  # [blocks, layers, 2, T, H, D]


def paged_attention(
    q: torch.Tensor,
    cache: KVCache,
    layer: int,
    meta: AttentionMeta,
    *,
    tiles: AttentionTiles,
    dot_fp32: bool,
    num_splits: int | None = None,
    alloc_rows: int = 0,
) -> torch.Tensor:
    """q [N, Hq, D] (dense) -> [N, Hq, D]: every sequence of `meta` attends its keys in `cache`.

    Rows of tokens past `cu_q[S]` (padding) are left unwritten. `num_splits` overrides the key
    split of short sequences (for tuning); `dot_fp32` runs the dots in float32 (the interpreter
    cannot multiply bf16 matrices). The output is the first N rows of max(N, `alloc_rows`)
    allocated, so that the o projection may run at more rows (`gemm_plan`).
    """
    n, num_heads, d = q.shape
    if not q.is_contiguous():
        raise ValueError("q must be dense: [N, heads, head_dim] contiguous")
    out = q.new_empty((max(n, alloc_rows), num_heads, d))[:n]
    num_seqs = meta.num_seqs
    if n == 0 or num_seqs == 0:
        return out
    num_kv_heads = cache.num_kv_heads
    group = num_heads // num_kv_heads
    short, long = short_tile(group), long_tile(group, tiles)
    splits = num_splits or num_splits_for(num_seqs, num_kv_heads, q.device)
    has_long = meta.max_q_len > short.tokens
    programs = num_seqs * splits + (n // long.tokens + num_seqs if has_long else 0)
    if splits > 1:
        rows = num_seqs * splits * num_kv_heads * short.rows
        part_acc = torch.empty((rows, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((rows, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    arrivals = _arrival_counters(q.device, num_seqs * num_kv_heads)
    pool = cache.pool
    s_head, s_tok = head_token_strides(cache)
    block_d = triton.next_power_of_2(d)
    table = meta.block_table
    dependent = dependent_launch(q.device)
    _paged_attention_kernel[(programs, num_kv_heads)](
        q, pool.select(1, layer), out, meta.cu_q, meta.kv_lens, table, meta.live, part_acc,
        part_ml, arrivals, num_seqs, table.stride(0), q.stride(0), pool.stride(0),
        pool.stride(2), s_head, s_tok, cache.tokens_per_block, d**-0.5 * 1.4426950408889634,
        GROUP=group, D=d, BLOCK_D=block_d, SHORT_M=short.rows, SHORT_TOKENS=short.tokens,
        NUM_SPLITS=splits, LONG_M=long.rows, LONG_TOKENS=long.tokens, HAS_LONG=has_long,
        BLOCK_N=tiles.block_n, DOT_FP32=dot_fp32, DEPENDENT=dependent,
        num_warps=tiles.long_warps if has_long else tiles.short_warps,
        num_stages=tiles.num_stages if has_long else tiles.short_stages,
        launch_pdl=dependent,
    )  # fmt: skip
    return out


KERNELS = {"paged_attention": _paged_attention_kernel}
