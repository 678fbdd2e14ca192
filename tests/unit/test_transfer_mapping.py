"""Registrar + mappers + sessions against a byte-exact simulation of every rank's pool.

The centrepiece is `test_every_destination_byte_written_once`: random ctx/gen topologies (TP
1-8, PP 1-4, attention-DP groups, 1-8 KV heads, HND/NHD/REPLICATED, padded layouts), every pool
simulated as an int64 array holding, per byte, a unique id of (global layer, K/V, global head,
token position, byte). Every ctx rank's fragments are applied; then every destination byte of the
prompt must have been written exactly once with the right id, nothing outside the requested
blocks' entries may be touched, and the session state machines must agree on the result counts.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.rank_infos import make_instance
from trtdisagg.kv.page_table import Layout, MapperKind
from trtdisagg.transfer.errors import MappingError, PeerIncompatible
from trtdisagg.transfer.protocol.fragments import BlockRun, packed_run
from trtdisagg.transfer.protocol.mappers import aligned_blocks
from trtdisagg.transfer.protocol.peers import PeerRegistrar, direct_fragments
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.sessions import (
    ReceiverSession,
    SenderSession,
    SourceBlocks,
    Status,
)
from trtdisagg.transfer.protocol.wire import (
    RequestData,
    ResultStatus,
    TransferResult,
    WriteNotice,
    pack_block_ids,
)

# ---------------------------------------------------------------------------------------------
# Topologies


@attrs.frozen(kw_only=True)
class Side:
    tp: int
    pp: int
    dp: int
    layer_num_per_pp: tuple[int, ...]
    kind: MapperKind  # HND and NHD sides may differ (the transpose mapper)
    kv_gap: int
    layer_pad: int
    slot_pad: int


@attrs.frozen(kw_only=True)
class Scenario:
    num_kv_heads: int
    head_dim: int
    element_bytes: int
    tokens_per_block: int
    kind: MapperKind
    ctx: Side
    gen: Side
    ctx_dp_rank: int
    gen_dp_rank: int
    num_tokens: int
    ctx_blocks: tuple[int, ...]
    gen_blocks: tuple[int, ...]  # a suffix of the request's blocks
    num_slots: int


def _split(draw: st.DrawFn, total: int, parts: int) -> tuple[int, ...]:
    if parts == 1:
        return (total,)
    cuts = draw(
        st.lists(st.integers(1, total - 1), min_size=parts - 1, max_size=parts - 1, unique=True)
    )
    bounds = [0, *sorted(cuts), total]
    return tuple(b - a for a, b in itertools.pairwise(bounds))


def _side(draw: st.DrawFn, *, heads: int, layers: int, pp: int, kind: MapperKind) -> Side:
    tp = draw(st.integers(1, 8))
    valid_dp = [
        dp
        for dp in range(1, tp + 1)
        if tp % dp == 0 and (heads % (tp // dp) == 0 or (tp // dp) % heads == 0)
    ]
    return Side(
        tp=tp,
        pp=pp,
        dp=draw(st.sampled_from(valid_dp + [1] * 4 if 1 in valid_dp else valid_dp)),
        layer_num_per_pp=_split(draw, layers, pp),
        kind=kind,
        kv_gap=draw(st.sampled_from([0, 0, 8])),
        layer_pad=draw(st.sampled_from([0, 0, 16])),
        slot_pad=draw(st.sampled_from([0, 0, 24])),
    )


def _blocks(draw: st.DrawFn, count: int, num_slots: int) -> tuple[int, ...]:
    if draw(st.booleans()):  # one run of consecutive blocks
        start = draw(st.integers(0, num_slots - count))
        return tuple(range(start, start + count))
    return tuple(draw(st.permutations(range(num_slots)))[:count])


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    kinds = [MapperKind.HND, MapperKind.HND, MapperKind.NHD, MapperKind.NHD, MapperKind.REPLICATED]
    kind = draw(st.sampled_from(kinds))
    heads = 1 if kind is MapperKind.REPLICATED else draw(st.sampled_from([1, 2, 4, 8, 3, 6]))
    ctx_pp, gen_pp = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    layers = draw(st.integers(max(ctx_pp, gen_pp), 8))
    gen_kind = kind
    if kind is not MapperKind.REPLICATED and draw(st.integers(0, 3)) == 0:
        gen_kind = MapperKind.NHD if kind is MapperKind.HND else MapperKind.HND
    ctx = _side(draw, heads=heads, layers=layers, pp=ctx_pp, kind=kind)
    gen = _side(draw, heads=heads, layers=layers, pp=gen_pp, kind=gen_kind)
    tpb = draw(st.sampled_from([1, 2, 3, 4, 8]))
    total_blocks = draw(st.integers(1, 5))
    num_tokens = draw(st.integers((total_blocks - 1) * tpb + 1, total_blocks * tpb))
    num_slots = total_blocks + draw(st.integers(0, 3))
    skip = draw(st.integers(0, total_blocks - 1))  # gen already holds a prefix (prefix cache)
    return Scenario(
        num_kv_heads=heads,
        head_dim=draw(st.integers(1, 3)),
        element_bytes=draw(st.sampled_from([1, 2, 4])),
        tokens_per_block=tpb,
        kind=kind,
        ctx=ctx,
        gen=gen,
        ctx_dp_rank=draw(st.integers(0, ctx.dp - 1)),
        gen_dp_rank=draw(st.integers(0, gen.dp - 1)),
        num_tokens=num_tokens,
        ctx_blocks=_blocks(draw, total_blocks, num_slots),
        gen_blocks=_blocks(draw, total_blocks - skip, num_slots),
        num_slots=num_slots,
    )


def _instance(s: Scenario, side: Side, name: str, space: int) -> list[RankInfo]:
    return make_instance(
        instance_name=name,
        tp_size=side.tp,
        pp_size=side.pp,
        dp_size=side.dp,
        layer_num_per_pp=side.layer_num_per_pp,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        tokens_per_block=s.tokens_per_block,
        num_slots=s.num_slots,
        element_bytes=s.element_bytes,
        layout=Layout.NHD if side.kind is MapperKind.NHD else Layout.HND,
        kind=side.kind,
        base_address=lambda rank: (space << 40) + (rank << 24) + 4096,
        kv_gap=side.kv_gap,
        layer_pad=side.layer_pad,
        slot_pad=side.slot_pad,
    )


# ---------------------------------------------------------------------------------------------
# Byte-level simulation of the pools


@attrs.define
class Pool:
    """One rank's pool as int64 'bytes' (each holds the id of the logical byte stored there)."""

    info: RankInfo
    data: np.ndarray
    writes: np.ndarray

    @classmethod
    def of(cls, info: RankInfo, fill: int) -> Pool:
        size = info.page_table.layer_groups[0].pool.total_bytes
        return cls(info, np.full(size, fill, np.int64), np.zeros(size, np.int64))

    @property
    def base(self) -> int:
        return self.info.page_table.layer_groups[0].pool.base_address

    def offset(self, address: int, size: int) -> int:
        offset = address - self.base
        assert offset >= 0, "fragment before the pool"
        assert offset + size <= self.data.size, "fragment past the pool"
        return offset


