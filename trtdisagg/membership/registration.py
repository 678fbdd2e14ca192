"""A worker's membership: its key in etcd under a lease it keeps alive, and its drain.

Lifecycle of one registration::

    grant lease ─> put key ─> started() ─> keepalive every ttl/3 ──SIGTERM──> revoke (key gone)
                     ▲                        │ lease gone (etcd lost it,     ─> wait until no
                     └── grant again ─────────┘ or we were away > ttl)           request or KV
                                                                                  transfer is in
                                                 cancelled: revoke (shielded)     flight ─> stop()

* Start-up retries until etcd answers, so workers may start before etcd does; `started()`
  comes once the key is written.
* etcd unreachable while serving: renewals are retried every second. If the lease expired
  meanwhile, the key is written again under a new one as soon as etcd is back.
* SIGTERM, while this service runs, means *drain*: the key is deleted first (front ends take
  the worker out of rotation on the watch event), then the worker keeps serving until nothing
  has been in flight for `QUIET_S` (a request a front end placed just before the event still
  arrives and is served), for at most ``cluster.drain_timeout_s``, and then `stop()` ends the
  worker. A second SIGTERM stops at once. SIGINT is left to the process (it stops at once).
  The process's own SIGTERM handling is restored when this service ends.
* Cancelled (the worker stops): the lease is revoked, shielded and bounded, so the key goes
  at once rather than after a TTL.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Final

import attrs
import trio

from trtdisagg.config import ClusterConfig
from trtdisagg.membership.etcd import EtcdClient, Lease, open_etcd
from trtdisagg.membership.etcd_wire import EtcdError, LeaseGone
from trtdisagg.membership.records import WorkerRecord, worker_key

log = logging.getLogger(__name__)

RETRY_S: Final = 1.0
LOG_EVERY_S: Final = 10.0
REVOKE_TIMEOUT_S: Final = 2.0
QUIET_S: Final = 1.0
DRAIN_POLL_S: Final = 0.05


@attrs.frozen(kw_only=True)
class Drain:
    """How the worker drains: `busy()` while a request or a KV transfer is in flight;
    `stop()` ends the worker once it is not."""

    busy: Callable[[], bool]
    stop: Callable[[], None]


@attrs.define(eq=False, kw_only=True)
class Registration:
    etcd: EtcdClient
    cluster: ClusterConfig
    record: WorkerRecord
    lease: Lease | None = None
    deregistered: bool = False

    @property
    def key(self) -> bytes:
        return worker_key(self.cluster.name, self.record.role, self.record.instance)

    async def register(self) -> None:
        """Grant a lease and write the key under it; retried until etcd answers."""
        failing_since: float | None = None
        while True:
            try:
                lease = await self.etcd.grant(self.cluster.lease_ttl_s)
                await self.etcd.put(self.key, self.record.encode(), lease=lease.id)
            except EtcdError as exc:
                now = trio.current_time()
                if failing_since is None or now - failing_since >= LOG_EVERY_S:
                    log.warning("cannot register in etcd at %s yet: %s", self.etcd.url, exc)
                    failing_since = now
                await trio.sleep(RETRY_S)
                continue
            self.lease = lease
            log.info(
                "registered in etcd at %s as %s (lease %x, ttl %d s)",
                self.etcd.url, self.key.decode(), lease.id, lease.ttl_s,
            )  # fmt: skip
            return

    async def keep_alive(self) -> None:
        """Renew the lease every third of its TTL; register again if it was lost."""
        while True:
            assert self.lease is not None
            await trio.sleep(max(self.lease.ttl_s / 3, 0.2))
            try:
                await self.etcd.keepalive(self.lease.id)
            except LeaseGone:
                log.warning("etcd lease %x expired: registering again", self.lease.id)
                await self.register()
            except EtcdError as exc:
                log.warning("cannot renew the etcd lease (retrying): %s", exc)
                await self._renew_until_answered()

    async def _renew_until_answered(self) -> None:
        assert self.lease is not None
        while True:
            await trio.sleep(RETRY_S)
            try:
                await self.etcd.keepalive(self.lease.id)
            except LeaseGone:
                log.warning("etcd is back but lease %x expired: registering again", self.lease.id)
                await self.register()
                return
            except EtcdError:
                continue
            log.info("etcd at %s answers again; lease %x renewed", self.etcd.url, self.lease.id)
            return

    async def deregister(self) -> None:
        """Delete the key (revoke the lease); failures are logged, the TTL then does it."""
        if self.lease is None or self.deregistered:
            return
        self.deregistered = True
        try:
            await self.etcd.revoke(self.lease.id)
        except EtcdError as exc:
            log.warning("could not revoke the etcd lease (the key expires in %d s): %s",
                        self.lease.ttl_s, exc)  # fmt: skip
            return
        log.info("deregistered %s from etcd", self.key.decode())


async def serve_registration(
    cluster: ClusterConfig,
    record: WorkerRecord,
    *,
    drain: Drain | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Register `record` in `cluster`'s etcd and keep it there until cancelled or drained.

    Resource handling: one etcd client (its own connection pool), closed on exit; the lease is
    revoked on the way out, whatever the way.
    """
    async with open_etcd(cluster.etcd) as etcd:
        registration = Registration(etcd=etcd, cluster=cluster, record=record)
        try:
            await registration.register()
            task_status.started()
            keepalive = trio.CancelScope()

            async def keep_alive() -> None:
                with keepalive:
                    await registration.keep_alive()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep_alive)
                if drain is not None:
                    nursery.start_soon(_drain_on_sigterm, registration, drain, keepalive)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(REVOKE_TIMEOUT_S):
                await registration.deregister()


async def _drain_on_sigterm(
    registration: Registration, drain: Drain, keepalive: trio.CancelScope
) -> None:
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            break
        log.info("SIGTERM: draining (leaving the cluster, then finishing in-flight requests)")
        keepalive.cancel()
        with trio.move_on_after(REVOKE_TIMEOUT_S):
            await registration.deregister()
        async with trio.open_nursery() as nursery:

            async def stop_on_second_signal() -> None:
                async for _ in signals:
                    log.warning("SIGTERM again: stopping without waiting for the drain")
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_second_signal)
            await _wait_quiet(drain, registration.cluster.drain_timeout_s)
            nursery.cancel_scope.cancel()
    drain.stop()


async def _wait_quiet(drain: Drain, timeout_s: float) -> None:
    """Until nothing has been in flight for `QUIET_S` (or `timeout_s` has passed)."""
    started = trio.current_time()
    with trio.move_on_after(timeout_s) as scope:
        quiet_since = trio.current_time()
        while trio.current_time() - quiet_since < QUIET_S:
            # The executor has no event for "nothing in flight"; this is its only poller.
            await trio.sleep(DRAIN_POLL_S)
            if drain.busy():
                quiet_since = trio.current_time()
    if scope.cancelled_caught:
        log.warning("drain_timeout_s=%g passed with requests still in flight; stopping", timeout_s)
    else:
        log.info("drained in %.2f s: nothing in flight", trio.current_time() - started)
