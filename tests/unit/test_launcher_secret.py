"""`up` runs its cluster secured: a cluster secret per run, unless the user set one."""

from __future__ import annotations

from pathlib import Path

from trtdisagg.launcher import DEFAULT_CLUSTER, children_environment, plan_cluster
from trtdisagg.security.secret import ENV_VAR, MIN_SECRET_BYTES, ClusterSecret


def test_each_run_gets_a_secret_of_its_own() -> None:
    plan, _ = plan_cluster(DEFAULT_CLUSTER, source="default", root=Path.cwd())
    first = children_environment(plan, {"PATH": "/bin"})
    second = children_environment(plan, {"PATH": "/bin"})
    assert first[ENV_VAR] != second[ENV_VAR]
    assert len(first[ENV_VAR].encode()) >= MIN_SECRET_BYTES
    ClusterSecret.parse(first[ENV_VAR])  # one the workers accept
    assert first["PATH"] == "/bin"


def test_a_secret_the_user_set_is_kept() -> None:
    plan, _ = plan_cluster(DEFAULT_CLUSTER, source="default", root=Path.cwd())
    mine = "the-user-s-own-cluster-secret"
    assert children_environment(plan, {ENV_VAR: mine})[ENV_VAR] == mine
    configured = {**DEFAULT_CLUSTER, "gen": [{
        "model": "tiny", "cache_transceiver_config": {"backend": "NIXL", "cluster_secret": mine},
    }]}  # fmt: skip
    plan, files = plan_cluster(configured, source="test", root=Path.cwd())
    assert ENV_VAR not in children_environment(plan, {})  # it would override the file's
    written = [str(content) for content in files.values()]
    assert sum(mine in text for text in written) == 1  # only where the user put it