def _entry_spans(info: RankInfo, block: int) -> list[tuple[int, int, int]]:
    """(pool offset, global layer, K/V) of every entry of `block`."""
    group = info.page_table.layer_groups[0]
    pool, view = group.pool, group.views[0]
    return [
        (
            block * pool.slot_stride_bytes + e.local_layer_id * pool.layer_stride_bytes + e.offset,
            group.global_layer_ids[e.local_layer_id],
            i % 2,
        )
        for i, e in enumerate(view.buffer_entries)
    ]


def _entry_ids(s: Scenario, info: RankInfo, layer: int, kv: int, first_token: int) -> np.ndarray:
    """[entry bytes] ids of one entry holding tokens [first_token, first_token + tpb)."""
    row = s.head_dim * s.element_bytes
    positions = 5 * 8  # > any token position
    heads = np.array(info.heads)[:, None, None]
    tokens = np.arange(first_token, first_token + s.tokens_per_block)[None, :, None]
    ids = (((layer * 2 + kv) * 8 + heads) * positions + tokens) * row + np.arange(row)
    if info.page_table.layer_groups[0].views[0].mapper_kind is MapperKind.NHD:
        ids = ids.transpose(1, 0, 2)
    return ids.ravel()


def _token_mask(s: Scenario, info: RankInfo, first_token: int) -> np.ndarray:
    """[entry bytes] True where the byte belongs to a prompt token."""
    shape = (len(info.heads), s.tokens_per_block, s.head_dim * s.element_bytes)
    tokens = np.arange(first_token, first_token + s.tokens_per_block)[None, :, None]
    mask = np.broadcast_to(tokens < s.num_tokens, shape)
    if info.page_table.layer_groups[0].views[0].mapper_kind is MapperKind.NHD:
        mask = mask.transpose(1, 0, 2)
    return mask.ravel()


