"""Two groups of real workers behind one coordinator, each group able to pair only within itself
(peers.md, pain point 11: a mismatched pair fails every request while /health is green).

As in a rolling upgrade, the old group and the new one differ in one KV setting
(`tokens_per_block` 16 and 32), so a ctx of one group cannot write into a gen of the other. The
coordinator must say which pairs cannot work and choose every request's second server from the
first one's group: with no retries and no migrations to hide a crossed pair, each request
succeeds, and each group's gen takes exactly the requests its own ctx prefilled.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.edges import wait_until
from tests.instances import running_instances
from tests.procs import Server, free_port, metric, spawn

pytestmark = pytest.mark.timeout(300)

NIXL = {"backend": "NIXL", "kv_transfer_timeout_ms": 10000, "nixl_progress_thread": False}
# tokens_per_block of each group, and its workers. Three ctx and two gen: the routers'
# rotations (by 3 and by 2) do not keep in step, so a coordinator blind to the groups would
# cross them.
GROUPS = {"old": 16, "new": 32}
WORKERS = {
    "ctx_old": "old",
    "gen_old": "old",
    "ctx_new": "new",
    "ctx_new2": "new",
    "gen_new": "new",
}
REQUESTS = 16


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    specs = {
        name: (name[:3], {
            "cache_transceiver_config": NIXL,
            "kv_cache_config": {"tokens_per_block": GROUPS[group]},
        })
        for name, group in WORKERS.items()
    }  # fmt: skip
    with running_instances(tmp_path_factory.mktemp("groups"), specs) as servers:
        yield servers


def _incompatible_pairs(url: str, expected: int) -> dict[tuple[str, str], str]:
    """The coordinator's (ctx, gen) pairs that cannot exchange KV, with why, once its health
    checks have met every server (the pairs are found there)."""

    def pairs() -> list[dict[str, str]]:
        return list(httpx.get(url + "/cluster_info", timeout=10).json()["incompatible_pairs"])

    wait_until(lambda: len(pairs()) >= expected, 20, "the coordinator's incompatible pairs")
    return {(p["context"], p["generation"]): p["reason"] for p in pairs()}


def _served(server: Server, role: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return metric(text, "trtdisagg_requests_total", f'role="{role}",status="ok"')


def test_a_coordinator_pairs_each_request_within_one_group(
    workers: dict[str, Server], tmp_path: Path
) -> None:
    port = free_port()
    urls = {
        role: [s.url for n, s in workers.items() if n.startswith(role)] for role in ("ctx", "gen")
    }
    config = {
        "hostname": "127.0.0.1", "port": port, "max_retries": 0, "max_migrations": 0,
        "health_check_interval": 0.2,
        "context_servers": {"urls": urls["ctx"]}, "generation_servers": {"urls": urls["gen"]},
    }  # fmt: skip
    path = tmp_path / "disagg.yaml"
    path.write_text(yaml.safe_dump(config))
    before = {name: _served(s, name[:3]) for name, s in workers.items()}
    rng = random.Random(11)
    with spawn(["coordinator", "--config", str(path)], port=port, log_path=tmp_path / "c.log") as c:
        crossed = _incompatible_pairs(c.url, 3)
        assert set(crossed) == {
            (workers[ctx].url, workers[gen].url)
            for ctx, gen in (
                ("ctx_old", "gen_new"),
                ("ctx_new", "gen_old"),
                ("ctx_new2", "gen_old"),
            )
        }, crossed
        assert all("tokens_per_block" in reason for reason in crossed.values()), crossed
        for i in range(REQUESTS):
            prompt = [rng.randrange(10, 500) for _ in range(rng.randint(5, 60))]
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            r = httpx.post(c.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, (i, r.text)
    served = {name: _served(s, name[:3]) - before[name] for name, s in workers.items()}
    prefilled = {
        group: sum(served[n] for n, g in WORKERS.items() if g == group and n.startswith("ctx"))
        for group in GROUPS
    }
    assert sum(prefilled.values()) == REQUESTS, served
    for group in GROUPS:  # both groups served; what a group's ctx prefilled, its gen decoded
        assert prefilled[group] > 0, served
        assert served[f"gen_{group}"] == prefilled[group], served
