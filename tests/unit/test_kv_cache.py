from __future__ import annotations

import ctypes

import pytest
import torch

from trtdisagg.kv.cache import KVCache
from trtdisagg.kv.page_table import Layout, MapperKind

H, D, T, LAYERS = 2, 8, 4, 3


def make(layout: Layout, *, num_blocks: int = 6, dtype: torch.dtype = torch.float32) -> KVCache:
    return KVCache(
        num_blocks=num_blocks,
        num_layers=LAYERS,
        num_kv_heads=H,
        head_dim=D,
        tokens_per_block=T,
        layout=layout,
        dtype=dtype,
        device=torch.device("cpu"),
    )


@pytest.mark.parametrize(
    ("layout", "shape"),
    [(Layout.HND, (6, LAYERS, 2, H, T, D)), (Layout.NHD, (6, LAYERS, 2, T, H, D))],
)
def test_pool_shape_and_sizes(layout: Layout, shape: tuple[int, ...]) -> None:
    cache = make(layout)
    assert tuple(cache.pool.shape) == shape
    assert cache.pool.is_contiguous()
    assert cache.block_bytes == LAYERS * 2 * H * T * D * 4
    assert cache.block_bytes == KVCache.bytes_per_block(
        num_layers=LAYERS, num_kv_heads=H, head_dim=D, tokens_per_block=T, dtype=torch.float32
    )
    assert (
        KVCache.bytes_per_block(
            num_layers=LAYERS, num_kv_heads=H, head_dim=D, tokens_per_block=T, dtype=torch.bfloat16
        )
        == cache.block_bytes // 2
    )


@pytest.mark.parametrize("layout", [Layout.HND, Layout.NHD])
def test_write_then_gather_across_scattered_blocks(layout: Layout) -> None:
    cache = make(layout)
    blocks = torch.tensor([4, 1, 3])  # not in order: the gather must follow the table
    length = 10  # ends mid-block
    k = torch.randn(length, H, D)
    v = torch.randn(length, H, D)
    slots = torch.tensor([int(blocks[p // T]) * T + p % T for p in range(length)])
    # Two writes (a prefill chunk, then the rest), as consecutive forward steps would do.
    cache.write(1, k[:6], v[:6], slots[:6])
    cache.write(1, k[6:], v[6:], slots[6:])
    got_k, got_v = cache.gather(1, blocks, length)
    assert got_k.shape == (H, length, D)
    assert torch.equal(got_k, k.transpose(0, 1))
    assert torch.equal(got_v, v.transpose(0, 1))
    # Other layers are untouched.
    assert not cache.pool[:, 0].any()
    assert not cache.pool[:, 2].any()


@pytest.mark.parametrize("layout", [Layout.HND, Layout.NHD])
def test_page_table_addresses_the_pool(layout: Layout) -> None:
    cache = make(layout)
    cache.pool.copy_(torch.randn(cache.pool.shape))
    table = cache.page_table(global_layer_ids=(4, 5, 6))
    (group,) = table.layer_groups
    assert group.global_layer_ids == (4, 5, 6)
    assert group.pool.base_address == cache.pool.data_ptr()
    assert group.pool.memory_type == "DRAM"
    assert group.pool.num_slots == 6
    assert group.pool.total_bytes == cache.pool.numel() * 4
    (view,) = group.views
    assert view.pool_role == frozenset({"kv"})
    assert view.mapper_kind is (MapperKind.HND if layout is Layout.HND else MapperKind.NHD)
    assert (view.num_kv_heads, view.head_dim, view.tokens_per_block, view.element_bytes) == (
        H,
        D,
        T,
        4,
    )
    assert [(e.local_layer_id, e.offset) for e in view.buffer_entries] == [
        (layer, offset) for layer in range(LAYERS) for offset in (0, H * T * D * 4)
    ]
    for entry in view.buffer_entries:
        for block in (0, 5):
            address, size = table.region(0, entry.local_layer_id, block, entry)
            kv_index = 0 if entry.offset == 0 else 1
            expected = cache.pool[block, entry.local_layer_id, kv_index]
            assert address == expected.data_ptr()
            assert size == expected.numel() * 4
            assert ctypes.string_at(address, size) == expected.numpy().tobytes()


def test_page_table_rejects_wrong_layer_count() -> None:
    with pytest.raises(ValueError, match="2 global layer ids for a pool of 3 layers"):
        make(Layout.HND).page_table((0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_bytes_and_copy_blocks_are_exact(dtype: torch.dtype) -> None:
    src = make(Layout.HND, dtype=dtype)
    src.pool.copy_(torch.randn(src.pool.shape).to(dtype))
    dst = make(Layout.HND, num_blocks=4, dtype=dtype)
    dst.copy_blocks([5, 0], [1, 2], src=src)
    assert len(src.read_block_bytes(5)) == src.block_bytes
    assert dst.read_block_bytes(1) == src.read_block_bytes(5)
    assert dst.read_block_bytes(2) == src.read_block_bytes(0)
    assert dst.read_block_bytes(0) == bytes(dst.block_bytes)  # untouched blocks stay zero
    dst.copy_blocks([1], [3])  # within one cache
    assert dst.read_block_bytes(3) == src.read_block_bytes(5)


def test_copy_blocks_refuses_other_geometry() -> None:
    with pytest.raises(ValueError, match="block geometry differs"):
        make(Layout.HND).copy_blocks([0], [0], src=make(Layout.NHD))
    with pytest.raises(ValueError, match="2 source blocks but 1 destinations"):
        make(Layout.HND).copy_blocks([0, 1], [0])


def test_rejects_non_positive_dimensions() -> None:
    with pytest.raises(ValueError, match="num_blocks=0"):
        make(Layout.HND, num_blocks=0)
