"""Cluster state: the configured ctx and gen servers, their health and `/server_info`. Pure.

Lifecycle of one server::

    UNKNOWN (listed, never answered) ──/health 200──> HEALTHY ──/health fails or a request
                                                         ▲      finds it unreachable──> UNHEALTHY
                                                         └──────────/health 200──────────┘

The health monitor (`local.py`) feeds transitions in; routers get the serving set out through
`views(role)`. The cluster is *ready* once start-up has finished waiting and at least one server
of each role serves (of generation only, in aggregated mode: no context servers configured).

A healthy server serves unless it can exchange KV with no healthy server of the other role: each
worker publishes what a peer must match (`kv_compat` in `/server_info`), and a ctx and a gen that
differ would fail every request at the transfer while both look healthy (peers.md, pain point
11). Such a server is left out of rotation and named, with both values, in `not_ready_reason`
and `/cluster_info`. A worker that does not publish `kv_compat` is taken as able to pair.

A server in rotation may still be unable to pair with some servers of the other role (two groups
each compatible only among themselves, as in a rolling upgrade), so the request's second server
is chosen among those that can pair with its first: `pairing(url)` says who cannot.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import attrs

from trtdisagg.coordinator.config import CoordinatorConfig, normalize_url
from trtdisagg.coordinator.routers import Pairing, ServerView
from trtdisagg.transfer.protocol.rank_info import compat_mismatches

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
    transceiver: bool | None = None
    """Whether the worker can send or receive KV; None when it does not say (no `kv_compat`)."""
    kv_compat: tuple[tuple[str, str | int], ...] = ()
    max_seq_len: int | None = None  # the model's context on that server (`/v1/models`)

    @classmethod
    def parse(cls, data: Json) -> ServerInfo:
        params = data.get("disaggregated_params")
        endpoint = params.get("ctx_info_endpoint") if isinstance(params, dict) else None
        if isinstance(endpoint, list):  # TensorRT-LLM lists one per DP rank; we use the first
            endpoint = endpoint[0] if endpoint else None
        compat = data.get("kv_compat")
        return cls(
            transceiver=isinstance(compat, dict) if "kv_compat" in data else None,
            kv_compat=tuple(
                (k, v)
                for k, v in (compat.items() if isinstance(compat, dict) else ())
                if isinstance(k, str) and isinstance(v, str | int) and not isinstance(v, bool)
            ),
            model=_str(data, "model"),
            model_path=_str(data, "model_path"),
            max_batch_size=_int(data, "max_batch_size"),
            tokens_per_block=_int(data, "tokens_per_block"),
            kv_hash_algorithm=_str(data, "kv_hash_algorithm"),
            ctx_info_endpoint=endpoint if isinstance(endpoint, str) else None,
            max_seq_len=_int(data, "max_seq_len"),
        )

    def to_json(self) -> Json:
        """In the shape of a worker's ``/server_info``: a fleet front end `parse`s it back."""
        skip = ("transceiver", "kv_compat", "ctx_info_endpoint")
        out = {k: v for k, v in attrs.asdict(self).items() if v is not None and k not in skip}
        if self.transceiver is not None:
            out["kv_compat"] = dict(self.kv_compat) if self.transceiver else None
        if self.ctx_info_endpoint is not None:
            out["disaggregated_params"] = {"ctx_info_endpoint": self.ctx_info_endpoint}
        return out


def pairing_problem(ctx: ServerInfo | None, gen: ServerInfo | None) -> str | None:
    """Why this ctx and this gen cannot exchange KV, or None when they can (or cannot tell)."""
    for role, info in (("ctx", ctx), ("gen", gen)):
        if info is not None and info.transceiver is False:
            return f"cache_transceiver is disabled on {role}"
    if ctx is None or gen is None or not ctx.transceiver or not gen.transceiver:
        return None
    mismatches = compat_mismatches(dict(ctx.kv_compat), dict(gen.kv_compat), names=("ctx", "gen"))
    return "; ".join(mismatches) or None


@attrs.frozen(kw_only=True)
class IncompatiblePair:
    context: str
    generation: str
    reason: str


def pairing_of(pairs: Iterable[IncompatiblePair], peer: str) -> Pairing:
    """For the other leg of a request placed on `peer`: the servers that cannot pair with it.

    Urls are unique across roles, so `peer` names its role too.
    """
    incompatible = {}
    for pair in pairs:
        if pair.context == peer:
            incompatible[pair.generation] = pair.reason
        elif pair.generation == peer:
            incompatible[pair.context] = pair.reason
    return Pairing(peer=peer, incompatible=incompatible)


