"""A small etcd v3 client over the HTTP/JSON gateway: httpx under Trio, no gRPC, no threads.

Only what membership needs: leases (grant, keepalive, revoke), put (optionally under a lease
or only if absent), get and delete, a prefix range, and a prefix watch. Bodies and answers are
built and parsed by `etcd_wire` (pure); this module only moves them.

Every call has its own deadline (`call_timeout_s`); a watch has none on reading, since a quiet
prefix sends nothing for as long as nothing changes: whoever watches also probes `healthy()`
to tell a quiet etcd from a lost one.

Errors: every transport failure, error answer or malformed body is an `EtcdError` (a
`LeaseGone` when the lease named has expired), never an httpx exception.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, Final

import attrs
import httpx

from trtdisagg.membership import etcd_wire as wire
from trtdisagg.membership.etcd_wire import EtcdError, KeyValue, RangeAnswer, WatchBatch

CALL_TIMEOUT_S: Final = 5.0


def normalize_etcd_url(url: str) -> str:
    """``host:port`` or ``http://host:port[/]`` → ``http://host:port``."""
    url = url.strip().rstrip("/")
    return url if url.startswith(("http://", "https://")) else f"http://{url}"


@attrs.frozen(kw_only=True)
class Lease:
    id: int
    ttl_s: int


@attrs.define(eq=False, kw_only=True)
class EtcdClient:
    """One etcd endpoint. The caller owns `http` (and closes it); see `open_etcd`."""

    url: str
    http: httpx.AsyncClient
    call_timeout_s: float = CALL_TIMEOUT_S

    async def _post(self, path: str, body: Any, *, timeout_s: float | None = None) -> object:
        try:
            response = await self.http.post(
                f"{self.url}{wire.API}{path}", json=body, timeout=timeout_s or self.call_timeout_s
            )
        except httpx.HTTPError as exc:
            raise EtcdError(f"etcd at {self.url}: {type(exc).__name__}: {exc}") from None
        try:
            data = response.json()
        except ValueError:
            raise EtcdError(
                f"etcd at {self.url}{wire.API}{path} answered {response.status_code} "
                f"with a body that is not JSON: {response.text[:200]!r}"
            ) from None
        if response.status_code != 200:
            wire.check_error(data)  # raises with etcd's own message when it has one
            raise EtcdError(f"etcd at {self.url}{wire.API}{path} answered {response.status_code}")
        return data

    async def healthy(self, *, timeout_s: float | None = None) -> bool:
        """Whether etcd answers a read (its store, not only its HTTP port)."""
        try:
            await self._post("/kv/range", wire.range_body(b"\0"), timeout_s=timeout_s)
        except EtcdError:
            return False
        return True

    # ---- leases ----

    async def grant(self, ttl_s: int) -> Lease:
        lease, ttl = wire.parse_grant(await self._post("/lease/grant", wire.grant_body(ttl_s)))
        return Lease(id=lease, ttl_s=ttl)

    async def keepalive(self, lease: int) -> int:
        """Renew `lease`; its new TTL. Raises LeaseGone when it expired meanwhile."""
        return wire.parse_keepalive(await self._post("/lease/keepalive", wire.lease_body(lease)))

    async def revoke(self, lease: int) -> None:
        """Revoke `lease`, deleting its keys at once (a lease already gone is no error)."""
        with contextlib.suppress(wire.LeaseGone):
            await self._post("/lease/revoke", wire.lease_body(lease))

    # ---- keys ----

    async def put(self, key: bytes, value: bytes, *, lease: int | None = None) -> int:
        """Set `key`; the new revision."""
        return wire.parse_revision(
            await self._post("/kv/put", wire.put_body(key, value, lease=lease))
        )

    async def create_if_absent(self, key: bytes, value: bytes, *, lease: int | None = None) -> bool:
        """Set `key` only when no one holds it; whether this call set it."""
        body = wire.create_if_absent_body(key, value, lease=lease)
        return wire.parse_txn_succeeded(await self._post("/kv/txn", body))

    async def get(self, key: bytes) -> KeyValue | None:
        answer = RangeAnswer.parse(await self._post("/kv/range", wire.range_body(key)))
        return answer.kvs[0] if answer.kvs else None

    async def get_prefix(self, prefix: bytes) -> RangeAnswer:
        """Every key under `prefix`, and the revision they were read at."""
        return RangeAnswer.parse(
            await self._post("/kv/range", wire.range_body(prefix, prefix=True))
        )

    async def delete(self, key: bytes) -> int:
        """Delete `key`; the new revision."""
        return wire.parse_revision(await self._post("/kv/deleterange", wire.delete_body(key)))

    # ---- watch ----

    @contextlib.asynccontextmanager
    async def watch(
        self, prefix: bytes, *, start_revision: int
    ) -> AsyncIterator[AsyncIterator[WatchBatch]]:
        """Watch every key under `prefix` from `start_revision` on::

            async with client.watch(prefix, start_revision=rev + 1) as batches:
                async for batch in batches: ...

        The iterator ends when etcd ends the stream (raising EtcdError, since a watch is meant
        to last) or cancels the watch (a `canceled` batch, e.g. the revision was compacted).
        """
        timeout = httpx.Timeout(self.call_timeout_s, read=None)
        body = wire.watch_body(prefix, start_revision=start_revision)
        try:
            async with self.http.stream(
                "POST", f"{self.url}{wire.API}/watch", json=body, timeout=timeout
            ) as response:
                if response.status_code != 200:
                    raise EtcdError(f"etcd watch at {self.url} answered {response.status_code}")
                yield self._batches(response)
        except httpx.HTTPError as exc:
            raise EtcdError(f"etcd watch at {self.url}: {type(exc).__name__}: {exc}") from None

    async def _batches(self, response: httpx.Response) -> AsyncIterator[WatchBatch]:
        try:
            async for line in response.aiter_lines():
                if line.strip():
                    yield wire.parse_watch_line(line)
        except httpx.HTTPError as exc:
            raise EtcdError(f"etcd watch at {self.url}: {type(exc).__name__}: {exc}") from None
        raise EtcdError(f"etcd watch at {self.url}: the stream ended")


@contextlib.asynccontextmanager
async def open_etcd(
    url: str, *, call_timeout_s: float = CALL_TIMEOUT_S
) -> AsyncIterator[EtcdClient]:
    """An `EtcdClient` with its own connection pool, closed on exit."""
    async with httpx.AsyncClient(trust_env=False) as http:
        yield EtcdClient(url=normalize_etcd_url(url), http=http, call_timeout_s=call_timeout_s)