def _fill_source(s: Scenario, pool: Pool) -> None:
    for index, block in enumerate(s.ctx_blocks):
        for offset, layer, kv in _entry_spans(pool.info, block):
            ids = _entry_ids(s, pool.info, layer, kv, index * s.tokens_per_block)
            pool.data[offset : offset + ids.size] = ids


def _check_destination(s: Scenario, pool: Pool) -> None:
    total = math.ceil(s.num_tokens / s.tokens_per_block)
    first_block = total - len(s.gen_blocks)
    allowed = np.zeros(pool.data.size, bool)
    for index, block in enumerate(s.gen_blocks, start=first_block):
        for offset, layer, kv in _entry_spans(pool.info, block):
            expected = _entry_ids(s, pool.info, layer, kv, index * s.tokens_per_block)
            mask = _token_mask(s, pool.info, index * s.tokens_per_block)
            span = slice(offset, offset + expected.size)
            allowed[span] = True
            written = pool.writes[span][mask]
            assert (written == 1).all(), f"layer {layer} kv {kv} block {block}: {written}"
            np.testing.assert_array_equal(pool.data[span][mask], expected[mask])
    assert pool.writes.max(initial=0) <= 1, "a destination byte was written twice"
    assert not pool.writes[~allowed].any(), "bytes outside the requested blocks were written"


