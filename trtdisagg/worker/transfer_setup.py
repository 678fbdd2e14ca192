"""Building one rank's KV transceiver: its ROUTER, agent, registered pool, RankInfo, metrics.

Registration happens once, here, at start: nothing is registered or allocated per request on the
transfer path. The agent's metadata is read after registration, because NIXL's metadata names the
registered memory. With fault injection armed (TRTDISAGG_FAULTS, tests only), and only then, the
router, the dealers and the agent are wrapped in their faulty versions (trtdisagg/faults/).

With a cluster secret (trtdisagg/security/) the ROUTER is a CURVE server, and the ZAP task that
admits its clients runs beside it for the process's life (one per zmq context: every rank is a
process of its own); the dealers are CURVE clients speaking for this rank's label. The rank's
own messages must fit the control plane's frame cap (`check_fits`), or peers would drop the
connection that carries them: such a worker refuses to start.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from trtdisagg.config import TransceiverBackend, WorkerConfig
from trtdisagg.kv.staging import StagingBuffer
from trtdisagg.membership.interfaces import confine_ucx_to_interface
from trtdisagg.metrics import WorkerMetrics
from trtdisagg.model.args import model_fingerprint
from trtdisagg.model.parallel import pp_layer_range
from trtdisagg.security.keys import PeerLabel
from trtdisagg.security.limits import check_fits
from trtdisagg.security.secret import ClusterSecret, cluster_secret_of
from trtdisagg.security.zap import serve_zap
from trtdisagg.transfer.protocol.liveness import PeerLiveness
from trtdisagg.transfer.protocol.rank_info import (
    BounceConfig,
    RankInfo,
    flat_rank,
    make_instance_name,
)
from trtdisagg.transfer.protocol.wire import PROTOCOL_VERSION, InstanceInfo, RegisterPeer, encode
from trtdisagg.transfer.runtime.agents.base import (
    MemoryRegion,
    TransferAgent,
    make_agent,
    pool_regions,
)
from trtdisagg.transfer.runtime.agents.loopback import LoopbackFabric
from trtdisagg.transfer.runtime.collector import TransferCollector, WriteTally
from trtdisagg.transfer.runtime.control import ControlRouter, DealerOpener
from trtdisagg.transfer.runtime.driver import KvTransceiver
from trtdisagg.transfer.runtime.messenger import open_dealer, open_router
from trtdisagg.transfer.runtime.staging_area import StagingArea
from trtdisagg.worker.runner import ModelRunner
from trtdisagg.worker.slow_writes import SlowWrites

if TYPE_CHECKING:
    from trtdisagg.faults.spec import FaultInjector

log = logging.getLogger(__name__)


def control_secret(config: WorkerConfig) -> ClusterSecret | None:
    """The cluster secret the control plane runs with (None: unsecured, loopback only)."""
    return cluster_secret_of(config.cache_transceiver_config.cluster_secret)


async def hold_router(
    host: str,
    faults: FaultInjector | None = None,
    secret: ClusterSecret | None = None,
    *,
    task_status: trio.TaskStatus[ControlRouter] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Own this rank's control-plane ROUTER for the life of the worker (bound to `host` only),
    a CURVE server with `secret`, with the process's ZAP task; with `faults` (tests only), its
    replies follow the fault plan."""
    address = f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"
    async with trio.open_nursery() as nursery:
        if secret is not None:
            await nursery.start(serve_zap)
        async with open_router(bind=address, secret=secret) as router:
            if faults is None:
                task_status.started(router)
                await trio.sleep_forever()
            from trtdisagg.faults.messenger import faulty_router  # armed: tests only

            async with faulty_router(router, faults) as faulty:
                task_status.started(faulty)
                await trio.sleep_forever()


def _make_agent(backend: TransceiverBackend, name: str, progress_thread: bool) -> TransferAgent:
    # LOOPBACK moves bytes only between agents of one process; a worker gets its own fabric,
    # which serves single-process tests that run ctx and gen sides in one interpreter.
    fabric = LoopbackFabric() if backend is TransceiverBackend.LOOPBACK else None
    return make_agent(backend.value, name, fabric=fabric, progress_thread=progress_thread)


