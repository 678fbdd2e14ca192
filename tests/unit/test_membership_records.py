"""Worker records, keys and the membership a watch builds (pure)."""

from __future__ import annotations

import pytest

from trtdisagg.membership.records import (
    BadRecord,
    Membership,
    WorkerRecord,
    advertised_endpoint,
    advertised_url,
    check_cluster_name,
    check_etcd_url,
    decode_record,
    worker_key,
)


def record(role: str = "ctx", instance: str = "ctx-a", url: str = "http://10.0.0.1:8001"):  # type: ignore[no-untyped-def]
    return WorkerRecord(url=url, role=role, instance=instance, model="tiny",
                        kv_compat={"dtype": "float32", "tokens_per_block": 16})  # fmt: skip


def test_record_round_trips_under_its_key_and_ignores_unknown_fields() -> None:
    r = record()
    key = worker_key("c1", "ctx", "ctx-a")
    assert key == b"/trtdisagg/c1/workers/ctx/ctx-a"
    assert decode_record(key, r.encode(), cluster="c1") == r
    newer = r.encode()[:-1] + b', "zone": "eu-1"}'
    assert decode_record(key, newer, cluster="c1") == r


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        (b"/trtdisagg/c1/workers/ctx", b"{}", "not a worker key"),
        (b"/trtdisagg/c1/workers/tpu/x", b"{}", "not a worker key"),
        (b"/trtdisagg/c1/workers/ctx/ctx-a", b"[1", "not a worker record"),
        (b"/trtdisagg/c1/workers/ctx/ctx-a", b'{"url": "u"}', "not a worker record"),
        (b"/trtdisagg/c1/workers/gen/ctx-a", None, "names role 'ctx'"),
    ],
)
def test_bad_keys_and_values_are_named(key: bytes, value: bytes | None, problem: str) -> None:
    with pytest.raises(BadRecord, match=problem):
        decode_record(key, value if value is not None else record().encode(), cluster="c1")


def test_membership_follows_puts_deletes_and_resets() -> None:
    m = Membership(cluster="c1")
    a, b = record(), record("gen", "gen-b", "http://10.0.0.2:8002")
    ka, kb = worker_key("c1", "ctx", "ctx-a"), worker_key("c1", "gen", "gen-b")
    assert m.put(ka, a.encode()).joined == (a,)
    assert m.put(ka, a.encode()).joined == ()  # the same record again: no change
    m.put(kb, b.encode())
    assert (m.urls("ctx"), m.urls("gen")) == (["http://10.0.0.1:8001"], ["http://10.0.0.2:8002"])
    assert m.delete(ka).left == (a,)
    assert m.delete(ka).left == ()
    change = m.reset([(ka, a.encode()), (b"/trtdisagg/c1/workers/x", b"")])
    assert change.joined == (a,) and change.left == (b,) and len(change.bad) == 1
    assert m.urls("gen") == []
    bad = m.put(ka, b"junk")  # a member whose value turns bad leaves
    assert bad.left == (a,) and bad.bad and m.urls("ctx") == []


def test_a_url_stays_while_any_key_holds_it() -> None:
    """A worker restarted on the same port registers a new instance before the old lease
    expires: the url serves until both keys are gone."""
    m = Membership(cluster="c1")
    old, new = record(instance="ctx-old"), record(instance="ctx-new")
    m.put(worker_key("c1", "ctx", "ctx-old"), old.encode())
    m.put(worker_key("c1", "ctx", "ctx-new"), new.encode())
    m.delete(worker_key("c1", "ctx", "ctx-old"))
    assert m.urls("ctx") == ["http://10.0.0.1:8001"]


def test_advertised_addresses_replace_only_a_wildcard() -> None:
    assert advertised_url("http://0.0.0.0:8001", "198.18.0.2") == "http://198.18.0.2:8001"
    assert advertised_url("http://127.0.0.1:8001", None) == "http://127.0.0.1:8001"
    assert advertised_url("http://[::]:8001", "fd00::2") == "http://[fd00::2]:8001"
    assert advertised_endpoint("tcp://0.0.0.0:5555", "198.18.0.2") == "tcp://198.18.0.2:5555"
    assert advertised_endpoint("tcp://198.18.0.3:5555", "198.18.0.2") == "tcp://198.18.0.3:5555"
    assert advertised_endpoint("tcp://0.0.0.0:5555", None) == "tcp://0.0.0.0:5555"


def test_cluster_names_and_etcd_urls() -> None:
    assert check_cluster_name("prod-1.eu_west") is None
    for bad in ("", "a/b", "-x", "x" * 64):
        assert check_cluster_name(bad) is not None
    assert check_etcd_url("http://etcd:2379") is None and check_etcd_url("127.0.0.1:2379") is None
    for bad in ("etcd", "http://etcd", "ftp://e:1", "e:99999"):
        assert check_etcd_url(bad) is not None