# ---------------------------------------------------------------------------------------------
# The property


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_destination_byte_written_once(s: Scenario) -> None:
    ctx_infos = _instance(s, s.ctx, "ctx", 1)
    gen_infos = _instance(s, s.gen, "gen", 2)
    ctx_reg = {c.instance_rank: PeerRegistrar(c) for c in ctx_infos}
    gen_reg = {g.instance_rank: PeerRegistrar(g) for g in gen_infos}
    for registrar in ctx_reg.values():  # REGISTER_PEER from every gen rank
        for g in gen_infos:
            registrar.register(g)
    for registrar in gen_reg.values():  # INSTANCE_INFO
        for c in ctx_infos:
            registrar.register(c)

    ctx_pools = {c.instance_rank: Pool.of(c, -1) for c in ctx_infos}
    gen_pools = {g.instance_rank: Pool.of(g, -2) for g in gen_infos}
    for pool in ctx_pools.values():
        _fill_source(s, pool)

    ctx_active = [c for c in ctx_infos if c.dp_rank == s.ctx_dp_rank]
    gen_active = [g for g in gen_infos if g.dp_rank == s.gen_dp_rank]
    senders = {c.instance_rank: SenderSession(key=7, deadline=math.inf) for c in ctx_active}
    for c in ctx_active:
        overlap = ctx_reg[c.instance_rank].overlap(gen_infos[0], peer_dp_rank=s.gen_dp_rank)
        assert len(set(overlap)) == len(overlap)
        senders[c.instance_rank].bind("gen", frozenset(overlap))
        senders[c.instance_rank].set_source(
            SourceBlocks(block_ids=(tuple(s.ctx_blocks),), num_tokens=s.num_tokens)
        )

    results: Counter[tuple[int, int]] = Counter()
    for g in gen_active:
        overlap = gen_reg[g.instance_rank].overlap(ctx_infos[0], peer_dp_rank=s.ctx_dp_rank)
        assert overlap
        assert len(set(overlap)) == len(overlap)
        receiver = ReceiverSession(
            key=7, peer_instance="ctx", expected=frozenset(overlap), deadline=math.inf
        )
        request = RequestData(
            key=7,
            instance_name="gen",
            instance_rank=g.instance_rank,
            block_ids=(pack_block_ids(s.gen_blocks),),
            num_tokens=s.num_tokens,
        )
        for rank in overlap:
            c = ctx_infos[rank]
            assert c.dp_rank == s.ctx_dp_rank
            sender = senders[rank]
            sender.add_request(request)
            assert sender.requests.get(g.instance_rank) is request, "ctx did not expect it"
            assert [r.instance_rank for r in sender.take_writes()] == [g.instance_rank]
            plan = ctx_reg[rank].send_plan(g.key)
            fragments = plan.fragments(
                src_blocks=[s.ctx_blocks], dst_blocks=[s.gen_blocks], num_tokens=s.num_tokens
            )
            assert sender.source is not None
            # The write path: a constant-time mapping where both lists are runs, else this.
            assert direct_fragments(plan, sender.source, request) == fragments
            src, dst = ctx_pools[rank], gen_pools[g.instance_rank]
            for src_addr, dst_addr, size in fragments.rows.tolist():
                so, do = src.offset(src_addr, size), dst.offset(dst_addr, size)
                dst.data[do : do + size] = src.data[so : so + size]
                dst.writes[do : do + size] += 1
            sender.write_finished(g.instance_rank, ResultStatus.OK)
            assert not sender.in_flight
            results[rank, g.instance_rank] += 1
            num_bytes = fragments.num_bytes
            sender_fields = {"key": 7, "instance_name": "ctx", "instance_rank": rank}
            result = TransferResult(
                status=ResultStatus.OK,
                num_bytes=num_bytes,
                num_descriptors=len(fragments),
                **sender_fields,
            )
            receiver.on_result(result)
            if num_bytes:
                receiver.on_notice(WriteNotice(**sender_fields))
        assert receiver.status is Status.TRANSFERRED
        got = sum(n for (_, gr), n in results.items() if gr == g.instance_rank)
        assert (
            got
            == len(overlap)
            == len(gen_reg[g.instance_rank].overlap(ctx_infos[0], peer_dp_rank=s.ctx_dp_rank))
        )
        _check_destination(s, gen_pools[g.instance_rank])

    assert max(results.values()) == 1, "a ctx rank reported twice to one gen rank"
    for rank, sender in senders.items():
        assert sender.status is Status.TRANSFERRED, (rank, sender.status)
    for pool in gen_pools.values():
        if pool.info.dp_rank != s.gen_dp_rank:
            assert not pool.writes.any(), "a gen rank outside the request's DP group was written"


# ---------------------------------------------------------------------------------------------
# Fragment counts and mapper choice


