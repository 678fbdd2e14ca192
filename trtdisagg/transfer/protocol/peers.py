"""PeerRegistrar: who a rank exchanges KV with, and how. Pure.

`register` once per peer rank (ctx: each REGISTER_PEER; gen: each rank of an INSTANCE_INFO) runs
the compatibility gate and builds the mappers, so an unsupported pairing is a `PeerIncompatible`
then, never at request time. Per request, `overlap` names the peer ranks to exchange with, and a
`SendPlan` turns block lists into fragments on the sending side.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from trtdisagg.transfer.errors import MappingError, PeerIncompatible, UnsupportedPairing
from trtdisagg.transfer.protocol.fragments import (
    Fragments,
    Runs,
    empty_runs,
    merge_runs,
    packed_run,
)
from trtdisagg.transfer.protocol.mappers import (
    Mapper,
    ViewGeometry,
    aligned_blocks,
    select_mapper,
)
from trtdisagg.transfer.protocol.rank_info import (
    RankInfo,
    compat_fields,
    compat_mismatches,
    flat_rank,
    head_range,
    intersect,
    layer_range,
)
from trtdisagg.transfer.protocol.sessions import SourceBlocks
from trtdisagg.transfer.protocol.wire import RequestData, unpack_block_ids


def peer_overlap(local: RankInfo, peer: RankInfo, *, peer_dp_rank: int) -> tuple[int, ...]:
    """The flat ranks (pp-major, sorted) of the peer's DP group `peer_dp_rank` that hold any
    layer AND any KV head that `local` holds (`peer` may be any rank of the peer instance: only
    its sizes are read): gen sends REQUEST_DATA to exactly those, ctx expects it from those."""
    if not 0 <= peer_dp_rank < peer.dp_size:
        raise MappingError(f"peer dp rank {peer_dp_rank} outside dp_size {peer.dp_size}")
    pp_ranks = [p for p in range(peer.pp_size)
                if intersect(layer_range(peer.layer_num_per_pp, p), local.layers)]  # fmt: skip
    first = peer_dp_rank * peer.tp_per_dp
    tp_ranks = [
        first + i for i in range(peer.tp_per_dp)
        if intersect(head_range(peer.num_kv_heads, peer.tp_per_dp, i), local.heads)
    ]  # fmt: skip
    return tuple(flat_rank(tp_rank=t, pp_rank=p, tp_size=peer.tp_size)
                 for p in pp_ranks for t in tp_ranks)  # fmt: skip


def is_elected(*, sender: RankInfo, receiver: RankInfo) -> bool:
    """Whether `sender` writes the heads it shares with `receiver`. When its KV heads are
    duplicated over `d = tp_per_dp / num_kv_heads > 1` of its ranks, receiver rank `r`'s copy is
    written only by the duplicate with `tp_in_dp % d == r.tp_rank % d`; the others answer with a
    0-byte result, since the receiver counts one result per overlapping rank. Every destination
    byte has exactly one writer."""
    dup = max(1, sender.tp_per_dp // sender.num_kv_heads)  # ranks of a DP group per head
    return sender.tp_in_dp % dup == receiver.tp_rank % dup


@attrs.frozen(kw_only=True)
class ViewPair:
    """One matched pool view: sender layer group `src_group` -> receiver group `dst_group`."""

    src_group: int  # index into the sender's page_table.layer_groups
    dst_group: int
    mapper: Mapper


def map_pools(src: RankInfo, dst: RankInfo) -> tuple[ViewPair, ...]:
    """Match the sender's pool views to the receiver's and build one mapper per match.

    A group maps to the receiver group sharing any of its global layers (more than one such
    group is an error); inside it, a view maps to the view with an equal `pool_role`. Unmatched
    views, and rank pairs sharing no layer or head, map to nothing. UnsupportedPairing: an
    ambiguous group match, different mapper kinds, or a mapper refusal."""
    shared = intersect(src.heads, dst.heads)
    if not shared:
        return ()
    src_heads = range(shared.start - src.heads.start, shared.stop - src.heads.start)
    dst_heads = range(shared.start - dst.heads.start, shared.stop - dst.heads.start)
    pairs: list[ViewPair] = []
    dst_groups = dst.page_table.layer_groups
    for gi, group in enumerate(src.page_table.layer_groups):
        mine = set(group.global_layer_ids)
        matches = [hi for hi, g in enumerate(dst_groups) if mine & set(g.global_layer_ids)]
        if not matches:
            continue
        if len(matches) > 1:
            ids = [dst_groups[hi].group_id for hi in matches]
            raise UnsupportedPairing(
                f"layer group {group.group_id} overlaps {len(matches)} peer layer groups {ids}"
            )
        peer_group = dst_groups[matches[0]]
        peer_layers = {layer: i for i, layer in enumerate(peer_group.global_layer_ids)}
        layers = [(i, peer_layers[layer]) for i, layer in enumerate(group.global_layer_ids)
                  if layer in peer_layers]  # fmt: skip
        for view in group.views:
            peer_view = next((v for v in peer_group.views if v.pool_role == view.pool_role), None)
            if peer_view is None:
                continue
            mapper = select_mapper(
                src=ViewGeometry.of(group, view), dst=ViewGeometry.of(peer_group, peer_view),
                layers=layers, src_heads=src_heads, dst_heads=dst_heads,
            )  # fmt: skip
            pairs.append(ViewPair(src_group=gi, dst_group=matches[0], mapper=mapper))
    return tuple(pairs)


@attrs.frozen(kw_only=True)
class SendPlan:
    """How the local (sending) rank serves one receiver rank."""

    peer: RankInfo
    elected: bool  # False: a non-elected duplicate, which moves 0 bytes but still reports
    views: tuple[ViewPair, ...]

    @property
    def piece_bytes(self) -> int:
        """The smallest piece a direct transfer of this pairing writes (0: nothing to write)."""
        return min((view.mapper.piece_bytes() for view in self.views), default=0)

    def fragments(self, *, src_blocks: Sequence[Sequence[int]], dst_blocks: Sequence[Sequence[int]],
                  num_tokens: int) -> Fragments:  # fmt: skip
        """Merged fragments for one request; `*_blocks[g]` = block ids of layer group `g`.
        MappingError: missing layer groups, or block lists that do not fit (`aligned_blocks`)."""
        if not self.elected:
            return Fragments(empty_runs())
        runs: list[Runs] = []
        for view in self.views:
            if view.src_group >= len(src_blocks) or view.dst_group >= len(dst_blocks):
                raise MappingError(
                    f"block lists for {len(src_blocks)} source / {len(dst_blocks)} destination "
                    f"layer groups, but the mapping uses groups {view.src_group}/{view.dst_group}"
                )
            src, dst, tokens = aligned_blocks(
                src_blocks[view.src_group], dst_blocks[view.dst_group],
                num_tokens=num_tokens, tokens_per_block=view.mapper.src.tokens_per_block,
            )  # fmt: skip
            runs.append(view.mapper.map_blocks(src, dst, tokens).rows)
        return _combined(runs)


def _combined(runs: Sequence[Runs]) -> Fragments:
    """The fragments of several views' runs, merged where they continue each other."""
    if len(runs) == 1:
        return Fragments(runs[0])
    return Fragments(merge_runs(np.concatenate([empty_runs(), *runs])))


