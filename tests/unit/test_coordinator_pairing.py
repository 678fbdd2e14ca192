"""The coordinator pairs only ctx and gen that can exchange KV (peers.md, pain point 11).

A ctx and a gen whose KV settings differ pass their health checks and fail every request at the
transfer. The cluster state reads each worker's `kv_compat` (`/server_info`) and keeps a server
out of rotation when it can pair with no healthy server of the other role, naming the field and
both values; a request's second server is chosen among those that can pair with its first.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from trtdisagg.coordinator.cluster import (
    Cluster,
    ServerInfo,
    ServerRole,
)
from trtdisagg.coordinator.config import RouterConfig, RouterType, coordinator_config_from_dict
from trtdisagg.coordinator.routers import NoServerAvailable, Router, RouteRequest, create_router

CTX = ["http://127.0.0.1:8001", "http://127.0.0.1:8003"]
GEN = ["http://127.0.0.1:8002", "http://127.0.0.1:8004"]
COMPAT: dict[str, Any] = {
    "protocol_version": 4,
    "model_fingerprint": "abc",
    "dtype": "bfloat16",
    "tokens_per_block": 32,
    "num_layers": 2,
}


def cluster(ctx: list[str] = CTX[:1], gen: list[str] = GEN[:1]) -> Cluster:
    data: dict[str, Any] = {"context_servers": {"urls": ctx}, "generation_servers": {"urls": gen}}
    if not ctx:  # gen alone serves every request
        data["conditional_disagg_config"] = {"max_local_prefill_length": 1 << 20}
    config = coordinator_config_from_dict(data, source="test")
    state = Cluster.from_config(config)
    state.started = True
    return state


def info(compat: Any = ..., **changes: Any) -> ServerInfo:
    """A worker's /server_info; `compat` None says cache_transceiver is disabled, ... omits it."""
    data: dict[str, Any] = {"model": "tiny", "tokens_per_block": 32}
    if compat is not ...:
        data["kv_compat"] = None if compat is None else {**compat, **changes}
    return ServerInfo.parse(data)


def serving(state: Cluster, role: ServerRole) -> list[str]:
    return [view.url for view in state.views(role)]


def test_matching_pair_serves_and_lists_no_problem() -> None:
    state = cluster()
    assert state.mark_healthy(CTX[0], info(COMPAT))
    assert state.mark_healthy(GEN[0], info(COMPAT))
    assert state.is_ready() and state.not_ready_reason() == ""
    assert serving(state, ServerRole.CONTEXT) == CTX[:1]
    assert state.cluster_info()["incompatible_pairs"] == []


def test_a_mismatched_pair_is_not_ready_and_names_field_and_both_values() -> None:
    state = cluster()
    state.mark_healthy(CTX[0], info(COMPAT, tokens_per_block=16, dtype="float32"))
    state.mark_healthy(GEN[0], info(COMPAT))
    assert not state.is_ready()
    reason = state.not_ready_reason()
    assert "tokens_per_block: ctx 16 vs gen 32" in reason
    assert "dtype: ctx 'float32' vs gen 'bfloat16'" in reason
    assert CTX[0] in reason and GEN[0] in reason
    assert serving(state, ServerRole.CONTEXT) == [] == serving(state, ServerRole.GENERATION)
    described = state.cluster_info()
    assert described["is_ready"] is False
    assert described["server_lists"] == {"context": [], "generation": []}
    (pair,) = described["incompatible_pairs"]
    assert pair["context"] == CTX[0] and pair["generation"] == GEN[0]
    assert "tokens_per_block: ctx 16 vs gen 32" in pair["reason"]
    assert all("unpaired" in s for s in described["servers"])
    # The ctx comes back fixed (a restart: unhealthy, then healthy with the new info).
    assert state.mark_unhealthy(CTX[0], "restarting")
    assert state.mark_healthy(CTX[0], info(COMPAT))
    assert state.is_ready() and state.cluster_info()["incompatible_pairs"] == []


