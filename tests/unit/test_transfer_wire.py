"""wire: every message round-trips; no input makes `decode` raise anything but ProtocolError."""

from __future__ import annotations

import contextlib

import attrs
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.rank_infos import make_instance
from trtdisagg.kv.page_table import Layout, MapperKind
from trtdisagg.transfer.errors import ProtocolError
from trtdisagg.transfer.protocol import wire
from trtdisagg.transfer.protocol.rank_info import BounceConfig, RankInfo

keys = st.integers(0, wire.MAX_KEY)
ranks = st.integers(0, 2**31)
names = st.text(max_size=24)
packed_ids = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20).map(wire.pack_block_ids)


@st.composite
def rank_infos(draw: st.DrawFn) -> RankInfo:
    tp, pp = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 3))
    layout = draw(st.sampled_from(Layout))
    infos = make_instance(
        instance_name=draw(names),
        tp_size=tp,
        pp_size=pp,
        layer_num_per_pp=tuple(draw(st.lists(st.integers(1, 4), min_size=pp, max_size=pp))),
        num_kv_heads=draw(st.sampled_from([1, 2, 4, 8])),
        head_dim=draw(st.integers(1, 128)),
        tokens_per_block=draw(st.integers(1, 64)),
        num_slots=draw(st.integers(1, 1000)),
        layout=layout,
        kind=draw(st.sampled_from([MapperKind(layout.value), MapperKind.REPLICATED])),
        agent_metadata=lambda rank: draw(st.binary(max_size=64)),
    )
    info = draw(st.sampled_from(infos))
    return attrs.evolve(info, bounce=BounceConfig(size_mb=draw(st.integers(0, 512))))


messages = st.one_of(
    st.builds(wire.RequestInstanceInfo, protocol_version=st.integers(0, 100)),
    st.builds(
        wire.InstanceInfo,
        protocol_version=st.integers(0, 100),
        ranks=st.lists(rank_infos(), max_size=3).map(tuple),
    ),
    st.builds(wire.RegisterPeer, info=rank_infos()),
    st.builds(
        wire.RegisterAck,
        instance_name=names,
        instance_rank=ranks,
        accepted=st.booleans(),
        reason=st.text(max_size=40),
    ),
    st.builds(
        wire.RequestData,
        key=keys,
        instance_name=names,
        instance_rank=ranks,
        block_ids=st.lists(packed_ids, max_size=3).map(tuple),
        num_tokens=st.integers(1, 2**40),
    ),
    st.builds(
        wire.TransferResult,
        key=keys,
        instance_name=names,
        instance_rank=ranks,
        status=st.sampled_from(wire.ResultStatus),
        num_bytes=st.integers(0, 2**50),
        num_descriptors=st.integers(0, 2**30),
        error=st.text(max_size=40),
    ),
    st.builds(wire.Cancel, key=keys, instance_name=names, instance_rank=ranks, reason=names),
    st.builds(wire.WriteNotice, key=keys, instance_name=names, instance_rank=ranks),
)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_round_trip(message: wire.Message) -> None:
    assert wire.decode(wire.encode(message)) == message


token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=4).map(tuple)
notices = st.builds(
    wire.WriteNotice,
    key=keys,
    instance_name=names,
    instance_rank=ranks,
    num_bytes=st.integers(0, 2**50),
    num_descriptors=st.integers(0, 2**30),
    first_tokens=token_ids,
)


@given(notices)
def test_a_notice_round_trips_with_what_its_write_moved(notice: wire.WriteNotice) -> None:
    """gen finishes a rank's part on its write's notice alone: every field must come back."""
    assert wire.decode(wire.encode(notice)) == notice


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        wire.decode(data)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(msgpack_values, st.sampled_from(sorted(wire.MESSAGE_TAGS.values())))
def test_well_formed_msgpack_garbage_raises_only_protocol_error(value: object, tag: str) -> None:
    for candidate in (value, {"type": tag, **value} if isinstance(value, dict) else value):
        with contextlib.suppress(ProtocolError):
            wire.decode(msgpack.packb(candidate))


@settings(max_examples=200, deadline=None)
@given(messages, st.data())
def test_mutated_messages_raise_only_protocol_error(
    message: wire.Message, data: st.DataObject
) -> None:
    fields = msgpack.unpackb(wire.encode(message))
    key = data.draw(st.sampled_from(sorted(fields)))
    fields[key] = data.draw(msgpack_values)
    try:
        decoded = wire.decode(msgpack.packb(fields))
    except ProtocolError:
        return
    assert type(decoded) in wire.MESSAGE_TAGS


def test_a_notice_s_fields_are_checked() -> None:
    notice = wire.WriteNotice(key=7, instance_name="ctx", instance_rank=1, first_tokens=(3,))
    widest = attrs.evolve(notice, key=2**64 - 1)  # 64 random bits fit
    assert wire.decode(wire.encode(widest)) == widest
    fields = _fields(notice)
    with pytest.raises(ProtocolError, match="token id outside"):
        wire.decode(msgpack.packb({**fields, "first_tokens": [2**31]}))
    with pytest.raises(ValueError, match="token id outside"):
        attrs.evolve(notice, first_tokens=(-1,))


def _fields(message: wire.Message) -> dict[str, object]:
    fields: dict[str, object] = msgpack.unpackb(wire.encode(message))
    return fields


CANCEL = wire.Cancel(key=5, instance_name="gen", instance_rank=1)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"type": "NO_SUCH"}, "KeyError: 'NO_SUCH'"),
        ({"extra": 1}, r"extra fields found \(extra\)"),
        ({"key": "5"}, r"expected int @ \$\.key"),
        ({"key": True}, r"expected int @ \$\.key"),
        ({"key": -1}, r"'key' must be >= 0: -1"),
        ({"instance_rank": -3}, "'instance_rank' must be >= 0: -3"),
    ],
)
def test_malformed_fields_name_the_problem(change: dict[str, object], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        wire.decode(msgpack.packb({**_fields(CANCEL), **change}))


def test_missing_field_and_bad_packed_ids() -> None:
    fields = _fields(CANCEL)
    del fields["key"]
    with pytest.raises(ProtocolError, match="required field missing"):
        wire.decode(msgpack.packb(fields))
    request = wire.RequestData(
        key=1, instance_name="g", instance_rank=0, block_ids=(b"",), num_tokens=1
    )
    with pytest.raises(ProtocolError, match="multiples of 8 bytes"):
        wire.decode(msgpack.packb({**_fields(request), "block_ids": [b"123"]}))
    with pytest.raises(ProtocolError, match=r"ExtraData|extra data"):
        wire.decode(wire.encode(CANCEL) + b"\x00")


@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=100))
def test_block_ids_pack_round_trip(ids: list[int]) -> None:
    packed = wire.pack_block_ids(ids)
    assert len(packed) == 8 * len(ids)
    assert wire.unpack_block_ids(packed) == tuple(ids)


def test_tags_are_protocol_names() -> None:
    assert _fields(CANCEL)["type"] == "CANCEL"
    assert set(wire.MESSAGE_TAGS.values()) >= {
        "REQUEST_INSTANCE_INFO",
        "INSTANCE_INFO",
        "REGISTER_PEER",
        "REGISTER_ACK",
        "REQUEST_DATA",
        "TRANSFER_RESULT",
        "CANCEL",
    }
