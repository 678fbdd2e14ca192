"""LocalPlacement: cluster state, health checks, routers and KV event polling in this process.

Tasks (all in the nursery of `serve`):

* health monitor: every ``health_check_interval`` (0.25 s while starting) checks every server's
  ``GET /health`` in parallel; a server that passes gets its ``GET /server_info`` read (again
  after each recovery, as a restart may change it) and rejoins the routers; two failed checks
  in a row, or one request that could not reach it, take it out of rotation;
* KV event pollers (roles whose router is `kv_cache_aware`): once before the first request is
  placed, then every ``events_poll_interval``, read each server's ``POST /kv_cache_events``
  after the last event id seen here (a cursor of this front end's own: the others of a fleet
  read the same events) into the router. A server is also polled right after each request it
  served (in `finish`), so a prefix stored by one request is visible to the next.

Start-up waits until every listed server is healthy, or ``server_start_timeout``. If by then a
role has no healthy server at all, start-up fails naming the missing servers; otherwise it logs
the missing ones and serves with the rest (they join when they become healthy). It also fails
when the healthy servers include no ctx that can exchange KV with a gen: the message
names the field and both values (`Cluster.pairing_reason`); a misconfigured pair would otherwise
answer every request with a 502. A pair that cannot exchange KV is logged once as it appears.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import Counter
from typing import Any, Final

import attrs
import trio

from trtdisagg.coordinator.cluster import Cluster, ServerInfo, ServerRole
from trtdisagg.coordinator.config import CoordinatorConfig, RouterType, normalize_url
from trtdisagg.coordinator.routers import (
    Router,
    RouteRequest,
    Selection,
    create_router,
    parse_kv_events,
)
from trtdisagg.coordinator.upstream import UpstreamError, WorkerClient
from trtdisagg.errors import StartupError
from trtdisagg.membership.etcd import open_etcd
from trtdisagg.membership.records import Membership, MembershipChange
from trtdisagg.membership.watch import MemberWatch

log = logging.getLogger(__name__)

Json = dict[str, Any]

STARTUP_POLL_INTERVAL: Final = 0.25
FAILED_CHECKS_TO_EVICT: Final = 2
# A health probe whose timeout fired this much late was timed by a stalled loop, not the server.
LATE_LOOP_S: Final = 0.25
EVENTS_TIMEOUT: Final = 2.0
WAITING_LOG_INTERVAL: Final = 5.0


@attrs.define(eq=False, kw_only=True)
class LocalPlacement:
    config: CoordinatorConfig
    cluster: Cluster
    routers: dict[ServerRole, Router]
    client: WorkerClient
    _changed: trio.Event = attrs.field(factory=trio.Event)
    _misses: Counter[str] = attrs.field(factory=Counter)
    _answered: dict[str, float] = attrs.field(factory=dict)  # url -> last request answered OK
    _reported: dict[str, float] = attrs.field(factory=dict)  # url -> last report_unreachable
    _event_locks: dict[str, trio.Lock] = attrs.field(factory=dict)
    _last_event_id: dict[str, int] = attrs.field(factory=dict)
    _logged_pairs: set[tuple[str, str, str]] = attrs.field(factory=set)
    _check_now: trio.Event = attrs.field(factory=trio.Event)
    watch: MemberWatch | None = None
    """The etcd membership watch, when the servers come from etcd (`cluster:`)."""

    @classmethod
    def create(cls, config: CoordinatorConfig, client: WorkerClient) -> LocalPlacement:
        groups = {
            ServerRole.CONTEXT: config.context_servers,
            ServerRole.GENERATION: config.generation_servers,
        }
        return cls(
            config=config,
            cluster=Cluster.from_config(config),
            routers={
                role: create_router(group.router, role=role.value) for role, group in groups.items()
            },
            client=client,
        )

    # ---- queries ----

    def is_ready(self) -> bool:
        return self.cluster.is_ready()

    def not_ready_reason(self) -> str:
        return self.cluster.not_ready_reason()

    def cluster_info(self) -> Json:
        info = self.cluster.cluster_info()
        if (membership := self.membership_status()) is not None:
            info["membership"] = membership
        return info

    def membership_status(self) -> Json | None:
        """Where the servers come from, when from etcd: and whether that view is stale."""
        if self.watch is None or self.config.cluster is None:
            return None
        status: Json = {
            "etcd": self.config.cluster.etcd,
            "cluster": self.config.cluster.name,
            "stale": self.watch.stale is not None,
        }
        if self.watch.stale is not None:
            status["stale_for_s"] = round(trio.current_time() - self.watch.stale.since, 3)
            status["reason"] = self.watch.stale.reason
        return status

    def server_info(self, url: str) -> ServerInfo | None:
        server = self.cluster.servers.get(url)
        return server.info if server is not None else None

    def model_info(self) -> ServerInfo | None:
        return self.cluster.first_info()

    def router_type(self, role: ServerRole) -> RouterType:
        return self.routers[role].type

    def uses_prompt_tokens(self, role: ServerRole) -> bool:
        return self.routers[role].uses_prompt_tokens

    # ---- reservations ----

    async def select(
        self,
        role: ServerRole,
        request: RouteRequest,
        *,
        exclude: str | None,
        pair_with: str | None = None,
    ) -> Selection:
        await trio.lowlevel.checkpoint()
        pairing = self.cluster.pairing(pair_with) if pair_with is not None else None
        return self.routers[role].select(request, exclude=exclude, pairing=pairing)

    async def finish(self, role: ServerRole, key: int, *, success: bool) -> None:
        router = self.routers[role]
        server = router.finish(key, success=success)  # sync: released even if cancelled below
        if server is not None and success:
            self._answered[server] = trio.current_time()
        state = self.cluster.servers.get(server) if server is not None else None
        if server is not None and router.needs_kv_events and state is not None and state.healthy:
            await self.poll_kv_events(role, server)

    def report_unreachable(self, role: ServerRole, url: str, reason: str) -> None:
        """A request could not reach `url`, or it missed a deadline: out of rotation at once,
        back after a health check started after this report passes."""
        if url not in self.cluster.servers:
            return
        self._reported[url] = trio.current_time()
        if self.cluster.mark_unhealthy(url, reason):
            log.warning("%s server %s taken out of rotation: %s", role.value, url, reason)
            self._servers_changed(role)

    # ---- background ----

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Health checks and KV event polling (and the etcd membership watch, with `cluster`);
        `started()` once start-up waiting is over.

        Raises:
            StartupError: after ``server_start_timeout`` a role still has no healthy server, or
                etcd never answered.
        """
        async with contextlib.AsyncExitStack() as stack:
            membership = self.config.cluster
            etcd = (
                await stack.enter_async_context(open_etcd(membership.etcd)) if membership else None
            )
            nursery = await stack.enter_async_context(trio.open_nursery())
            if etcd is not None and membership is not None:
                self.watch = MemberWatch(
                    etcd=etcd,
                    membership=Membership(cluster=membership.name),
                    on_change=self._members_changed,
                )
                timeout = self.config.server_start_timeout
                with trio.move_on_after(timeout) as waiting:
                    await nursery.start(self.watch.serve)
                if waiting.cancelled_caught:
                    raise StartupError(
                        f"etcd at {etcd.url} did not answer within server_start_timeout="
                        f"{timeout:g}s; cannot learn the cluster's workers"
                    )
            await nursery.start(self._monitor)
            await self._wait_for_servers()
            for role, router in self.routers.items():
                if router.needs_kv_events:
                    # What the workers hold already, before the first request is placed.
                    await self._poll_kv_events_once(role)
                    nursery.start_soon(self._poll_kv_events_forever, role)
            task_status.started()

    def _members_changed(self, change: MembershipChange) -> None:
        """Make the served set the registered one: joiners are checked at once (they serve once
        healthy), leavers are out of rotation now."""
        assert self.watch is not None
        roles = {ServerRole.CONTEXT: "ctx", ServerRole.GENERATION: "gen"}
        for role, name in roles.items():
            wanted = {u for u in map(normalize_url, self.watch.membership.urls(name)) if u}
            known = {s.url for s in self.cluster.of_role(role)}
            for url in known - wanted:
                self.cluster.remove_server(url)
                self._forget(url)
                log.info("%s server %s is out of rotation: it left the cluster", role.value, url)
            for url in wanted - known:
                self.cluster.add_server(url, role)
        self._servers_changed(ServerRole.GENERATION)
        self._check_now.set()

    def _forget(self, url: str) -> None:
        self._misses.pop(url, None)
        self._answered.pop(url, None)
        self._last_event_id.pop(url, None)
        self._event_locks.pop(url, None)
        for router in self.routers.values():
            router.reset_server(url)

    async def _wait_for_servers(self) -> None:
        if self.watch is not None:
            # Members come and go (each joins once healthy): none yet, or none that pairs, is
            # a state to wait out with /health 503 saying why, not a reason to stop. The
            # members known now have had their first health check (`_monitor` started).
            self.cluster.started = True
            state = "ready" if self.cluster.is_ready() else self.cluster.not_ready_reason()
            log.info("Serving the workers registered in etcd (%s)", state)
            return
        timeout = self.config.server_start_timeout
        deadline = trio.current_time() + timeout
        next_log = trio.current_time()
        while not self.cluster.all_healthy() and trio.current_time() < deadline:
            if trio.current_time() >= next_log:
                log.info(
                    "Waiting for servers, context: %s, generation: %s",
                    self.cluster.missing(ServerRole.CONTEXT),
                    self.cluster.missing(ServerRole.GENERATION),
                )
                next_log = trio.current_time() + WAITING_LOG_INTERVAL
            with trio.move_on_at(min(deadline, next_log)):
                await self._wait_changed()
        missing = {role.value: self.cluster.missing(role) for role in ServerRole}
        if why := self.cluster.pairing_reason():
            raise StartupError(why)
        if not self.cluster.has_each_role():
            raise StartupError(
                f"servers not healthy after server_start_timeout={timeout:g}s: "
                f"context missing {missing['context']}, generation missing {missing['generation']}"
            )
        self.cluster.started = True
        if self.cluster.all_healthy():
            log.info("All servers are ready")
        else:
            log.warning("Serving without servers that are not healthy yet: %s", missing)

    async def _wait_changed(self) -> None:
        await self._changed.wait()

    def _servers_changed(self, role: ServerRole) -> None:
        # Both roles: a server of one role joining or leaving can put servers of the other one
        # into or out of rotation (only those that can exchange KV with a peer serve).
        for each in ServerRole:
            self.routers[each].update_servers(self.cluster.views(each))
        for pair in self.cluster.incompatible:
            key = (pair.context, pair.generation, pair.reason)
            if key not in self._logged_pairs:
                self._logged_pairs.add(key)
                log.warning(
                    "context server %s and generation server %s cannot exchange KV: %s",
                    pair.context,
                    pair.generation,
                    pair.reason,
                )
        self._changed.set()
        self._changed = trio.Event()

    async def _monitor(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        first = True
        while True:
            async with trio.open_nursery() as nursery:
                for url in self.cluster.servers:
                    nursery.start_soon(self._check, url)
            if first:
                task_status.started()
                first = False
            if not self.cluster.started:
                interval = min(self.config.health_check_interval, STARTUP_POLL_INTERVAL)
            else:
                interval = self.config.health_check_interval
            with trio.move_on_after(interval):
                await self._check_now.wait()  # a server joined: check it now, not next round
            self._check_now = trio.Event()

    async def _check(self, url: str) -> None:
        server = self.cluster.servers[url]
        role = server.role
        timeout = self.config.health_check_timeout
        if timeout is None:  # generous: a CPU worker in a long forward can answer /health late
            timeout = min(max(2 * self.config.health_check_interval, 2.0), 5.0)
        started = trio.current_time()
        check = await self.client.is_healthy(url, limit_s=timeout)
        ok, why = check.ok, check.reason
        info = server.info
        # Restarted since the last check, without failing one: its settings may have changed
        # (a kv_compat that no longer pairs) and its cache is empty, whatever events said.
        restarted = (
            ok and None not in (server.boot_id, check.boot_id) and (server.boot_id != check.boot_id)
        )
        if ok and (not server.healthy or info is None or restarted):
            try:
                data = await self.client.get_json(
                    url, "/server_info", limit_s=timeout, role=role.value
                )
                info = ServerInfo.parse(data)
            except UpstreamError as exc:
                ok, why = False, str(exc)
        if self.cluster.servers.get(url) is not server:
            return  # it left the cluster while we checked it
        if ok and self._reported.get(url, -math.inf) >= started:
            return  # answered a probe sent before it failed a request: that says nothing
        if ok and info is not None:
            self._misses.pop(url, None)
            was_known = server.ever_healthy
            changed = self.cluster.mark_healthy(url, info, check.boot_id)
            if restarted:
                log.info("%s server %s restarted since its last health check", role.value, url)
                self.routers[role].reset_server(url)
                self._last_event_id.pop(url, None)
            if changed:
                if was_known and not restarted:
                    log.info("%s server %s is healthy again", role.value, url)
                    self.routers[role].reset_server(url)
                    self._last_event_id.pop(url, None)
                elif not was_known:
                    log.info("%s server %s is healthy", role.value, url)
                self._servers_changed(role)
            return
        if not check.answered and self._answered.get(url, -math.inf) >= started:
            # No answer to /health in time, yet real requests to it succeeded meanwhile: the
            # lateness is this (overloaded) front end's own loop, not the server. Evicting it
            # would turn overload into a 503 for every request.
            log.debug("%s server %s: /health not answered (%s) but serving", role.value, url, why)
            return
        late = trio.current_time() - started - timeout
        if not check.answered and late > LATE_LOOP_S:
            # The probe's own timeout fired this late: our loop was held up while the answer
            # was due (overload, a blocking call), so a missing answer says nothing of the
            # server. This covers a server with no traffic (a gen behind max_tokens 1 requests),
            # which the rule above cannot. A refused connection fails at once and still counts.
            log.info(
                "%s server %s: /health not answered, but this process's event loop was %.2f s "
                "late meanwhile; not counted as a miss",
                role.value,
                url,
                late,
            )
            return
        self._misses[url] += 1
        if server.healthy and self._misses[url] < FAILED_CHECKS_TO_EVICT:
            return
        if self.cluster.mark_unhealthy(url, why):
            log.warning("%s server %s is unhealthy: %s", role.value, url, why)
            self._servers_changed(role)

    async def _poll_kv_events_forever(self, role: ServerRole) -> None:
        interval = self.routers[role].config.events_poll_interval
        while True:
            await trio.sleep(interval)
            await self._poll_kv_events_once(role)

    async def _poll_kv_events_once(self, role: ServerRole) -> None:
        async with trio.open_nursery() as nursery:
            for view in self.cluster.views(role):
                nursery.start_soon(self.poll_kv_events, role, view.url)

    async def poll_kv_events(self, role: ServerRole, url: str) -> None:
        """Read one server's KV events after the last one this front end saw (a cursor of its
        own: the other front ends of a fleet read the same events) into its router; failures
        are logged, not raised."""
        lock = self._event_locks.setdefault(url, trio.Lock())
        async with lock:
            last = self._last_event_id.get(url)
            try:
                with trio.fail_after(EVENTS_TIMEOUT):
                    data = await self.client.post_for_json(
                        url, "/kv_cache_events", limit_s=EVENTS_TIMEOUT, role=role.value,
                        body={"after": -1 if last is None else last},
                    )  # fmt: skip
                events = parse_kv_events(data)
            except (UpstreamError, ValueError, trio.TooSlowError) as exc:
                log.debug("kv_cache_events from %s failed: %s", url, exc)
                return
            if not events:
                return
            router = self.routers[role]
            if last is not None and events[0].event_id != last + 1:
                # Ids from a restarted worker, or a gap: events this front end never got.
                log.info("%s: KV events resume at id %d after %d: forgetting its cached blocks",
                         url, events[0].event_id, last)  # fmt: skip
                router.reset_server(url)
            self._last_event_id[url] = events[-1].event_id
            router.apply_kv_events(url, events)
