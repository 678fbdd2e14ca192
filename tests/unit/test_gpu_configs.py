"""conf/gpu: the GPU cluster files plan and validate, each worker gets its GPU, and the
coordinator's aggregated mode (no context servers, conditional disaggregation serving every
request on one gen server) is accepted only with conditional_disagg_config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from trtdisagg.config import ConfigError, WorkerConfig, load_worker_config, structure
from trtdisagg.coordinator.cluster import Cluster, ServerInfo, ServerRole
from trtdisagg.coordinator.config import coordinator_config_from_dict
from trtdisagg.launcher import plan_cluster

GPU_CONF = Path(__file__).resolve().parents[2] / "conf" / "gpu"


def plan(name: str) -> tuple[dict[str, WorkerConfig], dict[str, Any]]:
    """(worker configs by child name, the coordinator's data) of one cluster file."""
    path = GPU_CONF / name
    cluster, files = plan_cluster(yaml.safe_load(path.read_text()), source=name, root=GPU_CONF)
    workers = {}
    coordinator: dict[str, Any] = {}
    for file, data in files.items():
        if file.stem == "coordinator":
            coordinator = data
        else:
            workers[file.stem] = structure(data, WorkerConfig)
    assert {c.name for c in cluster.children} == {*workers, "coordinator"}
    return workers, coordinator


def test_worker_yaml_loads() -> None:
    config = load_worker_config(GPU_CONF / "worker.yaml")
    assert (config.device, config.dtype, config.model) == (
        "cuda",
        "bfloat16",
        "synthetic:llama3-8b",
    )
    assert config.kv_cache_config.free_gpu_memory_fraction == 0.8


def test_one_h200_shares_gpu_0() -> None:
    workers, coordinator = plan("one_h200.yaml")
    assert set(workers) == {"ctx-0", "gen-0"}
    assert {w.cuda_device for w in workers.values()} == {0}
    for worker in workers.values():
        fraction = worker.kv_cache_config.free_gpu_memory_fraction
        assert fraction is not None and 0.35 <= fraction <= 0.4
        assert worker.cache_transceiver_config.backend is not None
    assert coordinator["context_servers"]["urls"] == ["127.0.0.1:8001"]


@pytest.mark.parametrize(
    ("name", "style"),
    [
        ("two_h200_disagg.yaml", "context_first"),
        ("two_h200_disagg_generation_first.yaml", "generation_first"),
        ("two_h200_disagg_conditional.yaml", "context_first"),
    ],
)
def test_two_h200_disagg_puts_ctx_and_gen_on_their_gpus(name: str, style: str) -> None:
    workers, coordinator = plan(name)
    assert workers["ctx-0"].cuda_device == 0
    assert workers["gen-0"].cuda_device == 1
    assert coordinator["generation_servers"]["urls"] == ["127.0.0.1:8002"]
    config = coordinator_config_from_dict(coordinator, source=name)
    assert config.schedule_style.value == style


def test_two_h200_aggregated_has_no_ctx() -> None:
    workers, coordinator = plan("two_h200_aggregated.yaml")
    assert set(workers) == {"gen-0", "gen-1"}
    assert [workers[n].cuda_device for n in ("gen-0", "gen-1")] == [0, 1]
    assert all(w.cache_transceiver_config.backend is None for w in workers.values())
    config = coordinator_config_from_dict(coordinator, source="aggregated")
    assert config.context_servers.urls == []
    assert config.conditional_disagg_config is not None
    assert config.conditional_disagg_config.max_local_prefill_length >= 1_000_000
    assert config.generation_servers.router.type.value == "load_balancing"


def test_two_h200_conditional_serves_short_prompts_on_gen_alone() -> None:
    _, coordinator = plan("two_h200_disagg_conditional.yaml")
    config = coordinator_config_from_dict(coordinator, source="conditional")
    assert config.conditional_disagg_config is not None
    assert config.conditional_disagg_config.max_local_prefill_length == 1024
    assert config.context_servers.urls == ["127.0.0.1:8001"]


def test_one_h200_aggregated_shares_gpu_0_with_the_pool_of_one_h200() -> None:
    workers, coordinator = plan("one_h200_aggregated.yaml")
    assert set(workers) == {"gen-0", "gen-1"}
    assert {w.cuda_device for w in workers.values()} == {0}
    assert all(w.cache_transceiver_config.backend is None for w in workers.values())
    disagg, _ = plan("one_h200.yaml")

    def pool_tokens(ws: dict[str, WorkerConfig]) -> int:
        caps = [w.kv_cache_config.max_tokens for w in ws.values()]
        assert all(cap is not None for cap in caps)
        return sum(cap for cap in caps if cap is not None)

    # The same KV capacity on the GPU in both modes, so neither wins on pool size alone.
    assert pool_tokens(workers) == pool_tokens(disagg)
    config = coordinator_config_from_dict(coordinator, source="one_h200_aggregated")
    assert config.context_servers.urls == []
    assert config.conditional_disagg_config is not None


def test_empty_ctx_needs_conditional_disaggregation() -> None:
    gen = {"urls": ["127.0.0.1:8002"]}
    with pytest.raises(ConfigError, match=r"context_servers\.urls: must list at least one server"):
        coordinator_config_from_dict({"generation_servers": gen}, source="x")
    data = {"generation_servers": gen, "conditional_disagg_config": {"max_local_prefill_length": 9}}
    assert coordinator_config_from_dict(data, source="x").context_servers.urls == []
    cluster = {"ctx": [], "gen": [{"port": 8002}], "coordinator": {"port": 8000}}
    with pytest.raises(ConfigError, match=r"\$\.ctx: expected a non-empty list"):
        plan_cluster(cluster, source="x", root=GPU_CONF)


def test_aggregated_cluster_is_ready_with_gen_alone() -> None:
    data = {
        "generation_servers": {"urls": ["127.0.0.1:8002"]},
        "conditional_disagg_config": {"max_local_prefill_length": 10},
    }
    cluster = Cluster.from_config(coordinator_config_from_dict(data, source="x"))
    cluster.started = True
    assert cluster.required_roles() == [ServerRole.GENERATION]
    assert not cluster.is_ready()
    assert cluster.not_ready_reason() == "no healthy generation servers"
    cluster.mark_healthy("http://127.0.0.1:8002", ServerInfo(model="m"))
    assert cluster.is_ready()
    disagg = {"context_servers": {"urls": ["127.0.0.1:8001"]}, **data}
    both = Cluster.from_config(coordinator_config_from_dict(disagg, source="x"))
    both.started = True
    both.mark_healthy("http://127.0.0.1:8002", ServerInfo(model="m"))
    assert not both.is_ready()  # a configured ctx server must be healthy too
