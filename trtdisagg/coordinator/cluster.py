"""Cluster state: the configured ctx and gen servers, their health and `/server_info`. Pure.

Lifecycle of one server::

    UNKNOWN (listed, never answered) ──/health 200──> HEALTHY ──/health fails or a request
                                                         ▲      finds it unreachable──> UNHEALTHY
                                                         └──────────/health 200──────────┘

The health monitor (`health.py`) feeds transitions in; routers get the healthy set out through
`views(role)`. The cluster is *ready* once start-up has finished waiting and at least one server
of each role is healthy (of generation only, in aggregated mode: no context servers configured).
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from trtdisagg.coordinator.config import CoordinatorConfig, normalize_url
from trtdisagg.coordinator.routers import ServerView

Json = dict[str, Any]


class ServerRole(enum.Enum):
    CONTEXT = "context"
    GENERATION = "generation"


def _int(data: Json, key: str) -> int | None:
    value = data.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(data: Json, key: str) -> str | None:
    value = data.get(key)
    return value if isinstance(value, str) else None


@attrs.frozen(kw_only=True)
class ServerInfo:
    """The parts of a worker's ``GET /server_info`` the coordinator uses."""

    model: str | None = None
    model_path: str | None = None
    max_batch_size: int | None = None
    tokens_per_block: int | None = None
    kv_hash_algorithm: str | None = None
    ctx_info_endpoint: str | None = None

    @classmethod
    def parse(cls, data: Json) -> ServerInfo:
        params = data.get("disaggregated_params")
        endpoint = params.get("ctx_info_endpoint") if isinstance(params, dict) else None
        if isinstance(endpoint, list):  # TensorRT-LLM lists one per DP rank; we use the first
            endpoint = endpoint[0] if endpoint else None
        return cls(
            model=_str(data, "model"),
            model_path=_str(data, "model_path"),
            max_batch_size=_int(data, "max_batch_size"),
            tokens_per_block=_int(data, "tokens_per_block"),
            kv_hash_algorithm=_str(data, "kv_hash_algorithm"),
            ctx_info_endpoint=endpoint if isinstance(endpoint, str) else None,
        )

    def to_json(self) -> Json:
        return {k: v for k, v in attrs.asdict(self).items() if v is not None}


@attrs.define(eq=False, kw_only=True)
class ServerState:
    url: str
    role: ServerRole
    healthy: bool = False
    ever_healthy: bool = False
    info: ServerInfo | None = None
    last_error: str | None = None

    def view(self) -> ServerView:
        info = self.info or ServerInfo()
        return ServerView(
            url=self.url,
            max_batch_size=info.max_batch_size,
            tokens_per_block=info.tokens_per_block,
        )


@attrs.define(eq=False, kw_only=True)
class Cluster:
    servers: dict[str, ServerState]
    started: bool = False
    """Start-up finished waiting for the servers (successfully)."""

    @classmethod
    def from_config(cls, config: CoordinatorConfig) -> Cluster:
        servers: dict[str, ServerState] = {}
        for role, group in (
            (ServerRole.CONTEXT, config.context_servers),
            (ServerRole.GENERATION, config.generation_servers),
        ):
            for raw in group.urls:
                url = normalize_url(raw)
                assert url is not None, "config validation admits only well-formed urls"
                servers[url] = ServerState(url=url, role=role)
        return cls(servers=servers)

    def of_role(self, role: ServerRole) -> list[ServerState]:
        return [s for s in self.servers.values() if s.role is role]

    def views(self, role: ServerRole) -> list[ServerView]:
        return [s.view() for s in self.of_role(role) if s.healthy]

    def mark_healthy(self, url: str, info: ServerInfo) -> bool:
        """Record a passing health check; True when the server was not healthy before."""
        server = self.servers[url]
        changed = not server.healthy or server.info != info
        server.healthy = True
        server.ever_healthy = True
        server.info = info
        server.last_error = None
        return changed

    def mark_unhealthy(self, url: str, reason: str) -> bool:
        """Record a failure; True when the server was healthy before."""
        server = self.servers[url]
        changed = server.healthy
        server.healthy = False
        server.last_error = reason
        return changed

    def all_healthy(self) -> bool:
        return all(s.healthy for s in self.servers.values())

    def missing(self, role: ServerRole) -> list[str]:
        return [s.url for s in self.of_role(role) if not s.healthy]

    def required_roles(self) -> list[ServerRole]:
        """Generation always; context unless none is configured (aggregated mode)."""
        return [r for r in ServerRole if r is ServerRole.GENERATION or self.of_role(r)]

    def has_each_role(self) -> bool:
        return all(any(s.healthy for s in self.of_role(role)) for role in self.required_roles())

    def is_ready(self) -> bool:
        return self.started and self.has_each_role()

    def not_ready_reason(self) -> str:
        if not self.started:
            return "coordinator is starting: waiting for servers"
        empty = [role.value for role in self.required_roles() if not self.views(role)]
        return f"no healthy {' or '.join(empty)} servers" if empty else ""

    def first_info(self) -> ServerInfo | None:
        """The server_info of some healthy server (gen first): model name and model path."""
        for role in (ServerRole.GENERATION, ServerRole.CONTEXT):
            for server in self.of_role(role):
                if server.healthy and server.info is not None:
                    return server.info
        return None

    def cluster_info(self) -> Json:
        def describe(server: ServerState) -> Json:
            out: Json = {"url": server.url, "role": server.role.value, "healthy": server.healthy}
            if server.info is not None:
                out["server_info"] = server.info.to_json()
            if server.last_error is not None:
                out["last_error"] = server.last_error
            return out

        return {
            "is_ready": self.is_ready(),
            "server_lists": {
                role.value: [s.url for s in self.of_role(role) if s.healthy] for role in ServerRole
            },
            "unhealthy": {role.value: self.missing(role) for role in ServerRole},
            "servers": [describe(s) for s in self.servers.values()],
        }
