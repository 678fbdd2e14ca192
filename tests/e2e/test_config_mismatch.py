"""ctx and gen whose bounce settings differ are refused at registration (acceptance 6), and a
coordinator refuses to pair them at all (peers.md, pain point 11).

dtype, tokens_per_block and model mismatches are covered by
tests/e2e/test_disagg_transfer.py::test_incompatible_pair_is_refused_fast_with_both_values (the
same `PeerRegistrar.register` gate); field by field, including every bounce case, in
tests/unit/test_transfer_rank_info.py; the coordinator's pairing rules in
tests/unit/test_coordinator_pairing.py. Here: real processes, `kv_cache_bounce_size_mb` 0 on ctx
and 64 on gen. Nothing degrades silently:
* asked directly, gen fails the request fast with both values, the refusal is cached (the second
  fails faster still), no block stays held and gen keeps serving plain requests;
* a coordinator in front of the pair does not start: it would look healthy and answer every
  request with a 502. It exits naming both servers, the field and both values.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.edges import NIXL, Cluster, aggregated, completion, running_cluster, wait_idle
from tests.procs import REPO, free_port, stop
from trtdisagg.coordinator.serve import EXIT_STARTUP_FAILED

pytestmark = pytest.mark.timeout(240)

BOTH_VALUES = "kv_cache_bounce_size_mb: local 64 vs peer 0"  # as gen, the registering side, says


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("mismatch")
    bounce = {"cache_transceiver_config": {**NIXL, "kv_cache_bounce_size_mb": 64}}
    with running_cluster(tmp, gen_worker=bounce, with_coordinator=False) as running:
        yield running


def test_bounce_mismatch_is_refused_fast_with_both_values(cluster: Cluster) -> None:
    body = completion([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4)
    with httpx.Client(timeout=60, trust_env=False) as client:
        for limit in (3.0, 1.0):  # the first contact runs the rendezvous; then it is cached
            ctx_body = {**body, "disaggregated_params": {"request_type": "context_only"}}
            answer = client.post(cluster.ctx.url + "/v1/completions", json=ctx_body).json()
            params = answer["choices"][0]["disaggregated_params"]
            gen_params = {**params, "request_type": "generation_only"}
            gen_body = {**body, "prompt_token_ids": answer["prompt_token_ids"],
                        "disaggregated_params": gen_params}  # fmt: skip
            start = time.monotonic()
            r = client.post(cluster.gen.url + "/v1/completions", json=gen_body)
            elapsed = time.monotonic() - start
            assert r.status_code == 502, r.text
            assert BOTH_VALUES in r.json()["error"]["message"], r.text
            assert elapsed < limit, elapsed
            # As a client that will not ask gen again: ctx's KV goes back at once.
            key = {"transfer_key": params["transfer_key"]}
            r = client.post(cluster.ctx.url + "/disagg/release", json=key)
            assert r.json() == {**key, "released": True}, r.text
        assert aggregated(client, cluster.gen.url, body)  # gen itself still serves
        for server in cluster.workers:
            wait_idle(client, server)
    log = cluster.gen.log()
    assert log.count("refused ctx instance") == 1 and BOTH_VALUES in log  # once, for operators


def test_a_coordinator_will_not_pair_them(cluster: Cluster, tmp_path: Path) -> None:
    config = tmp_path / "disagg.yaml"
    config.write_text(yaml.safe_dump({
        "hostname": "127.0.0.1",
        "port": free_port(),
        "context_servers": {"urls": [cluster.ctx.url]},
        "generation_servers": {"urls": [cluster.gen.url]},
        "server_start_timeout": 60,
    }))  # fmt: skip
    log_path = tmp_path / "coordinator.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trtdisagg", "coordinator", "--config", str(config)],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
    try:
        code = proc.wait(timeout=30)  # both are healthy at once: no need to wait them out
    finally:
        stop(proc)
    log = log_path.read_text(errors="replace")
    assert code == EXIT_STARTUP_FAILED, log
    (line,) = [x for x in log.splitlines() if "start-up failed" in x]
    assert "kv_cache_bounce_size_mb: ctx 0 vs gen 64" in line, line
    assert cluster.ctx.url in line and cluster.gen.url in line, line