def test_one_misconfigured_gen_leaves_rotation_and_the_rest_serve() -> None:
    state = cluster(gen=GEN)
    state.mark_healthy(CTX[0], info(COMPAT))
    state.mark_healthy(GEN[0], info(COMPAT))
    state.mark_healthy(GEN[1], info(COMPAT, model_fingerprint="other"))
    assert state.is_ready()
    assert serving(state, ServerRole.GENERATION) == GEN[:1]
    assert serving(state, ServerRole.CONTEXT) == CTX[:1]
    (pair,) = state.incompatible
    assert pair.generation == GEN[1]
    assert pair.reason == "model_fingerprint: ctx 'abc' vs gen 'other'"
    # Its partner leaves: the odd gen still pairs with nothing, the cluster is not ready.
    state.mark_unhealthy(GEN[0], "gone")
    assert not state.is_ready()
    assert "model_fingerprint: ctx 'abc' vs gen 'other'" in state.not_ready_reason()


def test_a_server_pairs_when_it_matches_any_healthy_peer() -> None:
    state = cluster(ctx=CTX, gen=GEN)
    state.mark_healthy(CTX[0], info(COMPAT))
    state.mark_healthy(CTX[1], info(COMPAT, tokens_per_block=64))
    state.mark_healthy(GEN[0], info(COMPAT))
    state.mark_healthy(GEN[1], info(COMPAT, tokens_per_block=64))
    assert len(state.incompatible) == 2  # the crossed pairs
    assert serving(state, ServerRole.CONTEXT) == CTX
    assert serving(state, ServerRole.GENERATION) == GEN


def test_a_disabled_transceiver_cannot_pair() -> None:
    state = cluster()
    state.mark_healthy(CTX[0], info(None))
    state.mark_healthy(GEN[0], info(COMPAT))
    assert not state.is_ready()
    assert "cache_transceiver is disabled on ctx" in state.not_ready_reason()


def test_workers_that_publish_no_kv_compat_are_taken_as_able_to_pair() -> None:
    state = cluster()
    state.mark_healthy(CTX[0], info())
    state.mark_healthy(GEN[0], info(COMPAT))
    assert state.is_ready() and state.incompatible == []
    assert "kv_compat" not in state.cluster_info()["servers"][0]["server_info"]
    assert state.cluster_info()["servers"][1]["server_info"]["kv_compat"] == COMPAT


def test_aggregated_mode_checks_nothing() -> None:
    state = cluster(ctx=[])
    state.mark_healthy(GEN[0], info(None))
    assert state.is_ready() and serving(state, ServerRole.GENERATION) == GEN[:1]


def test_kv_compat_values_of_the_wrong_type_are_dropped_not_trusted() -> None:
    parsed = ServerInfo.parse({"kv_compat": {"dtype": "bfloat16", "x": [1], "y": True, "z": 2}})
    assert parsed.transceiver is True
    assert dict(parsed.kv_compat) == {"dtype": "bfloat16", "z": 2}


# ---- routing by pair: two groups each compatible only among themselves ----
#
# A rolling upgrade: the new workers publish another protocol version than the old ones, so
# during the rollout an old ctx must be paired only with an old gen and a new one with a new.
# Group A has two gens and group B one, so that round robin on each role alone does not keep
# step with the groups and would cross them.

A_CTX, A_GENS = "http://127.0.0.1:8101", ["http://127.0.0.1:8102", "http://127.0.0.1:8103"]
B_CTX, B_GEN = "http://127.0.0.1:8201", "http://127.0.0.1:8202"
OLD, NEW = COMPAT, {**COMPAT, "protocol_version": 5}
GROUP = {A_CTX: "A", A_GENS[0]: "A", A_GENS[1]: "A", B_CTX: "B", B_GEN: "B"}


def two_groups(router: str = "round_robin") -> tuple[Cluster, dict[ServerRole, Router]]:
    state = cluster(ctx=[A_CTX, B_CTX], gen=[*A_GENS, B_GEN])
    for url in GROUP:
        state.mark_healthy(url, info(OLD if GROUP[url] == "A" else NEW))
    routers = {
        role: create_router(RouterConfig(type=RouterType(router)), role=role.value)
        for role in ServerRole
    }
    refresh(state, routers)
    return state, routers