def direct_fragments(plan: SendPlan, source: SourceBlocks, request: RequestData) -> Fragments:
    """The merged fragments of a direct write of the KV in `source` into `request`'s blocks.
    When every layer group's blocks form a run on both sides and each view copies whole slots
    (the usual homogeneous transfer), they are mapped in constant time, without unpacking."""
    num_tokens = min(request.num_tokens, source.num_tokens)
    dst_runs = [packed_run(ids) for ids in request.block_ids]
    fast: list[Runs] = []
    for view in plan.views if plan.elected else ():
        src = source.runs[view.src_group] if view.src_group < len(source.runs) else None
        dst = dst_runs[view.dst_group] if view.dst_group < len(dst_runs) else None
        mapped = None
        if src is not None and dst is not None:
            mapped = view.mapper.map_runs(src, dst, num_tokens=num_tokens)
        if mapped is None:  # not that case: `fragments` maps it, or says what is wrong
            dst_blocks = [list(unpack_block_ids(ids)) for ids in request.block_ids]
            return plan.fragments(src_blocks=source.block_ids, dst_blocks=dst_blocks,
                                  num_tokens=num_tokens)  # fmt: skip
        fast.append(mapped.rows)
    return _combined(fast)


class PeerRegistrar:
    """Registered peer ranks of one local rank, with cached overlaps and send plans."""

    def __init__(self, local: RankInfo) -> None:
        self.local = local
        # by peer instance, then rank (plans) or DP group (overlaps)
        self._plans: dict[str, dict[int, SendPlan]] = {}
        self._overlaps: dict[str, dict[int, tuple[int, ...]]] = {}
        self._refused: dict[str, PeerIncompatible] = {}

    def register(self, peer: RankInfo) -> SendPlan:
        """Admit one peer rank (idempotent for the same info) and return its send plan.
        PeerIncompatible, naming every mismatching field (`compat_fields`) or why the pools do
        not map: the peer (or another rank of its instance) failed the gate; the same error is
        raised again for every later registration of that instance."""
        if (refused := self._refused.get(peer.instance_name)) is not None:
            raise refused
        if (known := self._plans.get(peer.instance_name, {}).get(peer.instance_rank)) is not None:
            if known.peer != peer:
                raise PeerIncompatible(peer.label, "registered again with a different RankInfo")
            return known
        ours, theirs = compat_fields(self.local), compat_fields(peer)
        mismatches = compat_mismatches(ours, theirs, names=("local", "peer"))
        try:
            views = () if mismatches else map_pools(self.local, peer)
        except UnsupportedPairing as exc:
            mismatches = [str(exc)]
        if mismatches:
            error = PeerIncompatible(peer.label, "; ".join(mismatches))
            self._refused[peer.instance_name] = error
            raise error
        elected = is_elected(sender=self.local, receiver=peer)
        plan = SendPlan(peer=peer, elected=elected, views=views)
        self._plans.setdefault(peer.instance_name, {})[peer.instance_rank] = plan
        return plan

    def get(self, key: tuple[str, int]) -> RankInfo | None:
        plan = self._plans.get(key[0], {}).get(key[1])
        return plan.peer if plan is not None else None

    def send_plan(self, key: tuple[str, int]) -> SendPlan:
        return self._plans[key[0]][key[1]]  # (KeyError: never registered)

    def overlap(self, peer: RankInfo, *, peer_dp_rank: int) -> tuple[int, ...]:
        """`peer_overlap`, cached."""
        cached = self._overlaps.setdefault(peer.instance_name, {})
        if (found := cached.get(peer_dp_rank)) is None:
            found = cached[peer_dp_rank] = peer_overlap(self.local, peer, peer_dp_rank=peer_dp_rank)
        return found

    def forget(self, instance_name: str) -> list[RankInfo]:
        """Forget an instance (its refusal too); the ranks of it that were registered."""
        self._overlaps.pop(instance_name, None)
        self._refused.pop(instance_name, None)
        return [plan.peer for plan in self._plans.pop(instance_name, {}).values()]
