"""Factories for synthetic page tables and RankInfos (tests, benchmarks, dry runs). Pure.

`make_instance` describes every rank of one instance the way a real KVCache would: one layer
group, one pool `[num_slots, local_layers, 2, ...]` per rank, one view with K then V entries per
local layer. Optional gaps (`kv_gap`, `layer_pad`, `slot_pad`) make the layout non-contiguous so
tests can exercise the mappers' geometry, not only the packed case.
"""

from __future__ import annotations

from collections.abc import Callable

from trtdisagg.kv.page_table import (
    BufferEntry,
    LayerGroup,
    Layout,
    MapperKind,
    PageTable,
    PhysicalPool,
    PoolView,
)
from trtdisagg.transfer.protocol.rank_info import RankInfo, flat_rank, head_range, layer_range

DTYPES = {4: "float32", 2: "bfloat16", 1: "float8"}


def make_page_table(
    *,
    base_address: int,
    num_slots: int,
    global_layers: range | tuple[int, ...],
    num_heads: int,
    tokens_per_block: int,
    head_dim: int,
    element_bytes: int,
    kind: MapperKind,
    kv_gap: int = 0,
    layer_pad: int = 0,
    slot_pad: int = 0,
    pool_role: frozenset[str] = frozenset({"kv"}),
) -> PageTable:
    """One layer group over `global_layers`, K at offset 0 and V after K plus `kv_gap`."""
    entry = num_heads * tokens_per_block * head_dim * element_bytes
    layer_stride = 2 * entry + kv_gap + layer_pad
    slot_bytes = len(global_layers) * layer_stride
    entries = tuple(
        BufferEntry(local_layer_id=layer, offset=offset, size=entry)
        for layer in range(len(global_layers))
        for offset in (0, entry + kv_gap)
    )
    view = PoolView(
        pool_role=pool_role,
        mapper_kind=kind,
        buffer_entries=entries,
        num_kv_heads=num_heads,
        head_dim=head_dim,
        tokens_per_block=tokens_per_block,
        element_bytes=element_bytes,
    )
    pool = PhysicalPool(
        base_address=base_address,
        slot_bytes=slot_bytes,
        num_slots=num_slots,
        slot_stride_bytes=slot_bytes + slot_pad,
        layer_stride_bytes=layer_stride,
    )
    group = LayerGroup(group_id=0, global_layer_ids=tuple(global_layers), pool=pool, views=(view,))
    return PageTable(layer_groups=(group,))


def make_instance(
    *,
    instance_name: str,
    tp_size: int,
    pp_size: int,
    layer_num_per_pp: tuple[int, ...],
    num_kv_heads: int,
    head_dim: int,
    tokens_per_block: int,
    num_slots: int,
    dp_size: int = 1,
    element_bytes: int = 4,
    layout: Layout = Layout.HND,
    kind: MapperKind | None = None,
    base_address: Callable[[int], int] = lambda rank: (rank + 1) << 32,
    kv_gap: int = 0,
    layer_pad: int = 0,
    slot_pad: int = 0,
    model_fingerprint: str = "test-model",
    protocol_version: int = 1,
    agent_metadata: Callable[[int], bytes] = lambda rank: b"",
) -> list[RankInfo]:
    """RankInfos of every rank of one instance, indexed by instance_rank."""
    tp_per_dp = tp_size // dp_size
    infos: list[RankInfo] = []
    for pp_rank in range(pp_size):
        for tp_rank in range(tp_size):
            rank = flat_rank(tp_rank=tp_rank, pp_rank=pp_rank, tp_size=tp_size)
            heads = head_range(num_kv_heads, tp_per_dp, tp_rank % tp_per_dp)
            table = make_page_table(
                base_address=base_address(rank),
                num_slots=num_slots,
                global_layers=layer_range(layer_num_per_pp, pp_rank),
                num_heads=len(heads),
                tokens_per_block=tokens_per_block,
                head_dim=head_dim,
                element_bytes=element_bytes,
                kind=kind or MapperKind(layout.value),
                kv_gap=kv_gap,
                layer_pad=layer_pad,
                slot_pad=slot_pad,
            )
            infos.append(
                RankInfo(
                    instance_name=instance_name,
                    instance_rank=rank,
                    tp_size=tp_size,
                    tp_rank=tp_rank,
                    pp_size=pp_size,
                    pp_rank=pp_rank,
                    dp_size=dp_size,
                    dp_rank=tp_rank // tp_per_dp,
                    layer_num_per_pp=layer_num_per_pp,
                    num_kv_heads=num_kv_heads,
                    kv_heads_per_rank=len(heads),
                    head_dim=head_dim,
                    tokens_per_block=tokens_per_block,
                    dtype=DTYPES.get(element_bytes, f"bytes{element_bytes}"),
                    element_bytes=element_bytes,
                    layout=layout,
                    model_fingerprint=model_fingerprint,
                    protocol_version=protocol_version,
                    control_endpoint=f"tcp://127.0.0.1:{20000 + rank}",
                    agent_name=f"{instance_name}/{rank}",
                    agent_metadata=agent_metadata(rank),
                    page_table=table,
                )
            )
    return infos
