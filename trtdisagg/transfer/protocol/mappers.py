"""Mappers: (source blocks, destination blocks) -> merged byte fragments for one rank pair. Pure.

A mapper is built once per (ctx rank view, gen rank view) pair at registration, from both page
tables' registered sizes and the overlapping layers and heads; an unsupported pairing is refused
there (`UnsupportedPairing`, naming both values). One formula serves every pairing: a row, one
head of one token, lies at `head * head_bytes + token * token_bytes` inside a K or V entry, in
each side's own layout (HND `[H, T, D]`, NHD `[T, H, D]`). A mapper copies the rows of the heads
both ranks hold; rows that continue each other on BOTH sides merge, which gives per block:

    same layout, every head (or REPLICATED views)   whole K/V entries
    HND, a head subset                              one head range per layer and K/V
    NHD, a head subset                              one head range per layer, K/V and token
    HND on one side, NHD on the other               one head of one token per piece

At request time `map_blocks` places each aligned block pair's runs (computed once per token
count) with numpy and merges again, so a homogeneous transfer between runs of consecutive blocks
is one fragment per run.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from trtdisagg.kv.page_table import LayerGroup, MapperKind, PoolView
from trtdisagg.transfer.errors import MappingError, UnsupportedPairing
from trtdisagg.transfer.protocol.fragments import BlockRun, Fragments, Runs, empty_runs, merge_runs

IdArray = npt.NDArray[np.int64]  # block ids (or token counts), one per block


@attrs.frozen(kw_only=True)
class ViewGeometry:
    """Byte geometry of one pool view, derived from a page table and checked (`of`)."""

    kind: MapperKind
    base_address: int
    num_slots: int
    slot_stride: int
    layer_stride: int
    entry_offsets: tuple[int, ...]  # K, V offsets inside a layer; the same for every layer
    num_heads: int  # local heads
    tokens_per_block: int
    row_bytes: int  # one head of one token: head_dim * element_bytes

    @classmethod
    def of(cls, group: LayerGroup, view: PoolView) -> ViewGeometry:
        """Check `view` of `group` and derive its geometry; UnsupportedPairing if inconsistent."""
        name = f"view {sorted(view.pool_role)} of layer group {group.group_id}"
        num_layers = len(group.global_layer_ids)
        per_layer: list[list[tuple[int, int]]] = [[] for _ in range(num_layers)]
        for entry in view.buffer_entries:
            if not 0 <= entry.local_layer_id < num_layers:
                raise UnsupportedPairing(f"{name}: entry for local layer {entry.local_layer_id}")
            per_layer[entry.local_layer_id].append((entry.offset, entry.size))
        if not per_layer[0] or any(layer != per_layer[0] for layer in per_layer):
            raise UnsupportedPairing(f"{name}: layers have different buffer entries")
        sizes = {size for _, size in per_layer[0]}
        if len(sizes) != 1:
            raise UnsupportedPairing(f"{name}: entries of different sizes {sorted(sizes)}")
        entry_size, row_bytes = sizes.pop(), view.head_dim * view.element_bytes
        if entry_size != view.num_kv_heads * view.tokens_per_block * row_bytes:
            raise UnsupportedPairing(
                f"{name}: entry size {entry_size} is not heads x tokens_per_block x head_dim x "
                f"element_bytes {view.num_kv_heads} x {view.tokens_per_block} x {view.head_dim} "
                f"x {view.element_bytes}"
            )
        pool = group.pool
        layer_extent = max(offset + size for offset, size in per_layer[0])
        slot_extent = (num_layers - 1) * pool.layer_stride_bytes + layer_extent
        overruns_layer = num_layers > 1 and layer_extent > pool.layer_stride_bytes
        if overruns_layer or slot_extent > pool.slot_bytes:
            raise UnsupportedPairing(f"{name}: entries overrun layer stride or slot")
        return cls(
            kind=view.mapper_kind, base_address=pool.base_address, num_slots=pool.num_slots,
            slot_stride=pool.slot_stride_bytes, layer_stride=pool.layer_stride_bytes,
            entry_offsets=tuple(offset for offset, _ in per_layer[0]),
            num_heads=view.num_kv_heads, tokens_per_block=view.tokens_per_block,
            row_bytes=row_bytes,
        )  # fmt: skip

    def row_offsets(self, layers: Sequence[int], heads: range, num_tokens: int) -> IdArray:
        """Offsets inside a slot of the rows of `heads` (local) and of tokens `[0, num_tokens)`
        in each of `layers`' entries, ordered by layer, entry, head, token."""
        nhd = self.kind is MapperKind.NHD  # (REPLICATED entries, copied whole, read as HND)
        head_bytes = self.row_bytes * (1 if nhd else self.tokens_per_block)
        token_bytes = self.row_bytes * (self.num_heads if nhd else 1)
        layer_starts = np.asarray(layers, dtype=np.int64) * self.layer_stride
        entries = np.add.outer(layer_starts, self.entry_offsets).reshape(-1, 1, 1)
        rows = np.asarray(heads, dtype=np.int64).reshape(-1, 1) * head_bytes
        return (entries + rows + np.arange(num_tokens, dtype=np.int64) * token_bytes).ravel()

    def slot_addresses(self, blocks: Sequence[int] | IdArray) -> IdArray:
        """Start address of each block's slot; MappingError for a block outside the pool."""
        ids = np.asarray(blocks, dtype=np.int64)
        bad = ids[(ids < 0) | (ids >= self.num_slots)]
        if bad.size:
            raise MappingError(f"block {bad[0]} outside pool of {self.num_slots} slots")
        return self.base_address + ids * self.slot_stride