def _pair(
    *,
    ctx_tp: int = 1,
    gen_tp: int = 1,
    heads: int = 2,
    layers: int = 3,
    tpb: int = 4,
    layout: Layout = Layout.HND,
    kind: MapperKind | None = None,
    num_slots: int = 16,
) -> tuple[list[RankInfo], list[RankInfo]]:
    def instance(name: str, tp: int, space: int) -> list[RankInfo]:
        return make_instance(
            instance_name=name,
            tp_size=tp,
            pp_size=1,
            layer_num_per_pp=(layers,),
            num_kv_heads=heads,
            head_dim=2,
            tokens_per_block=tpb,
            num_slots=num_slots,
            layout=layout,
            kind=kind,
            base_address=lambda rank: (space << 40) + (rank << 32),
        )

    return instance("ctx", ctx_tp, 1), instance("gen", gen_tp, 2)


def _fragments(
    ctx: RankInfo, gen: RankInfo, src: Sequence[int], dst: Sequence[int], tokens: int
) -> list[tuple[int, int, int]]:
    plan = PeerRegistrar(ctx).register(gen)
    frags = plan.fragments(src_blocks=[src], dst_blocks=[dst], num_tokens=tokens)
    return [(src, dst, size) for src, dst, size in frags.rows.tolist()]


def test_homogeneous_consecutive_blocks_are_one_fragment() -> None:
    ctx, gen = _pair()
    slot = ctx[0].page_table.layer_groups[0].pool.slot_stride_bytes
    frags = _fragments(ctx[0], gen[0], [3, 4, 5, 6], [9, 10, 11, 12], tokens=15)
    src_base = ctx[0].page_table.layer_groups[0].pool.base_address
    dst_base = gen[0].page_table.layer_groups[0].pool.base_address
    assert frags == [(src_base + 3 * slot, dst_base + 9 * slot, 4 * slot)]


def test_homogeneous_runs_are_one_fragment_each() -> None:
    ctx, gen = _pair()
    # runs consecutive on both sides: [1, 2] -> [5, 6], [7] -> [8], [8, 9] -> [2, 3]
    frags = _fragments(ctx[0], gen[0], [1, 2, 7, 8, 9], [5, 6, 8, 2, 3], tokens=20)
    assert len(frags) == 3


def test_mapper_kinds_and_counts() -> None:
    ctx, gen = _pair(ctx_tp=1, gen_tp=2)  # 2 heads -> 1 head per gen rank
    assert not PeerRegistrar(ctx[0]).register(gen[1]).views[0].mapper.token_dependent
    # HND mismatch: layers x K/V fragments per block, scattered blocks do not merge
    assert len(_fragments(ctx[0], gen[1], [0, 5], [3, 9], tokens=8)) == 2 * 3 * 2

    ctx, gen = _pair(ctx_tp=1, gen_tp=2, layout=Layout.NHD)
    assert PeerRegistrar(ctx[0]).register(gen[0]).views[0].mapper.token_dependent
    # NHD mismatch: layers x K/V x tokens (only the prompt's tokens of the last block)
    assert len(_fragments(ctx[0], gen[0], [0, 5], [3, 9], tokens=6)) == 3 * 2 * 6

    ctx, gen = _pair(ctx_tp=2, gen_tp=2)
    # intact: whole K/V entries, which merge into one fragment per run of blocks
    assert len(_fragments(ctx[1], gen[1], [0, 1], [4, 5], tokens=5)) == 1
    assert PeerRegistrar(ctx[0]).register(gen[1]).views == ()  # no shared heads

    ctx, gen = _pair(ctx_tp=2, gen_tp=4, heads=1, kind=MapperKind.REPLICATED)
    plans = [PeerRegistrar(c).register(gen[3]) for c in ctx]
    assert len(_fragments(ctx[1], gen[3], [0, 1], [4, 5], tokens=5)) == 1  # whole entries
    assert [p.elected for p in plans] == [False, True]  # gen tp 3 % 2 == ctx tp 1


def test_non_elected_duplicate_sends_nothing() -> None:
    ctx, gen = _pair(ctx_tp=4, gen_tp=1, heads=2)  # each head held by 2 ctx ranks
    counts = [len(_fragments(c, gen[0], [0], [0], tokens=4)) for c in ctx]
    assert counts == [6, 0, 6, 0]  # elected: one head range per layer and K/V


