"""etcd's v3 JSON gateway as data: bodies, answers and watch lines, as etcd 3.4 sends them."""

from __future__ import annotations

import json

import pytest

from trtdisagg.membership import etcd_wire as wire
from trtdisagg.membership.etcd_wire import EventType


def b64(text: str) -> str:
    return wire.encode_bytes(text.encode())


def test_prefix_end_covers_exactly_the_prefix() -> None:
    assert wire.prefix_end(b"/a/") == b"/a0"
    assert wire.prefix_end(b"a\xff") == b"b"
    assert wire.prefix_end(b"\xff\xff") == b"\0"
    prefix = b"/trtdisagg/c/workers/"
    end = wire.prefix_end(prefix)
    for key in (prefix, prefix + b"ctx/x", prefix + b"\xff"):
        assert prefix <= key < end
    assert not end > b"/trtdisagg/c/workers0"


def test_bodies_carry_base64_keys_and_string_integers() -> None:
    assert wire.put_body(b"k", b"v", lease=7) == {"key": b64("k"), "value": b64("v"), "lease": "7"}
    assert "lease" not in wire.put_body(b"k", b"v")
    assert wire.range_body(b"/p/", prefix=True) == {"key": b64("/p/"), "range_end": b64("/p0")}
    watch = wire.watch_body(b"/p/", start_revision=12)["create_request"]
    assert watch["start_revision"] == "12" and watch["prev_kv"] is True
    txn = wire.create_if_absent_body(b"k", b"v")
    assert txn["compare"][0]["create_revision"] == "0"


def test_range_answer_with_and_without_keys() -> None:
    header = {"cluster_id": "1", "member_id": "2", "revision": "9", "raft_term": "2"}
    empty = wire.RangeAnswer.parse({"header": header})
    assert empty.revision == 9 and empty.kvs == ()
    full = wire.RangeAnswer.parse({"header": header, "count": "1", "kvs": [
        {"key": b64("a"), "create_revision": "3", "mod_revision": "4", "version": "1",
         "value": b64("x"), "lease": "77"}]})  # fmt: skip
    assert full.kvs == (wire.KeyValue(key=b"a", value=b"x", mod_revision=4, lease=77),)


def test_keepalive_of_a_live_and_of_an_expired_lease() -> None:
    header = {"revision": "5"}
    assert wire.parse_keepalive({"result": {"header": header, "ID": "8", "TTL": "10"}}) == 10
    with pytest.raises(wire.LeaseGone):  # expired: the TTL (0) is left out
        wire.parse_keepalive({"result": {"header": header, "ID": "8"}})
    with pytest.raises(wire.LeaseGone):
        wire.parse_keepalive({"error": "etcdserver: requested lease not found", "code": 5,
                              "message": "etcdserver: requested lease not found"})  # fmt: skip


def test_error_bodies_raise_with_etcd_s_message() -> None:
    with pytest.raises(wire.EtcdError, match="too many operations"):
        wire.parse_revision({"error": "x", "code": 3, "message": "too many operations in txn"})
    with pytest.raises(wire.EtcdProtocolError, match=r"\$: expected an object"):
        wire.parse_revision([1])


def test_watch_lines_created_put_delete_and_canceled() -> None:
    header = {"revision": "6"}
    created = wire.parse_watch_line(json.dumps({"result": {"header": header, "created": True}}))
    assert created.created and created.events == ()
    line = json.dumps({"result": {"header": header, "events": [
        {"kv": {"key": b64("a"), "mod_revision": "5", "value": b64("1")}},
        {"type": "DELETE", "kv": {"key": b64("b"), "mod_revision": "6"},
         "prev_kv": {"key": b64("b"), "mod_revision": "2", "value": b64("old")}},
    ]}})  # fmt: skip
    batch = wire.parse_watch_line(line)
    assert batch.revision == 6
    assert [(e.type, e.key, e.value, e.revision) for e in batch.events] == [
        (EventType.PUT, b"a", b"1", 5),
        (EventType.DELETE, b"b", b"old", 6),
    ]
    canceled = wire.parse_watch_line(json.dumps({"result": {
        "header": header, "canceled": True, "compact_revision": "4",
        "cancel_reason": "mvcc: required revision has been compacted"}}))  # fmt: skip
    assert canceled.canceled and canceled.compact_revision == 4


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("not json", "not JSON"),
        ('{"result": {"events": [{"type": "MOVE", "kv": {"key": "YQ=="}}]}}', "MOVE"),
        ('{"result": {"events": [{"kv": {"key": "!!"}}]}}', "not base64"),
        ('{"result": {"header": {"revision": "x"}}}', "revision"),
        ('{"result": {"events": {}}}', "expected a list"),
    ],
)
def test_malformed_watch_lines_name_the_problem(line: str, problem: str) -> None:
    with pytest.raises(wire.EtcdProtocolError, match=problem):
        wire.parse_watch_line(line)
