"""The etcd client against a real etcd: keys, leases that expire, a prefix watch."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trio

from tests.etcd_server import Etcd, running_etcd
from trtdisagg.membership.etcd import open_etcd
from trtdisagg.membership.etcd_wire import EtcdError, EventType, LeaseGone

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    with running_etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


async def test_put_get_prefix_and_delete(etcd: Etcd) -> None:
    async with open_etcd(etcd.url) as client:
        assert await client.healthy()
        await client.put(b"/t1/a", b"1")
        revision = await client.put(b"/t1/b", b"2")
        await client.put(b"/t10", b"outside the prefix")
        answer = await client.get_prefix(b"/t1/")
        assert answer.revision >= revision
        assert [(kv.key, kv.value) for kv in answer.kvs] == [(b"/t1/a", b"1"), (b"/t1/b", b"2")]
        await client.delete(b"/t1/a")
        assert await client.get(b"/t1/a") is None
        assert await client.create_if_absent(b"/t1/c", b"first")
        assert not await client.create_if_absent(b"/t1/c", b"second")
        kv = await client.get(b"/t1/c")
        assert kv is not None and kv.value == b"first"


async def test_a_lease_not_kept_alive_deletes_its_key(etcd: Etcd) -> None:
    async with open_etcd(etcd.url) as client:
        lease = await client.grant(2)
        revision = await client.put(b"/t2/k", b"v", lease=lease.id)
        assert await client.keepalive(lease.id) == lease.ttl_s
        async with client.watch(b"/t2/", start_revision=revision + 1) as batches:
            with trio.fail_after(lease.ttl_s + 3):  # etcd checks expiry every 0.5 s
                async for batch in batches:
                    if any(e.type is EventType.DELETE for e in batch.events):
                        break
        assert await client.get(b"/t2/k") is None
        with pytest.raises(LeaseGone):
            await client.keepalive(lease.id)
        with pytest.raises(LeaseGone):
            await client.put(b"/t2/k", b"v", lease=lease.id)


async def test_revoke_deletes_at_once_and_twice_is_no_error(etcd: Etcd) -> None:
    async with open_etcd(etcd.url) as client:
        lease = await client.grant(30)
        await client.put(b"/t3/k", b"v", lease=lease.id)
        await client.revoke(lease.id)
        assert await client.get(b"/t3/k") is None
        await client.revoke(lease.id)


async def test_watch_sees_puts_and_deletes_from_a_revision(etcd: Etcd) -> None:
    async with open_etcd(etcd.url) as client:
        start = await client.put(b"/t4/a", b"1")
        async with client.watch(b"/t4/", start_revision=start) as batches:
            await client.put(b"/t4/b", b"2")
            await client.delete(b"/t4/a")
            seen = []
            with trio.fail_after(10):
                async for batch in batches:
                    seen += [(e.type, e.key, e.value) for e in batch.events]
                    if len(seen) == 3:
                        break
        assert seen == [
            (EventType.PUT, b"/t4/a", b"1"),
            (EventType.PUT, b"/t4/b", b"2"),
            (EventType.DELETE, b"/t4/a", b"1"),
        ]


async def test_an_unreachable_etcd_is_an_etcd_error() -> None:
    async with open_etcd("127.0.0.1:9", call_timeout_s=1.0) as client:
        assert not await client.healthy()
        with pytest.raises(EtcdError, match=r"127\.0\.0\.1:9"):
            await client.put(b"k", b"v")
