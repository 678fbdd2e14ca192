"""security/limits.py: the control-plane message cap holds the largest legitimate message, built
with the real encoder at the documented bounds, with a margin that stays meaningful."""

from __future__ import annotations

import pytest

from trtdisagg.kv.page_table import (
    BufferEntry,
    LayerGroup,
    Layout,
    MapperKind,
    PageTable,
    PhysicalPool,
    PoolView,
)
from trtdisagg.security.limits import (
    CURVE_FRAME_OVERHEAD,
    MAX_AGENT_METADATA_BYTES,
    MAX_CONTROL_FRAME_BYTES,
    MAX_CONTROL_PAYLOAD_BYTES,
    MAX_INSTANCE_RANKS,
    MAX_LOCAL_LAYERS,
    MessageTooLarge,
    check_fits,
)
from trtdisagg.transfer.protocol.rank_info import BounceConfig, RankInfo
from trtdisagg.transfer.protocol.wire import (
    MAX_KEY,
    PROTOCOL_VERSION,
    InstanceInfo,
    RegisterPeer,
    RequestData,
    encode,
    pack_block_ids,
)

_WIDE = 2**63 - 1  # the widest msgpack integer
_LONGEST_HOST = ".".join(["h" * 63] * 3 + ["h" * 61])  # 253 characters, the DNS maximum


def _widest_rank(rank: int) -> RankInfo:
    """A RankInfo at the documented bounds, every field at its widest encoding."""
    entries = [
        BufferEntry(local_layer_id=layer, offset=offset, size=_WIDE)
        for layer in range(MAX_LOCAL_LAYERS)
        for offset in (0, _WIDE)
    ]
    pool = PhysicalPool(
        base_address=_WIDE, slot_bytes=_WIDE, num_slots=_WIDE, slot_stride_bytes=_WIDE,
        layer_stride_bytes=_WIDE, memory_type="VRAM", device_id=_WIDE,
    )  # fmt: skip
    view = PoolView(
        pool_role=frozenset({"kv"}), mapper_kind=MapperKind.NHD, buffer_entries=tuple(entries),
        num_kv_heads=MAX_INSTANCE_RANKS, head_dim=_WIDE, tokens_per_block=_WIDE,
        element_bytes=_WIDE,
    )  # fmt: skip
    table = PageTable(
        layer_groups=(
            LayerGroup(group_id=_WIDE, global_layer_ids=tuple(range(MAX_LOCAL_LAYERS)),
                       pool=pool, views=(view,)),
        )
    )  # fmt: skip
    name = "gen-" + "f" * 16
    return RankInfo(
        instance_name=name, instance_rank=rank, tp_size=MAX_INSTANCE_RANKS, tp_rank=rank,
        pp_size=1, pp_rank=0, layer_num_per_pp=(MAX_LOCAL_LAYERS,),
        num_kv_heads=MAX_INSTANCE_RANKS, kv_heads_per_rank=1, head_dim=_WIDE,
        tokens_per_block=_WIDE, dtype="bfloat16", element_bytes=_WIDE, layout=Layout.NHD,
        model_fingerprint="f" * 64, protocol_version=PROTOCOL_VERSION,
        control_endpoint=f"tcp://{_LONGEST_HOST}:65535", agent_name=f"{name}#{rank}",
        agent_metadata=b"\xff" * MAX_AGENT_METADATA_BYTES, page_table=table,
        bounce=BounceConfig(size_mb=_WIDE, threshold_bytes=_WIDE),
    )  # fmt: skip


def test_the_largest_instance_info_fits_with_a_margin() -> None:
    ranks = tuple(_widest_rank(rank) for rank in range(MAX_INSTANCE_RANKS))
    size = len(encode(InstanceInfo(protocol_version=PROTOCOL_VERSION, ranks=ranks)))
    check_fits(size, "INSTANCE_INFO")
    assert size <= MAX_CONTROL_PAYLOAD_BYTES
    # The cap is not far above what is needed: it also bounds what a connection can hold.
    assert 2 * size > MAX_CONTROL_PAYLOAD_BYTES
    assert size == pytest.approx(5.45 * 2**20, rel=0.01)  # the figure limits.py documents
    register = len(encode(RegisterPeer(info=ranks[0])))
    assert register < 90 * 1024  # likewise


def test_a_million_blocks_of_request_data_fit() -> None:
    request = RequestData(
        key=MAX_KEY, instance_name="gen-" + "f" * 16, instance_rank=MAX_INSTANCE_RANKS - 1,
        block_ids=(pack_block_ids(range(2**20 - 64)),), num_tokens=_WIDE,
        staging_address=_WIDE, staging_bytes=_WIDE,
    )  # fmt: skip
    check_fits(len(encode(request)), "REQUEST_DATA")


def test_the_frame_cap_adds_the_curve_overhead() -> None:
    assert (
        MAX_CONTROL_FRAME_BYTES
        == MAX_CONTROL_PAYLOAD_BYTES + CURVE_FRAME_OVERHEAD
        == (8 * 2**20 + 33)
    )


def test_a_message_over_the_cap_is_refused_naming_it() -> None:
    check_fits(MAX_CONTROL_PAYLOAD_BYTES, "INSTANCE_INFO")
    with pytest.raises(MessageTooLarge, match=r"INSTANCE_INFO is 8388609 bytes, over .* 8388608"):
        check_fits(MAX_CONTROL_PAYLOAD_BYTES + 1, "INSTANCE_INFO")
