"""`up`'s plan: with etcd it wires every process to the same cluster (no url lists); a split
cluster's workers exchange KV."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.etcd_server import require_etcd
from trtdisagg.config import ConfigError
from trtdisagg.launcher import plan_cluster

SPEC: dict[str, Any] = {"log_dir": "logs", "ctx": [{"port": 9001}], "gen": [{"port": 9002}]}


def test_an_external_etcd_is_given_to_every_process() -> None:
    spec = {**SPEC, "etcd": "http://10.0.0.9:2379", "cluster_name": "prod"}
    plan, files = plan_cluster(spec, source="up.yaml", root=Path("."))
    assert [c.name for c in plan.children] == ["ctx-0", "gen-0", "coordinator"]
    membership = {"etcd": "http://10.0.0.9:2379", "name": "prod"}
    for name in ("ctx-0", "gen-0", "coordinator"):
        assert files[Path("logs") / f"{name}.yaml"]["cluster"] == membership
    coordinator = files[Path("logs") / "coordinator.yaml"]
    assert "urls" not in coordinator["context_servers"]
    assert "urls" not in coordinator["generation_servers"]
    assert plan.etcd_data is None


def test_an_embedded_etcd_starts_first() -> None:
    require_etcd()
    plan, files = plan_cluster({**SPEC, "etcd": "embedded"}, source="up.yaml", root=Path("."))
    etcd = plan.children[0]
    assert etcd.name == "etcd" and "--listen-client-urls" in etcd.args
    assert files[Path("logs") / "ctx-0.yaml"]["cluster"] == {"etcd": etcd.url, "name": "local"}
    assert plan.etcd_data == Path("logs") / "etcd-data"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"etcd": "nowhere"}, r"\$\.etcd: 'embedded' or an etcd URL"),
        ({"etcd": "http://e:1", "cluster_name": "a/b"}, r"\$\.cluster_name: expected"),
    ],
)
def test_bad_membership_keys_are_named(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=r"^up\.yaml: " + message):
        plan_cluster({**SPEC, **changes}, source="up.yaml", root=Path("."))


def test_a_split_cluster_s_workers_get_a_kv_transceiver_unless_theirs_is_set() -> None:
    """A ctx and gen pair exchanges KV, so a worker that names no transceiver gets NIXL (else
    every split request would be a 400); one served aggregated alone (no ctx) gets none."""
    spec = {**SPEC, "gen": [{"port": 9002, "cache_transceiver_config": {"backend": "LOOPBACK"}}]}
    _, files = plan_cluster(spec, source="up.yaml", root=Path("."))
    assert files[Path("logs") / "ctx-0.yaml"]["cache_transceiver_config"] == {"backend": "NIXL"}
    assert files[Path("logs") / "gen-0.yaml"]["cache_transceiver_config"] == {"backend": "LOOPBACK"}
    alone = {
        "log_dir": "logs",
        "ctx": [],
        "gen": [{"port": 9002}],
        "coordinator": {"conditional_disagg_config": {"max_local_prefill_length": 0}},
    }
    _, files = plan_cluster(alone, source="up.yaml", root=Path("."))
    assert "cache_transceiver_config" not in files[Path("logs") / "gen-0.yaml"]