@attrs.define(eq=False, kw_only=True)
class Mapper:
    """The rows of the shared heads of the shared layers, per block pair, merged and cached per
    token count; `map_blocks` places them at the blocks' slots and merges again."""

    src: ViewGeometry
    dst: ViewGeometry
    layers: tuple[tuple[int, int], ...]  # (source local layer, destination local layer)
    src_heads: range  # the heads both ranks hold, as local indices on each side
    dst_heads: range
    # Copy only the request's tokens of a partial block, where every token is a piece of its own
    # (NHD head mismatch, transpose); else whole blocks, in fewer and larger pieces.
    token_dependent: bool
    _runs: dict[int, Runs] = attrs.field(factory=dict, init=False, repr=False)
    # (source offset, destination offset, size) when a block's runs merge into one run exactly
    # one slot stride long on both sides, so that consecutive slots' runs abut; else None.
    _span: tuple[int, int, int] | None = attrs.field(init=False, repr=False)

    @_span.default
    def _slot_span(self) -> tuple[int, int, int] | None:
        runs = self._block_runs(self.src.tokens_per_block)
        whole = (not self.token_dependent and len(runs) == 1
                 and int(runs[0, 2]) == self.src.slot_stride == self.dst.slot_stride)  # fmt: skip
        return (int(runs[0, 0]), int(runs[0, 1]), int(runs[0, 2])) if whole else None

    def map_blocks(self, src_ids: IdArray, dst_ids: IdArray, tokens: IdArray) -> Fragments:
        """Merged fragments that copy each source block (at least its first `tokens`) into its
        destination block (arrays from `aligned_blocks`), sorted by source address."""
        placed = [empty_runs()]
        for t in np.unique(tokens):  # each pair's runs, offsets inside one block, at its slots
            runs, src, dst = self._block_runs(int(t)), src_ids[tokens == t], dst_ids[tokens == t]
            rows = np.empty((len(src), len(runs), 3), dtype=np.int64)
            rows[:, :, 0] = self.src.slot_addresses(src)[:, None] + runs[None, :, 0]
            rows[:, :, 1] = self.dst.slot_addresses(dst)[:, None] + runs[None, :, 1]
            rows[:, :, 2] = runs[None, :, 2]
            placed.append(rows.reshape(-1, 3))
        return Fragments(merge_runs(np.concatenate(placed)))

    def map_runs(self, src: BlockRun, dst: BlockRun, *, num_tokens: int) -> Fragments | None:
        """`map_blocks` for the usual case, in constant time: both block lists are runs (fresh
        blocks on both sides) and whole slots are copied, which merge into one fragment. None:
        not that case (or lists that do not fit: `aligned_blocks` then says why)."""
        span, count = self._span, dst.count
        src_first, dst_first = src.first + src.count - count, dst.first  # dst may skip blocks
        total = -(-num_tokens // self.src.tokens_per_block)
        if span is None or not 0 < count <= src.count <= total:
            return None
        inside_src = 0 <= src_first <= self.src.num_slots - count
        if not (inside_src and 0 <= dst_first <= self.dst.num_slots - count):
            return None
        src_address = self.src.base_address + src_first * self.src.slot_stride + span[0]
        dst_address = self.dst.base_address + dst_first * self.dst.slot_stride + span[1]
        return Fragments.one(src_address, dst_address, count * span[2])

    def piece_bytes(self) -> int:
        """The smallest contiguous piece this mapper writes of a full block (after merging)."""
        runs = self._block_runs(self.src.tokens_per_block)
        return int(runs[:, 2].min()) if len(runs) else 0

    def _block_runs(self, num_tokens: int) -> Runs:
        if not self.token_dependent:
            num_tokens = self.src.tokens_per_block
        if (runs := self._runs.get(num_tokens)) is None:
            src = self.src.row_offsets([s for s, _ in self.layers], self.src_heads, num_tokens)
            dst = self.dst.row_offsets([d for _, d in self.layers], self.dst_heads, num_tokens)
            rows = np.stack([src, dst, np.full_like(src, self.src.row_bytes)], axis=1)
            runs = self._runs[num_tokens] = merge_runs(rows)
        return runs


def select_mapper(*, src: ViewGeometry, dst: ViewGeometry, layers: Sequence[tuple[int, int]],
                  src_heads: range, dst_heads: range) -> Mapper:  # fmt: skip
    """The mapper for this pairing, or UnsupportedPairing naming what differs (both values).
    `src_heads` and `dst_heads`: the heads both ranks hold, as local indices on each side."""

    def refuse(what: str, a: object, b: object) -> UnsupportedPairing:
        return UnsupportedPairing(f"{what}: source {a} vs destination {b}")

    transposed = {src.kind, dst.kind} == {MapperKind.HND, MapperKind.NHD}
    if src.kind is not dst.kind and not transposed:
        raise refuse("mapper kind", src.kind.value, dst.kind.value)
    if src.tokens_per_block != dst.tokens_per_block:
        raise refuse("tokens_per_block", src.tokens_per_block, dst.tokens_per_block)
    if src.row_bytes != dst.row_bytes:
        raise refuse("head_dim x element_bytes", src.row_bytes, dst.row_bytes)
    if len(src.entry_offsets) != len(dst.entry_offsets):
        raise refuse("entries per layer", len(src.entry_offsets), len(dst.entry_offsets))
    if src_heads.stop > src.num_heads or dst_heads.stop > dst.num_heads:  # a view short of heads
        raise refuse(f"shared heads {src_heads} / {dst_heads}", src.num_heads, dst.num_heads)
    if src.kind is MapperKind.REPLICATED:
        if src.num_heads != dst.num_heads:  # (each entry is heads x tokens x row bytes)
            raise refuse("replicated entry heads", src.num_heads, dst.num_heads)
        # every rank holds whole entries; which one sends is decided by election (peers.py)
        src_heads = dst_heads = range(src.num_heads)
    every_head = len(src_heads) == src.num_heads == dst.num_heads
    token_dependent = transposed or (src.kind is MapperKind.NHD and not every_head)
    return Mapper(src=src, dst=dst, layers=tuple(layers), src_heads=src_heads,
                  dst_heads=dst_heads, token_dependent=token_dependent)  # fmt: skip


def aligned_blocks(src_blocks: Sequence[int], dst_blocks: Sequence[int], *, num_tokens: int,
                   tokens_per_block: int) -> tuple[IdArray, IdArray, IdArray]:  # fmt: skip
    """Pair source and destination blocks of one request: (source ids, destination ids, the
    request's tokens in each pair's block), one array entry per pair. Both lists are suffixes of
    the request's blocks (wire.RequestData); MappingError: a list longer than the request, or a
    source that starts after the destination."""
    total = -(-num_tokens // tokens_per_block)
    if len(src_blocks) > total or len(dst_blocks) > total:
        raise MappingError(
            f"{len(src_blocks)} source / {len(dst_blocks)} destination blocks for "
            f"{num_tokens} tokens ({total} blocks of {tokens_per_block})"
        )
    src_start = total - len(src_blocks)
    dst_start = total - len(dst_blocks)
    if src_start > dst_start:
        raise MappingError(
            f"destination asks for blocks from {dst_start}, source holds only from {src_start}"
        )
    skip = dst_start - src_start
    src = np.asarray(src_blocks, dtype=np.int64)[skip:]
    dst = np.asarray(dst_blocks, dtype=np.int64)
    first = np.arange(dst_start, total, dtype=np.int64) * tokens_per_block
    tokens = np.minimum(tokens_per_block, num_tokens - first)
    return src, dst, tokens
