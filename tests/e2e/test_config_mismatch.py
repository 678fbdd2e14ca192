"""ctx and gen whose bounce settings differ are refused at registration (acceptance 6).

dtype, tokens_per_block and model mismatches are covered by
tests/e2e/test_disagg_transfer.py::test_incompatible_pair_is_refused_fast_with_both_values (the
same `check_compatible` path); field by field, including every bounce case, in
tests/unit/test_transfer_rank_info.py. Here: real processes, `kv_cache_bounce_size_mb` 0 on ctx
and 64 on gen, through the coordinator and directly. Nothing degrades silently: the request fails
fast with both values, the refusal is cached (the second fails faster still), no block stays held
and gen keeps serving plain requests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.edges import NIXL, Cluster, aggregated, completion, running_cluster, wait_idle

pytestmark = pytest.mark.timeout(240)

BOTH_VALUES = "kv_cache_bounce_size_mb: local 64 vs peer 0"  # as gen, the registering side, says


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("mismatch")
    bounce = {"cache_transceiver_config": {**NIXL, "kv_cache_bounce_size_mb": 64}}
    with running_cluster(tmp, gen_worker=bounce, coordinator={"max_retries": 0}) as running:
        yield running


def test_bounce_mismatch_is_refused_fast_with_both_values(cluster: Cluster) -> None:
    assert cluster.coordinator is not None
    body = completion([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4)
    with httpx.Client(timeout=60, trust_env=False) as client:
        for limit in (3.0, 1.0):  # the first contact runs the rendezvous; then it is cached
            start = time.monotonic()
            r = client.post(cluster.coordinator.url + "/v1/completions", json=body)
            elapsed = time.monotonic() - start
            assert r.status_code == 502, r.text
            assert BOTH_VALUES in r.json()["error"]["message"], r.text
            assert elapsed < limit, elapsed
        assert aggregated(client, cluster.gen.url, body)  # gen itself still serves
        for server in cluster.workers:
            wait_idle(client, server)
    log = cluster.gen.log()
    assert log.count("refused ctx instance") == 1 and BOTH_VALUES in log  # once, for operators