async def build_transceiver(
    config: WorkerConfig,
    runner: ModelRunner,
    model_dir: Path,
    router: ControlRouter,
    wake: Callable[[], None],
    metrics: WorkerMetrics | None,
    *,
    instance_name: str | None = None,
    share_infos: Callable[[RankInfo], Awaitable[tuple[RankInfo, ...]]] | None = None,
    faults: FaultInjector | None = None,
    on_write: Callable[[int, int, float, str], None] | None = None,
    early_failures: bool = True,
) -> KvTransceiver:
    """This rank's transceiver, its transfer metrics registered on `metrics`' registry. A
    multi-rank instance passes its shared `instance_name` and `share_infos`, which swaps
    RankInfos with the other ranks (every rank must call it), and `early_failures` off (see
    KvTransceiver). `on_write(bytes, descriptors, seconds, gen rank)` learns of each KV write (a
    follower rank reports its writes to rank 0 so; rank 0 judges them all against the bandwidth
    floor, `kv_transfer_min_gbps`). `faults` (tests only) wraps the agent and the
    dealers; `router` comes wrapped from `hold_router`."""
    transfer = config.cache_transceiver_config
    assert transfer.backend is not None
    model = runner.model
    cache = runner.cache
    parallel = model.parallel
    if instance_name is None:
        instance_name = make_instance_name(config.role.value)
    rank = flat_rank(tp_rank=parallel.tp_rank, pp_rank=parallel.pp_rank, tp_size=parallel.tp_size)
    label = PeerLabel(instance_name=instance_name, instance_rank=rank)
    agent_name = label.text
    if transfer.backend is TransceiverBackend.NIXL:
        await confine_ucx_to_interface(config.host, config.advertise_host)
    agent = await trio.to_thread.run_sync(
        _make_agent, transfer.backend, agent_name, config.nixl_progress_thread
    )
    secured = functools.partial(open_dealer, secret=control_secret(config), label=label)
    connect: DealerOpener = secured
    if faults is not None:  # tests only (TRTDISAGG_FAULTS)
        from trtdisagg.faults.agent import FaultyAgent
        from trtdisagg.faults.messenger import faulty_dealers

        agent = FaultyAgent(agent, faults)
        connect = faulty_dealers(faults, secured)
    page_table = cache.page_table(model.local_layer_ids)
    regions = pool_regions(page_table)
    stager = None
    if transfer.kv_cache_bounce_size_mb:
        # Registered with the pool, once: the bounce path allocates nothing per request.
        stager = StagingBuffer(cache, transfer.kv_cache_bounce_size_mb << 20)
        regions.append(
            MemoryRegion(
                address=stager.address,
                size=stager.capacity,
                memory_type=stager.memory_type,
                device_id=stager.device_id,
            )
        )
    await trio.to_thread.run_sync(agent.register_memory, regions)
    fingerprint = await trio.to_thread.run_sync(model_fingerprint, model_dir)
    info = RankInfo(
        instance_name=instance_name,
        instance_rank=rank,
        tp_size=parallel.tp_size,
        tp_rank=parallel.tp_rank,
        pp_size=parallel.pp_size,
        pp_rank=parallel.pp_rank,
        layer_num_per_pp=tuple(
            end - start
            for start, end in (
                pp_layer_range(model.args.num_layers, parallel.pp_size, stage)
                for stage in range(parallel.pp_size)
            )
        ),
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
        bounce=BounceConfig(
            size_mb=transfer.kv_cache_bounce_size_mb,
            threshold_bytes=transfer.kv_cache_bounce_threshold_bytes,
        ),
    )
    instance = (info,) if share_infos is None else await share_infos(info)
    check_fits(len(encode(RegisterPeer(info=info))), f"this rank's REGISTER_PEER ({info.label})")
    if rank == 0:
        answer = InstanceInfo(protocol_version=PROTOCOL_VERSION, ranks=instance)
        check_fits(len(encode(answer)), "this instance's INSTANCE_INFO")
    transceiver = KvTransceiver(
        local=info,
        instance=instance,
        agent=agent,
        router=router,
        timeout_s=transfer.kv_transfer_timeout_ms / 1000,
        max_sessions_per_peer=transfer.max_sessions_per_peer,
        wake=wake,
        early_failures=early_failures,
        tally=WriteTally(watch=_bandwidth_floor(transfer.kv_transfer_min_gbps, metrics)),
        on_write=on_write,
        connect=connect,
        staging=StagingArea(stager=stager, clock=time.monotonic) if stager is not None else None,
        liveness=PeerLiveness(
            idle_s=transfer.peer_probe_ms / 1000, answer_s=transfer.peer_probe_ms / 1000
        ),
    )
    if metrics is not None:
        metrics.registry.register(TransferCollector(transceiver.statistics, transceiver.tally))
    return transceiver


def _bandwidth_floor(
    min_gbps: float | None, metrics: WorkerMetrics | None
) -> Callable[[int, float, str], None] | None:
    """What judges rank 0's KV writes (its own and its followers') against `min_gbps`."""
    if min_gbps is None or metrics is None:
        return None
    return SlowWrites(min_gbps=min_gbps, counter=metrics.kv_slow_writes).observe
