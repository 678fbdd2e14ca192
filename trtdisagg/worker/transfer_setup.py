"""Building one rank's KV transceiver: agent, registered pool, RankInfo.

Registration happens once, here, at start: nothing is registered or allocated per request on the
transfer path. The agent's metadata is read after registration, because NIXL's metadata names the
registered memory.
"""

from __future__ import annotations

from pathlib import Path

import trio

from trtdisagg.config import TransceiverBackend, WorkerConfig
from trtdisagg.metrics import WorkerMetrics
from trtdisagg.model.args import model_fingerprint
from trtdisagg.transfer.agents.base import TransferAgent, make_agent, pool_regions
from trtdisagg.transfer.agents.loopback import LoopbackFabric
from trtdisagg.transfer.messenger import Router
from trtdisagg.transfer.rank_info import BounceConfig, RankInfo, make_instance_name
from trtdisagg.transfer.transceiver import KvTransceiver
from trtdisagg.transfer.wire import PROTOCOL_VERSION
from trtdisagg.worker.executor import Executor
from trtdisagg.worker.runner import ModelRunner


def _make_agent(backend: TransceiverBackend, name: str, progress_thread: bool) -> TransferAgent:
    # LOOPBACK moves bytes only between agents of one process; a worker gets its own fabric,
    # which serves single-process tests that run ctx and gen sides in one interpreter.
    fabric = LoopbackFabric() if backend is TransceiverBackend.LOOPBACK else None
    return make_agent(backend.value, name, fabric=fabric, progress_thread=progress_thread)


async def build_transceiver(
    config: WorkerConfig,
    runner: ModelRunner,
    model_dir: Path,
    router: Router,
    executor: Executor,
    metrics: WorkerMetrics,
) -> KvTransceiver:
    transfer = config.cache_transceiver_config
    assert transfer.backend is not None
    model = runner.model
    cache = runner.cache
    instance_name = make_instance_name(config.role.value)
    agent_name = f"{instance_name}#0"
    agent = await trio.to_thread.run_sync(
        _make_agent, transfer.backend, agent_name, transfer.nixl_progress_thread
    )
    page_table = cache.page_table(model.local_layer_ids)
    await trio.to_thread.run_sync(agent.register_memory, pool_regions(page_table))
    fingerprint = await trio.to_thread.run_sync(model_fingerprint, model_dir)
    info = RankInfo(
        instance_name=instance_name,
        instance_rank=0,
        tp_size=1,
        tp_rank=0,
        pp_size=1,
        pp_rank=0,
        layer_num_per_pp=(model.args.num_layers,),
        num_kv_heads=model.args.num_kv_heads,
        kv_heads_per_rank=model.local_num_kv_heads,
        head_dim=model.args.head_dim,
        tokens_per_block=cache.tokens_per_block,
        dtype=config.dtype,
        element_bytes=cache.element_bytes,
        layout=cache.layout,
        model_fingerprint=fingerprint,
        protocol_version=PROTOCOL_VERSION,
        control_endpoint=router.endpoint,
        agent_name=agent_name,
        agent_metadata=agent.local_metadata(),
        page_table=page_table,
        bounce=BounceConfig(size_mb=transfer.kv_cache_bounce_size_mb),
    )

    def on_write(num_bytes: int, descriptors: int, seconds: float) -> None:
        metrics.kv_transfer_bytes.inc(num_bytes)
        metrics.kv_transfer_descriptors.inc(descriptors)
        metrics.kv_transfer_seconds.observe(seconds)

    return KvTransceiver(
        local=info,
        instance=(info,),
        agent=agent,
        router=router,
        timeout_s=transfer.kv_transfer_timeout_ms / 1000,
        wake=executor.wake,
        on_write=on_write,
    )
