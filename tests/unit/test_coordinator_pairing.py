"""The coordinator pairs only ctx and gen that can exchange KV (peers.md, pain point 11).

A ctx and a gen whose KV settings differ pass their health checks and fail every request at the
transfer. The cluster state reads each worker's `kv_compat` (`/server_info`) and keeps a server
out of rotation when it can pair with no healthy server of the other role, naming the field and
both values.
"""

from __future__ import annotations

from typing import Any

from trtdisagg.coordinator.cluster import Cluster, ServerInfo, ServerRole
from trtdisagg.coordinator.config import coordinator_config_from_dict

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
