"""Routers: pick a ctx or gen server for a request. Pure (no I/O); one interface, four kinds.

`create_router(config, role=...)` builds the one named by ``router.type``:

* ``round_robin`` (`RoundRobinRouter`): the next server in turn;
* ``load_balancing`` (`LoadBalancingRouter`): least active requests, or tokens with ``use_tokens``;
* ``kv_cache_aware`` (`KvCacheAwareRouter`): most cached prefix minus load, fed by KV events;
* ``conversation`` (`ConversationRouter`): sticky ``conversation_id``, then implicit prefix.
"""

from __future__ import annotations

from trtdisagg.coordinator.config import RouterConfig, RouterType
from trtdisagg.coordinator.routers.base import (
    KvEvent,
    NoServerAvailable,
    Pairing,
    Router,
    RouteRequest,
    RouterStatistics,
    Selection,
    ServerView,
    parse_kv_events,
)
from trtdisagg.coordinator.routers.conversation import ConversationRouter
from trtdisagg.coordinator.routers.kv_aware import KvCacheAwareRouter
from trtdisagg.coordinator.routers.simple import LoadBalancingRouter, RoundRobinRouter

__all__ = [
    "ConversationRouter",
    "KvCacheAwareRouter",
    "KvEvent",
    "LoadBalancingRouter",
    "NoServerAvailable",
    "Pairing",
    "RoundRobinRouter",
    "RouteRequest",
    "Router",
    "RouterStatistics",
    "Selection",
    "ServerView",
    "create_router",
    "parse_kv_events",
]

_ROUTERS: dict[RouterType, type[Router]] = {
    RouterType.ROUND_ROBIN: RoundRobinRouter,
    RouterType.LOAD_BALANCING: LoadBalancingRouter,
    RouterType.KV_CACHE_AWARE: KvCacheAwareRouter,
    RouterType.CONVERSATION: ConversationRouter,
}


def create_router(config: RouterConfig, *, role: str) -> Router:
    """The router ``config.type`` names, for servers of `role` ("context" / "generation")."""
    return _ROUTERS[config.type](config, role=role)