def refresh(state: Cluster, routers: dict[ServerRole, Router]) -> None:
    for role, router in routers.items():
        router.update_servers(state.views(role))


OTHER = {ServerRole.CONTEXT: ServerRole.GENERATION, ServerRole.GENERATION: ServerRole.CONTEXT}


@pytest.mark.parametrize("router", ["round_robin", "load_balancing", "kv_cache_aware"])
@pytest.mark.parametrize("first", [ServerRole.CONTEXT, ServerRole.GENERATION])
def test_the_second_server_is_always_of_the_first_s_group(first: ServerRole, router: str) -> None:
    state, routers = two_groups(router)
    assert state.is_ready() and len(state.incompatible) == 3  # every server serves
    picked: set[str] = set()
    for key in range(60):
        request = RouteRequest(key=key)
        one = routers[first].select(request).server
        other = routers[OTHER[first]].select(request, pairing=state.pairing(one)).server
        assert GROUP[one] == GROUP[other], (first.value, one, other)
        picked |= {one, other}
        if key % 3:  # some requests stay in flight, so the load-based routers see load
            routers[first].finish(key)
            routers[OTHER[first]].finish(key)
    assert picked == set(GROUP)  # both groups served, every server of them


def test_no_server_left_to_pair_with_names_the_first_and_both_values() -> None:
    state = cluster(ctx=[A_CTX, B_CTX], gen=[A_GENS[0], B_GEN])
    for url in (A_CTX, A_GENS[0]):
        state.mark_healthy(url, info(OLD))
    for url in (B_CTX, B_GEN):
        state.mark_healthy(url, info(NEW))
    routers = {role: create_router(RouterConfig(), role=role.value) for role in ServerRole}
    refresh(state, routers)
    assert routers[ServerRole.CONTEXT].select(RouteRequest(key=1)).server == A_CTX
    # A's only gen fails while A's ctx serves the request: B's gen is healthy but cannot pair.
    state.mark_unhealthy(A_GENS[0], "gone")
    refresh(state, routers)
    with pytest.raises(NoServerAvailable) as caught:
        routers[ServerRole.GENERATION].select(RouteRequest(key=1), pairing=state.pairing(A_CTX))
    assert str(caught.value) == (
        f"no generation server can exchange KV with {A_CTX}: "
        f"{B_GEN}: protocol_version: ctx 4 vs gen 5"
    )


def test_exclude_and_pairing_together() -> None:
    state, routers = two_groups()
    gens = routers[ServerRole.GENERATION]
    pairing = state.pairing(A_CTX)
    # A retry excludes the gen that failed: the other gen of the group takes it, never B's.
    for key in range(6):
        assert (
            gens.select(RouteRequest(key=key), exclude=A_GENS[0], pairing=pairing).server
            == A_GENS[1]
        )
    state.mark_unhealthy(A_GENS[1], "gone")
    refresh(state, routers)
    with pytest.raises(
        NoServerAvailable,
        match=(
            f"^no generation servers left after excluding {A_GENS[0]} "
            f"and those that cannot exchange KV with {A_CTX}$"
        ),
    ):
        gens.select(RouteRequest(key=9), exclude=A_GENS[0], pairing=pairing)
    # What the service then does: select again without `exclude`, still paired.
    assert gens.select(RouteRequest(key=9), pairing=pairing).server == A_GENS[0]


@pytest.mark.parametrize(
    "published",
    [
        {"model": "tiny"},
        {"model": "tiny", "kv_compat": None},
        {"kv_compat": COMPAT, "disaggregated_params": {"ctx_info_endpoint": "tcp://ctx:1"}},
    ],
)
def test_server_info_in_cluster_info_reads_back_as_published(published: dict[str, Any]) -> None:
    """`/cluster_info` publishes each server's info in the shape of its `/server_info`: what
    generation_first needs (ctx's info endpoint), pairing (the transceiver, `kv_compat`)."""
    parsed = ServerInfo.parse(published)
    assert ServerInfo.parse(json.loads(json.dumps(parsed.to_json()))) == parsed
