"""RemotePlacement: a fleet front end's view of the cluster, kept by the coordinator state process.

* Start-up probes ``GET {state}/cluster_info`` until it answers 200, for at most
  ``server_start_timeout``; then fails with `StartupError` naming the URL, so a misconfigured
  fleet worker exits instead of answering "not ready" forever.
* A sync task re-reads ``/cluster_info`` every ``health_check_interval``: readiness, server
  infos, and for local round robin the healthy server lists and the pairs that cannot exchange
  KV. If the state process stops answering, the front end is not ready (``/health`` 503) and
  requests fail fast with 503.
* ``round_robin`` roles are placed locally; every other router is stateful and lives in the
  state process (``POST /select``, ``POST /finish``), which pairs the request's second server
  with its first from its own cluster state (``pair_with``).
"""

from __future__ import annotations

import logging
from typing import Any, Final

import attrs
import httpx
import trio

from trtdisagg.coordinator.cluster import IncompatiblePair, ServerInfo, ServerRole, pairing_of
from trtdisagg.coordinator.config import CoordinatorConfig, RouterType
from trtdisagg.coordinator.placement import CoordinatorUnavailable, StartupError
from trtdisagg.coordinator.routers import (
    NoServerAvailable,
    Router,
    RouteRequest,
    Selection,
    ServerView,
    create_router,
)
from trtdisagg.coordinator.state_wire import (
    BadBody,
    FinishBody,
    SelectAnswer,
    SelectBody,
    decode,
    encode,
)

log = logging.getLogger(__name__)

Json = dict[str, Any]

PROBE_INTERVAL: Final = 0.5
STATE_CALL_TIMEOUT: Final = 10.0