def test_hnd_to_nhd_is_transposed_one_head_of_one_token_per_fragment() -> None:
    ctx, _ = _pair(layout=Layout.HND)
    _, gen = _pair(layout=Layout.NHD)
    # Nothing is contiguous on both sides except within one head of one token.
    fragments = _fragments(ctx[0], gen[0], [0], [0], tokens=3)
    row = ctx[0].head_dim * ctx[0].element_bytes
    # 3 layers x K/V x 2 heads x 3 tokens, none of which continue each other on both sides.
    assert sorted({size for _, _, size in fragments}) == [row]
    assert len(fragments) == 3 * 2 * 2 * 3


def test_unsupported_pairings_are_refused_with_both_values() -> None:
    ctx, _ = _pair(tpb=4)
    _, gen = _pair(tpb=8)
    registrar = PeerRegistrar(ctx[0])
    with pytest.raises(PeerIncompatible, match=r"tokens_per_block: local 4 vs peer 8"):
        registrar.register(gen[0])
    with pytest.raises(PeerIncompatible, match=r"tokens_per_block"):  # cached refusal
        registrar.register(gen[0])
    assert "gen" in registrar._refused
    registrar.forget("gen")
    assert "gen" not in registrar._refused


def test_align_blocks() -> None:
    src, dst, tokens = aligned_blocks([10, 11, 12], [5, 6], num_tokens=9, tokens_per_block=4)
    assert list(zip(src.tolist(), dst.tolist(), tokens.tolist())) == [(11, 5, 4), (12, 6, 1)]
    with pytest.raises(MappingError, match="source holds only from 1"):
        aligned_blocks([11, 12], [4, 5, 6], num_tokens=9, tokens_per_block=4)
    with pytest.raises(MappingError, match="for 9 tokens"):
        aligned_blocks([1, 2, 3, 4], [1], num_tokens=9, tokens_per_block=4)


def test_block_outside_pool_is_refused() -> None:
    ctx, gen = _pair(num_slots=4)
    with pytest.raises(MappingError, match="block 4 outside pool of 4 slots"):
        _fragments(ctx[0], gen[0], [0], [4], tokens=1)


@settings(max_examples=150, deadline=None)
@given(
    layout=st.sampled_from([Layout.HND, Layout.NHD]),
    count=st.integers(1, 6),
    skip=st.integers(0, 5),
    src_first=st.integers(0, 12),  # up to 2 blocks past the 16-slot pool
    dst_first=st.integers(0, 12),
    partial=st.integers(0, 3),
    shuffle=st.booleans(),
)
def test_the_consecutive_fast_path_equals_the_general_mapping(
    layout: Layout,
    count: int,
    skip: int,
    src_first: int,
    dst_first: int,
    partial: int,
    shuffle: bool,
) -> None:
    ctx, gen = _pair(layout=layout, num_slots=16)
    mapper = PeerRegistrar(ctx[0]).register(gen[0]).views[0].mapper
    skip = min(skip, count - 1)
    src = list(range(src_first, src_first + count))
    dst = list(range(dst_first, dst_first + count - skip))
    if shuffle and len(dst) > 1:
        dst[0], dst[1] = dst[1], dst[0]
    tokens = count * 4 - partial
    dst_run = packed_run(pack_block_ids(dst))
    fast = None if dst_run is None else mapper.map_runs(
        BlockRun(src_first, count), dst_run, num_tokens=tokens
    )  # fmt: skip
    try:
        ids = aligned_blocks(src, dst, num_tokens=tokens, tokens_per_block=4)
        general = mapper.map_blocks(*ids)
    except MappingError:
        assert fast is None  # the general path says what is wrong
        return
    if shuffle and len(dst) > 1:
        assert fast is None
    else:
        assert fast is not None and fast == general and len(fast) == 1