@attrs.define(eq=False, kw_only=True)
class ServerState:
    url: str
    role: ServerRole
    healthy: bool = False
    ever_healthy: bool = False
    info: ServerInfo | None = None
    last_error: str | None = None
    boot_id: str | None = None  # from its last passing /health: another one means a restart

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
    context_required: bool = False
    """A context server is needed to be ready even while none is known (servers come from
    etcd, and conditional disaggregation is off). Static lists need it when they list one."""
    started: bool = False
    """Start-up finished waiting for the servers (successfully)."""
    incompatible: list[IncompatiblePair] = attrs.Factory(list)
    """Healthy ctx and gen that cannot exchange KV (`pairing_problem`); kept by `_pair`."""
    _unpaired: dict[str, str] = attrs.field(factory=dict, alias="unpaired")
    """url -> why: healthy servers that can pair with no healthy server of the other role."""

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
        required = config.cluster is not None and config.conditional_disagg_config is None
        return cls(servers=servers, context_required=required)

    def add_server(self, url: str, role: ServerRole) -> bool:
        """A server joined (membership): not serving until it passes a health check. True when
        it is new; a url known under the other role changes role (a worker restarted as such)."""
        known = self.servers.get(url)
        if known is not None and known.role is role:
            return False
        self.servers[url] = ServerState(url=url, role=role)
        if known is not None:
            self._pair()
        return True

    def remove_server(self, url: str) -> bool:
        """A server left (membership): out of rotation at once. True when it was known."""
        if self.servers.pop(url, None) is None:
            return False
        self._pair()
        return True

    def of_role(self, role: ServerRole) -> list[ServerState]:
        return [s for s in self.servers.values() if s.role is role]

    def serving(self, role: ServerRole) -> list[ServerState]:
        """Healthy servers of `role` in rotation: those that can pair with the other role."""
        return [s for s in self.of_role(role) if s.healthy and s.url not in self._unpaired]

    def views(self, role: ServerRole) -> list[ServerView]:
        return [s.view() for s in self.serving(role)]

    def pairing(self, peer: str) -> Pairing:
        """The servers that cannot exchange KV with `peer`, among the healthy ones."""
        return pairing_of(self.incompatible, peer)

    def mark_healthy(self, url: str, info: ServerInfo, boot_id: str | None = None) -> bool:
        """Record a passing health check; True when the server was not healthy before, or its
        info changed."""
        server = self.servers[url]
        changed = not server.healthy or server.info != info
        server.healthy = True
        server.ever_healthy = True
        server.info = info
        server.boot_id = boot_id
        server.last_error = None
        if changed:
            self._pair()
        return changed

    def mark_unhealthy(self, url: str, reason: str) -> bool:
        """Record a failure; True when the server was healthy before."""
        server = self.servers[url]
        changed = server.healthy
        server.healthy = False
        server.last_error = reason
        if changed:
            self._pair()
        return changed

    def _pair(self) -> None:
        """Recompute `incompatible` and who can pair, after any change of the healthy set."""
        ctxs = [s for s in self.of_role(ServerRole.CONTEXT) if s.healthy]
        gens = [s for s in self.of_role(ServerRole.GENERATION) if s.healthy]
        problems = {
            (c.url, g.url): why
            for c in ctxs
            for g in gens
            if (why := pairing_problem(c.info, g.info)) is not None
        }
        self.incompatible = [
            IncompatiblePair(context=c, generation=g, reason=why)
            for (c, g), why in problems.items()
        ]
        self._unpaired = {}

        def leave_out_if_unpaired(url: str, found: list[str | None]) -> None:
            if found and all(found):
                self._unpaired[url] = f"can pair with no healthy peer: {found[0]}"

        for c in ctxs:
            leave_out_if_unpaired(c.url, [problems.get((c.url, g.url)) for g in gens])
        for g in gens:
            leave_out_if_unpaired(g.url, [problems.get((c.url, g.url)) for c in ctxs])

    def pairing_reason(self) -> str:
        """Why a role with healthy servers has none in rotation; "" when that is not the case."""
        for role in self.required_roles():
            healthy = [s for s in self.of_role(role) if s.healthy]
            if healthy and not self.serving(role) and self.incompatible:
                pair = self.incompatible[0]
                return (
                    f"no {role.value} server can exchange KV with a healthy "
                    f"{_other(role).value} server: context {pair.context} vs generation "
                    f"{pair.generation}: {pair.reason}"
                )
        return ""

    def all_healthy(self) -> bool:
        return all(s.healthy for s in self.servers.values())

    def missing(self, role: ServerRole) -> list[str]:
        return [s.url for s in self.of_role(role) if not s.healthy]

    def required_roles(self) -> list[ServerRole]:
        """Generation always; context unless none is known and none is required (aggregated
        mode)."""
        return [
            r
            for r in ServerRole
            if r is ServerRole.GENERATION or self.of_role(r) or self.context_required
        ]

    def has_each_role(self) -> bool:
        return all(self.serving(role) for role in self.required_roles())

    def is_ready(self) -> bool:
        return self.started and self.has_each_role()

    def not_ready_reason(self) -> str:
        if not self.started:
            return "coordinator is starting: waiting for servers"
        if why := self.pairing_reason():
            return why
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
            if server.url in self._unpaired:
                out["unpaired"] = self._unpaired[server.url]
            return out

        return {
            "is_ready": self.is_ready(),
            "server_lists": {
                role.value: [s.url for s in self.serving(role)] for role in ServerRole
            },
            "unhealthy": {role.value: self.missing(role) for role in ServerRole},
            "incompatible_pairs": [attrs.asdict(pair) for pair in self.incompatible],
            "servers": [describe(s) for s in self.servers.values()],
        }


def _other(role: ServerRole) -> ServerRole:
    return ServerRole.GENERATION if role is ServerRole.CONTEXT else ServerRole.CONTEXT
