"""A front end's view of the registered workers, kept by a prefix watch on etcd.

Lifecycle::

    read prefix ─> started() ─> watch from revision + 1 ─> apply each batch ─> on_change()
        ▲                                      │ stream ends, etcd errors, or the probe fails
        └──────── retry every RETRY_S ─────────┘ (membership kept, marked stale)

* The first read must succeed within the caller's deadline (start-up); until then nothing is
  known and nothing can be served.
* A quiet watch sends nothing, so a lost etcd (a partition, not a closed connection) would go
  unseen: a probe reads etcd every `PROBE_S`, and `PROBE_MISSES` misses in a row count as lost.
* Lost etcd: the last membership is kept and served, `stale` says since when and why, and one
  log line says so; the watch is retried. Back: the prefix is read again in full (events missed
  meanwhile, expired leases included, are in that read), one log line, `stale` clears.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

import attrs
import trio

from trtdisagg.membership.etcd import EtcdClient
from trtdisagg.membership.etcd_wire import EtcdError, EventType
from trtdisagg.membership.records import Membership, MembershipChange, workers_prefix

log = logging.getLogger(__name__)

RETRY_S: Final = 1.0
PROBE_S: Final = 1.0
PROBE_TIMEOUT_S: Final = 1.0
PROBE_MISSES: Final = 2


@attrs.frozen(kw_only=True)
class Stale:
    since: float
    """`trio.current_time()` when etcd was found lost."""
    reason: str


@attrs.define(eq=False, kw_only=True)
class MemberWatch:
    etcd: EtcdClient
    membership: Membership
    on_change: Callable[[MembershipChange], None]
    stale: Stale | None = None
    _misses: int = 0

    @property
    def prefix(self) -> bytes:
        return workers_prefix(self.membership.cluster)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep `membership` current until cancelled; `started()` after the first full read."""
        revision = await self._read_until_answered(first=True)
        task_status.started()
        while True:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._probe, nursery.cancel_scope)
                try:
                    await self._follow(revision)
                except EtcdError as exc:
                    self._lost(str(exc))
                nursery.cancel_scope.cancel()
            await trio.sleep(RETRY_S)
            revision = await self._read_until_answered(first=False)

    async def _read_until_answered(self, *, first: bool) -> int:
        while True:
            try:
                answer = await self.etcd.get_prefix(self.prefix)
            except EtcdError as exc:
                if not first:
                    self._lost(str(exc))
                elif self._misses == 0:
                    log.warning("etcd at %s not answering yet: %s", self.etcd.url, exc)
                self._misses += 1
                await trio.sleep(RETRY_S)
                continue
            self._misses = 0
            change = self.membership.reset((kv.key, kv.value) for kv in answer.kvs)
            if self.stale is not None:
                log.warning(
                    "etcd at %s is back after %.1f s: membership is live again",
                    self.etcd.url, trio.current_time() - self.stale.since,
                )  # fmt: skip
                self.stale = None
            self._report(change)
            return answer.revision

    async def _follow(self, revision: int) -> None:
        async with self.etcd.watch(self.prefix, start_revision=revision + 1) as batches:
            async for batch in batches:
                if batch.canceled:
                    raise EtcdError(
                        f"etcd canceled the watch: {batch.cancel_reason or 'no reason'}"
                    )
                for event in batch.events:
                    if event.type is EventType.PUT:
                        self._report(self.membership.put(event.key, event.value))
                    else:
                        self._report(self.membership.delete(event.key))

    async def _probe(self, watch: trio.CancelScope) -> None:
        misses = 0
        while True:
            await trio.sleep(PROBE_S)
            if await self.etcd.healthy(timeout_s=PROBE_TIMEOUT_S):
                misses = 0
                continue
            misses += 1
            if misses >= PROBE_MISSES:
                self._lost(f"{misses} reads in a row got no answer within {PROBE_TIMEOUT_S:g} s")
                watch.cancel()
                return

    def _lost(self, reason: str) -> None:
        if self.stale is None:
            self.stale = Stale(since=trio.current_time(), reason=reason)
            log.error(
                "lost etcd at %s (%s): serving the last known membership (%d workers) until it "
                "is back",
                self.etcd.url, reason, len(self.membership.members),
            )  # fmt: skip

    def _report(self, change: MembershipChange) -> None:
        for record in change.joined:
            log.info("%s worker %s joined (%s)", record.role, record.url, record.instance)
        for record in change.left:
            log.info("%s worker %s left (%s)", record.role, record.url, record.instance)
        for why in change.bad:
            log.warning("ignoring a key in etcd: %s", why)
        if change.joined or change.left:
            self.on_change(change)
