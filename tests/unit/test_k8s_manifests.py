"""deploy/k8s: every manifest validates against Kubernetes' schemas (offline, strict), and the
trtdisagg configs inside them load as a worker or coordinator would load them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate  # a dev dependency (pyproject.toml): make test installs it
import pytest
import yaml

from trtdisagg.config import Role, load_worker_config
from trtdisagg.coordinator.config import load_coordinator_config

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))


def _resources(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_strictly(path: Path) -> None:
    resources = _resources(path)
    assert resources, f"{path.name} holds no resource"
    for resource in resources:
        kubernetes_validate.validate(resource, kubernetes_validate.latest_version(), strict=True)


def test_the_layout_is_complete() -> None:
    kinds = {(r["kind"], r["metadata"]["name"]) for p in MANIFESTS for r in _resources(p)}
    assert {
        ("Deployment", "etcd"), ("Service", "etcd"), ("Deployment", "trtdisagg-ctx"),
        ("Deployment", "trtdisagg-gen"), ("Deployment", "trtdisagg-coordinator"),
        ("Service", "trtdisagg"), ("ConfigMap", "trtdisagg-config"),
    } <= kinds  # fmt: skip
    for role in ("ctx", "gen"):
        (deployment,) = _resources(K8S / f"{role}.yaml")
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert "kill -TERM 1" in container["lifecycle"]["preStop"]["exec"]["command"][-1]
        # workers bind 0.0.0.0: without a cluster secret they would refuse to start
        secret = next(e for e in container["env"] if e["name"] == "TRTDISAGG_CLUSTER_SECRET")
        assert secret["valueFrom"]["secretKeyRef"] == {"name": "trtdisagg-secret",
                                                       "key": "cluster-secret"}  # fmt: skip


def test_the_configs_in_the_config_map_load(tmp_path: Path) -> None:
    (config_map,) = _resources(K8S / "config.yaml")
    data = config_map["data"]
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    for role in Role:
        config = load_worker_config(tmp_path / f"{role.value}.yaml", {"role": role.value,
                                    "advertise_host": "10.1.2.3"})  # fmt: skip
        assert config.cluster is not None and config.cluster.etcd == "http://etcd:2379"
    coordinator = load_coordinator_config(tmp_path / "disagg.yaml")
    assert coordinator.cluster is not None and coordinator.cluster.name == "default"