@attrs.define(eq=False, kw_only=True)
class RemotePlacement:
    config: CoordinatorConfig
    http: httpx.AsyncClient
    state_url: str
    local_routers: dict[ServerRole, Router]
    wants_tokens: dict[ServerRole, bool]
    _info: Json | None = None
    _incompatible: list[IncompatiblePair] = attrs.Factory(list)
    _reachable: bool = False

    @classmethod
    def create(cls, config: CoordinatorConfig, http: httpx.AsyncClient) -> RemotePlacement:
        local = {}
        wants_tokens = {}
        for role, group in (
            (ServerRole.CONTEXT, config.context_servers),
            (ServerRole.GENERATION, config.generation_servers),
        ):
            router = create_router(group.router, role=role.value)
            wants_tokens[role] = router.uses_prompt_tokens
            if group.router.type is RouterType.ROUND_ROBIN:
                local[role] = router
        return cls(
            config=config,
            http=http,
            state_url=config.state_url,
            local_routers=local,
            wants_tokens=wants_tokens,
        )

    def _group(self, role: ServerRole) -> Any:
        if role is ServerRole.CONTEXT:
            return self.config.context_servers
        return self.config.generation_servers

    # ---- queries ----

    def is_ready(self) -> bool:
        return self._reachable and self._info is not None and bool(self._info.get("is_ready"))

    def not_ready_reason(self) -> str:
        if not self._reachable:
            return f"coordinator state process at {self.state_url} is not reachable"
        return "cluster is not ready (no healthy context or generation servers)"

    def cluster_info(self) -> Json:
        empty = {"is_ready": False, "server_lists": {"context": [], "generation": []}}
        info = dict(self._info or empty)
        info["is_ready"] = self.is_ready()
        info["coordinator_url"] = self.state_url
        return info

    def _servers(self) -> list[Json]:
        servers = (self._info or {}).get("servers")
        return servers if isinstance(servers, list) else []

    def server_info(self, url: str) -> ServerInfo | None:
        for server in self._servers():
            if server.get("url") == url and isinstance(server.get("server_info"), dict):
                return ServerInfo.parse(server["server_info"])
        return None

    def model_info(self) -> ServerInfo | None:
        for server in self._servers():
            if server.get("healthy") and isinstance(server.get("server_info"), dict):
                return ServerInfo.parse(server["server_info"])
        return None

    def router_type(self, role: ServerRole) -> RouterType:
        return self._group(role).router.type

    def uses_prompt_tokens(self, role: ServerRole) -> bool:
        return self.wants_tokens[role]

    # ---- reservations ----

    async def select(
        self,
        role: ServerRole,
        request: RouteRequest,
        *,
        exclude: str | None,
        pair_with: str | None = None,
    ) -> Selection:
        router = self.local_routers.get(role)
        if router is not None:
            await trio.lowlevel.checkpoint()
            pairing = pairing_of(self._incompatible, pair_with) if pair_with is not None else None
            return router.select(request, exclude=exclude, pairing=pairing)
        body = encode(SelectBody.of(role, request, exclude=exclude, pair_with=pair_with))
        try:
            response = await self.http.post(
                self.state_url + "/select", json=body, timeout=STATE_CALL_TIMEOUT
            )
        except httpx.TransportError as exc:
            self._reachable = False
            raise CoordinatorUnavailable(
                f"coordinator state process at {self.state_url} unreachable: {type(exc).__name__}"
            ) from None
        if response.status_code == 503:
            raise NoServerAvailable(_error_message(response, f"no {role.value} servers available"))
        if response.status_code != 200:
            raise CoordinatorUnavailable(
                f"coordinator state process /select answered {response.status_code}: "
                + _error_message(response, "")
            )
        return decode(response.json(), SelectAnswer).selection()

    async def finish(self, role: ServerRole, key: int, *, success: bool) -> None:
        router = self.local_routers.get(role)
        if router is not None:
            router.finish(key, success=success)
            return
        body = encode(FinishBody(role=role, key=key, success=success))
        try:
            await self.http.post(self.state_url + "/finish", json=body, timeout=STATE_CALL_TIMEOUT)
        except httpx.TransportError as exc:
            # The state process expires reservations it never hears back about.
            log.warning("finish %s/%d at %s failed: %s", role.value, key, self.state_url, exc)

    def report_unreachable(self, role: ServerRole, url: str, reason: str) -> None:
        # The state process's own health checks evict the server; until then a retry excludes it.
        router = self.local_routers.get(role)
        if router is not None:
            router.update_servers([s for s in router.servers if s.url != url])

    # ---- background ----

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Probe the state process, then keep the cluster view in sync.

        Raises:
            StartupError: the state process did not answer within ``server_start_timeout``.
        """
        await self._probe()
        task_status.started()
        while True:
            await trio.sleep(min(self.config.health_check_interval, 1.0))
            await self._sync()

    async def _probe(self) -> None:
        timeout = self.config.server_start_timeout
        attempts = 0
        last_error = "no answer"
        with trio.move_on_after(timeout):
            while True:
                attempts += 1
                last_error = await self._sync()
                if self._reachable:
                    log.info("coordinator state process at %s is reachable", self.state_url)
                    return
                await trio.sleep(PROBE_INTERVAL)
        raise StartupError(
            f"coordinator at {self.state_url} not reachable after {timeout:g}s "
            f"({attempts} attempts, last error: {last_error}); aborting front-end start-up"
        )

    async def _sync(self) -> str:
        """Refresh the cluster view; returns the error text ('' when reachable)."""
        try:
            response = await self.http.get(self.state_url + "/cluster_info", timeout=2.0)
            response.raise_for_status()
            info = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            if self._reachable:
                log.error("coordinator state process at %s lost: %s", self.state_url, exc)
            self._reachable = False
            return f"{type(exc).__name__}: {exc}"
        if not isinstance(info, dict):
            self._reachable = False
            return "cluster_info is not an object"
        try:
            self._incompatible = decode(info.get("incompatible_pairs", []), list[IncompatiblePair])
        except BadBody as exc:
            self._reachable = False
            return f"cluster_info.incompatible_pairs: {exc}"
        if not self._reachable and self._info is not None:
            log.info("coordinator state process at %s is back", self.state_url)
        self._info = info
        self._reachable = True
        lists = info.get("server_lists") or {}
        for role, router in self.local_routers.items():
            urls = lists.get(role.value) or []
            current = [s.url for s in router.servers]
            if urls != current:
                infos = {u: self.server_info(u) for u in urls}
                router.update_servers(
                    [
                        ServerView(
                            url=u,
                            max_batch_size=i.max_batch_size if i else None,
                            tokens_per_block=i.tokens_per_block if i else None,
                        )
                        for u, i in infos.items()
                    ]
                )
        return ""


def _error_message(response: httpx.Response, default: str) -> str:
    try:
        data = response.json()
        return str(data["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return default or response.text[:200]
