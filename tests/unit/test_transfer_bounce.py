"""The bounce path end to end in memory: ctx ranks pack their runs, the bytes move as the
fragments say, gen unpacks, and every gen pool holds exactly the KV the model computed.

Real KVCache tensors (CPU) on both sides, over random TP/PP cuts, kv head counts (duplicated
heads included), HND/NHD layouts and gen prefix skips. The transfer agent's part (copying the
fragments' bytes) is done with tensor slices here; everything else is the production code.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.rank_infos import make_instance
from trtdisagg.kv.cache import KVCache
from trtdisagg.kv.page_table import Layout
from trtdisagg.kv.staging import StagingBuffer
from trtdisagg.model.parallel import pp_layer_range
from trtdisagg.transfer.protocol.bounce import (
    StagingAllocator,
    canonical_bytes,
    staged_fragments,
    staged_runs,
)
from trtdisagg.transfer.protocol.peers import is_elected, peer_overlap
from trtdisagg.transfer.protocol.rank_info import RankInfo

HEAD_DIM = 3
LAYERS = 4


def _value(layer: int, kv: int, head: int, token: int) -> torch.Tensor:
    """The model's K/V vector for one (layer, K/V, global head, token): unique per slot."""
    base = ((layer * 2 + kv) * 16 + head) * 1000 + token
    return torch.arange(HEAD_DIM, dtype=torch.float32) + base * 10


def _instance(name: str, tp: int, pp: int, heads: int, layout: Layout, tpb: int) -> list[RankInfo]:
    counts = tuple(b - a for a, b in (pp_layer_range(LAYERS, pp, p) for p in range(pp)))
    return make_instance(
        instance_name=name, tp_size=tp, pp_size=pp, layer_num_per_pp=counts,
        num_kv_heads=heads, head_dim=HEAD_DIM, tokens_per_block=tpb, num_slots=32,
        layout=layout,
    )  # fmt: skip


def _cache(info: RankInfo, layout: Layout, tpb: int) -> KVCache:
    return KVCache(
        num_blocks=32, num_layers=len(info.layers), num_kv_heads=len(info.heads),
        head_dim=HEAD_DIM, tokens_per_block=tpb, layout=layout, dtype=torch.float32,
        device=torch.device("cpu"),
    )  # fmt: skip


def _fill(cache: KVCache, info: RankInfo, blocks: list[int], num_tokens: int) -> None:
    tpb = cache.tokens_per_block
    slots = torch.tensor([blocks[t // tpb] * tpb + t % tpb for t in range(num_tokens)])
    for local, layer in enumerate(info.layers):
        k = torch.stack(
            [torch.stack([_value(layer, 0, h, t) for h in info.heads]) for t in range(num_tokens)]
        )
        v = torch.stack(
            [torch.stack([_value(layer, 1, h, t) for h in info.heads]) for t in range(num_tokens)]
        )
        cache.write(local, k, v, slots)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, object]:
    heads = draw(st.sampled_from([1, 2, 4]))
    tps = [t for t in (1, 2, 4) if heads % t == 0 or t % heads == 0]
    tpb = draw(st.sampled_from([2, 4]))
    num_tokens = draw(st.integers(1, 5 * tpb))
    total = math.ceil(num_tokens / tpb)
    return {
        "heads": heads,
        "ctx": (draw(st.sampled_from(tps)), draw(st.sampled_from([1, 2]))),
        "gen": (draw(st.sampled_from(tps)), draw(st.sampled_from([1, 2]))),
        "ctx_layout": draw(st.sampled_from(list(Layout))),
        "gen_layout": draw(st.sampled_from(list(Layout))),
        "tpb": tpb,
        "num_tokens": num_tokens,
        "skip": draw(st.integers(0, total - 1)),  # gen already holds a prefix of blocks
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_staged_transfer_lands_every_gen_byte(case: dict[str, object]) -> None:
    heads, tpb, num_tokens = case["heads"], case["tpb"], case["num_tokens"]
    assert isinstance(heads, int) and isinstance(tpb, int) and isinstance(num_tokens, int)
    (ctx_tp, ctx_pp), (gen_tp, gen_pp) = case["ctx"], case["gen"]  # type: ignore[misc]
    ctx_layout, gen_layout = case["ctx_layout"], case["gen_layout"]
    assert isinstance(ctx_layout, Layout) and isinstance(gen_layout, Layout)
    skip = case["skip"]
    assert isinstance(skip, int)
    total = math.ceil(num_tokens / tpb)
    first = skip * tpb
    ctx = _instance("ctx", ctx_tp, ctx_pp, heads, ctx_layout, tpb)
    gen = _instance("gen", gen_tp, gen_pp, heads, gen_layout, tpb)
    src_blocks = list(range(3, 3 + total))
    dst_blocks = list(range(20, 20 + total - skip))

    ctx_buffers = {}
    for info in ctx:
        cache = _cache(info, ctx_layout, tpb)
        _fill(cache, info, src_blocks, num_tokens)
        ctx_buffers[info.instance_rank] = StagingBuffer(cache, 1 << 16)
    for g in gen:
        cache = _cache(g, gen_layout, tpb)
        staging = StagingBuffer(cache, 1 << 16)
        region = canonical_bytes(g, num_tokens - first)
        written = torch.zeros(region, dtype=torch.int32)
        for rank in peer_overlap(g, ctx[0], peer_dp_rank=0):
            sender = ctx[rank]
            if not is_elected(sender=sender, receiver=g):
                continue  # a duplicate head's other copy: it reports 0 bytes
            runs = staged_runs(sender, g, num_tokens=num_tokens - first)
            assert all(r.dst_offset + r.num_bytes <= region for r in runs)
            src = ctx_buffers[rank]
            src.pack(0, runs, src_blocks, first_token=first, num_tokens=num_tokens)
            fragments = staged_fragments(runs, src_address=src.address, dst_address=staging.address)
            assert len(fragments) <= len(runs)
            for src_addr, dst_addr, size in fragments.rows.tolist():  # the agent's job
                s, d = src_addr - src.address, dst_addr - staging.address
                staging.tensor[d : d + size] = src.tensor[s : s + size]
                written[d : d + size] += 1
        assert bool((written == 1).all()), "a canonical byte was written twice or never"
        staging.unpack(0, dst_blocks, first_token=first, num_tokens=num_tokens)
        blocks = torch.tensor([0] * skip + dst_blocks)  # gen's own earlier blocks: not checked
        for local, layer in enumerate(g.layers):
            keys, values = cache.gather(local, blocks, num_tokens)
            for i, head in enumerate(g.heads):
                for t in range(first, num_tokens):
                    assert torch.equal(keys[i, t], _value(layer, 0, head, t)), (layer, head, t)
                    assert torch.equal(values[i, t], _value(layer, 1, head, t)), (layer, head, t)


def test_allocator_first_fit_release_merges() -> None:
    alloc = StagingAllocator(capacity=4096, alignment=256)
    a = alloc.allocate(1000)
    b = alloc.allocate(1000)
    c = alloc.allocate(2000)  # rounds up to 2048: exactly what is left
    assert (a, b, c) == (0, 1024, 2048) and alloc.free_bytes == 0
    assert alloc.allocate(1) is None
    alloc.release(a)
    alloc.release(b)
    assert alloc.allocate(2048) == 0  # the two freed ranges merged
    with pytest.raises(ValueError, match="cannot stage 5000 bytes in a buffer of 4096"):
        alloc.allocate(5000)
