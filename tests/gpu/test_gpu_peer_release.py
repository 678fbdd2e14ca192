"""A gen that dies is forgotten by its ctx, and the KV pool it had on the GPU is released.

A loaded NIXL agent of a peer on the same node maps that peer's GPU memory (UCX cuda_ipc): a gen
killed while its ctx keeps its agent would stay allocated on the GPU for as long as ctx lives
(40 GiB measured with a bare NIXL pair, even after `remove_remote_agent` with UCX's default IPC
cache). Workers turn that cache off and forget peers whose control connection drops and stays
down, or that stop answering probes (transfer/liveness.py); here a real ctx and gen share GPU 0,
and the gen pool's memory must come back once ctx has forgotten the killed gen.

    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider
"""

from __future__ import annotations

import contextlib
import random
import signal
from pathlib import Path

import httpx
import pytest
import torch
import trio

from tests.fault_checks import wait_metrics
from tests.gpu.test_gpu_disagg import (
    TRANSFER,
    coordinator_yaml,
    start_all,
    through_coordinator,
    worker_yaml,
)
from tests.procs import metric

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(600),
]
pytest.importorskip("nixl")

GEN_POOL_FRACTION = 0.05  # of the free memory: about 7 GB on an H200, 4 GB on an H100
FORGOTTEN = "trtdisagg_kv_peers_forgotten_total"


def _free_bytes() -> int:
    free, _total = torch.cuda.mem_get_info(0)
    return int(free)


async def test_a_killed_gen_s_gpu_pool_is_released_once_its_ctx_forgets_it(
    tmp_path: Path,
) -> None:
    transfer = {**TRANSFER, "peer_probe_ms": 500}
    ctx = {**worker_yaml("tiny", 0), "cache_transceiver_config": transfer}
    gen = {
        **worker_yaml("tiny", 0),
        "cache_transceiver_config": transfer,
        "kv_cache_config": {  # no max_tokens cap: the pool is what the fraction gives
            "tokens_per_block": 32,
            "max_tokens": None,
            "free_gpu_memory_fraction": GEN_POOL_FRACTION,
        },
    }
    with (
        start_all(tmp_path, [("ctx", "ctx", ctx)], {}) as ctx_only,
        contextlib.ExitStack() as stack,
    ):
        # gen's own footprint: its pool, CUDA context and tiny's weights (ctx's is left out: on
        # a smaller GPU it is a larger share of what both hold)
        before_gen = _free_bytes()
        workers = {
            **ctx_only,
            **stack.enter_context(start_all(tmp_path, [("gen", "gen", gen)], {})),
        }
        gen_pool = before_gen - _free_bytes()
        assert gen_pool > 2 << 30, gen_pool
        coordinator = [("coord", "coordinator", coordinator_yaml(workers["ctx"], workers["gen"]))]
        with start_all(tmp_path, coordinator, {}) as coordinators:
            async with httpx.AsyncClient(timeout=120) as client:
                prompt = [random.Random(3).randrange(10, 500) for _ in range(300)]
                # ctx loads gen's agent and writes into its pool: the pool is mapped in ctx
                await through_coordinator(client, coordinators["coord"], prompt, stream=False)
                before = metric((await client.get(workers["ctx"].url + "/metrics")).text, FORGOTTEN)
                held = _free_bytes()
                workers["gen"].proc.send_signal(signal.SIGKILL)
                await trio.to_thread.run_sync(workers["gen"].proc.wait, 30)
                await wait_metrics(
                    client, workers["ctx"], lambda t: metric(t, FORGOTTEN) == before + 1,
                    "ctx forgetting the killed gen", 30,
                )  # fmt: skip
                with trio.fail_after(20):
                    while _free_bytes() - held < 0.8 * gen_pool:  # noqa: ASYNC110
                        await trio.sleep(0.2)
