"""RankInfo validation and the compatibility gate: refusals name the field and both values."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from tests.rank_infos import make_instance
from trtdisagg.transfer.errors import PeerIncompatible
from trtdisagg.transfer.protocol.peers import PeerRegistrar, is_elected, peer_overlap
from trtdisagg.transfer.protocol.rank_info import (
    BounceConfig,
    RankInfo,
    head_range,
    make_instance_name,
)


def _rank(**changes: Any) -> RankInfo:
    info = make_instance(
        instance_name="peer",
        tp_size=2,
        pp_size=2,
        layer_num_per_pp=(2, 2),
        num_kv_heads=4,
        head_dim=8,
        tokens_per_block=16,
        num_slots=4,
    )[0]
    return attrs.evolve(info, **changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"protocol_version": 2}, "protocol_version: local 1 vs peer 2"),
        ({"model_fingerprint": "other"}, "model_fingerprint: local 'test-model' vs peer 'other'"),
        ({"dtype": "bfloat16"}, "dtype: local 'float32' vs peer 'bfloat16'"),
        ({"tokens_per_block": 32}, "tokens_per_block: local 16 vs peer 32"),
        ({"head_dim": 4}, "head_dim: local 8 vs peer 4"),
        ({"layer_num_per_pp": (2, 3)}, "num_layers: local 4 vs peer 5"),
        ({"bounce": BounceConfig(size_mb=64)}, "kv_cache_bounce_size_mb: local 0 vs peer 64"),
    ],
)
def test_mismatch_names_field_and_both_values(changes: dict[str, object], message: str) -> None:
    with pytest.raises(PeerIncompatible) as info:
        PeerRegistrar(_rank()).register(_rank(**changes))
    assert message in str(info.value)
    assert str(info.value).startswith("peer peer#0 is incompatible: ")


def test_bounce_sizes_must_match_when_both_are_on() -> None:
    local = _rank(bounce=BounceConfig(size_mb=64))
    PeerRegistrar(local).register(_rank(instance_name="gen", bounce=BounceConfig(size_mb=64)))
    with pytest.raises(PeerIncompatible, match="kv_cache_bounce_size_mb: local 64 vs peer 128"):
        PeerRegistrar(local).register(_rank(bounce=BounceConfig(size_mb=128)))


def test_every_mismatch_is_listed() -> None:
    with pytest.raises(PeerIncompatible, match=r"dtype: .*; head_dim: local 8 vs peer 4"):
        PeerRegistrar(_rank()).register(_rank(dtype="float16", head_dim=4))


def test_compatible_peer_passes() -> None:
    PeerRegistrar(_rank()).register(_rank(instance_name="other", agent_name="x"))


def test_registrar_caches_a_refusal_until_forget() -> None:
    registrar = PeerRegistrar(_rank())
    bad = _rank(instance_name="bad", dtype="float16")
    for _ in range(2):
        with pytest.raises(PeerIncompatible, match="dtype: local 'float32' vs peer 'float16'"):
            registrar.register(bad)
    # another rank of the refused instance fails fast with the cached message, even if it is fine
    with pytest.raises(PeerIncompatible, match="dtype"):
        registrar.register(_rank(instance_name="bad"))
    registrar.forget("bad")
    registrar.register(_rank(instance_name="bad"))


def test_re_registration_with_different_info_is_refused() -> None:
    registrar = PeerRegistrar(_rank())
    peer = _rank(instance_name="gen")
    assert registrar.register(peer) is registrar.register(peer)
    with pytest.raises(PeerIncompatible, match="different RankInfo"):
        registrar.register(attrs.evolve(peer, control_endpoint="tcp://127.0.0.1:1"))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"instance_rank": 3}, r"instance_rank 3 != pp\*tp\+tp = 0"),
        ({"tp_rank": 2}, "outside sizes"),
        ({"num_kv_heads": 3}, "num_kv_heads 3 do not split over a DP group's 2 ranks"),
        ({"kv_heads_per_rank": 4}, "kv_heads_per_rank 4 != 2"),
        ({"layer_num_per_pp": (2,)}, "must hold pp_size 2"),
        ({"dp_size": 2, "dp_rank": 1, "kv_heads_per_rank": 4}, "dp_rank 1 != tp_rank 0 // 1"),
        ({"dp_size": 3}, "dp_size 3 does not divide tp_size 2"),
        ({"layer_num_per_pp": (1, 3)}, "outside PP stage 0"),
    ],
)
def test_inconsistent_rank_info_is_refused(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _rank(**changes)


def _instance(
    name: str, *, tp: int, pp: int, layers: tuple[int, ...], heads: int
) -> list[RankInfo]:
    return make_instance(
        instance_name=name,
        tp_size=tp,
        pp_size=pp,
        layer_num_per_pp=layers,
        num_kv_heads=heads,
        head_dim=1,
        tokens_per_block=1,
        num_slots=1,
    )


def test_head_ranges_and_duplication() -> None:
    assert [head_range(8, 4, i).start for i in range(4)] == [0, 2, 4, 6]
    assert [head_range(2, 4, i).start for i in range(4)] == [0, 0, 1, 1]
    ctx = _instance("x", tp=4, pp=1, layers=(1,), heads=2)  # each head held by 2 ranks
    gen = _instance("y", tp=2, pp=1, layers=(1,), heads=2)
    assert [is_elected(sender=c, receiver=gen[1]) for c in ctx] == [False, True, False, True]


def test_overlap_pp_and_tp() -> None:
    ctx = _instance("ctx", tp=2, pp=2, layers=(3, 1), heads=4)
    gen = _instance("gen", tp=4, pp=2, layers=(2, 2), heads=4)
    # gen rank (tp 3, pp 1) holds layers 2-3 and head 3: ctx stages 0 and 1, ctx tp 1
    assert peer_overlap(gen[7], ctx[0], peer_dp_rank=0) == (1, 3)
    # ctx rank (tp 0, pp 0) holds layers 0-2 and heads 0-1: gen stages 0, 1; gen tp 0, 1
    assert peer_overlap(ctx[0], gen[0], peer_dp_rank=0) == (0, 1, 4, 5)


def test_instance_names_are_unique() -> None:
    assert make_instance_name("ctx") != make_instance_name("ctx")
