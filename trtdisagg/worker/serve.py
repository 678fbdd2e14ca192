"""serve_worker: one worker process (rank 0 of its instance): build the engine, start it, serve.

Start-up order is explicit (DESIGN.md §1): the other ranks joined (multi-rank) → model, KV pool,
transceiver and engine built (`engine/build.py`) → transceiver running → engine loop running →
HTTP serving (here, or in `api_server_count` front processes: `front/`) → the "ready" log
line. Until then the port is closed, so a health check cannot see a half-started worker.
"""

from __future__ import annotations

import functools
import logging

import torch
import trio
from hypercorn.config import Config as HypercornConfig

from trtdisagg.api.codec import to_json
from trtdisagg.api.hypercorn_serve import serve as serve_asgi
from trtdisagg.config import WorkerConfig
from trtdisagg.loop_lag import watch_loop_lag
from trtdisagg.membership.records import WorkerRecord, advertised_url
from trtdisagg.model.loader import resolve_model
from trtdisagg.transfer.protocol.rank_info import make_instance_name
from trtdisagg.worker.engine.build import build_worker
from trtdisagg.worker.front.supervisor import serve_fronts
from trtdisagg.worker.http.app import create_app
from trtdisagg.worker.rank_group import RankGroup
from trtdisagg.worker.ranks import Followers, start_followers

log = logging.getLogger("trtdisagg.worker")


def hypercorn_config(host: str, port: int) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.keep_alive_timeout = 75
    config.graceful_timeout = 3
    return config


async def serve_worker(
    config: WorkerConfig, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
) -> None:
    model_dir = await trio.to_thread.run_sync(resolve_model, config.model)
    instance_name = make_instance_name(config.role.value)
    followers: Followers | None = None
    try:
        async with trio.open_nursery() as nursery:
            group: RankGroup | None = None
            if config.world_size > 1:
                store = await trio.to_thread.run_sync(RankGroup.open_store, config.world_size)
                followers = start_followers(
                    config, model_dir, port=store.port, instance_name=instance_name
                )
                nursery.start_soon(followers.watch)  # a rank that dies stops the instance
                group = await trio.to_thread.run_sync(
                    functools.partial(
                        RankGroup.join,
                        rank=0,
                        tp_size=config.tensor_parallel_size,
                        pp_size=config.pipeline_parallel_size,
                        port=store.port,
                        device=torch.device(config.device),
                        device_index=config.cuda_device,
                        store=store,
                    ),
                    abandon_on_cancel=True,
                )
                log.info(
                    "joined %d ranks (tp %d x pp %d)",
                    config.world_size,
                    config.tensor_parallel_size,
                    config.pipeline_parallel_size,
                )
            worker = await build_worker(
                config, model_dir, nursery=nursery, group=group, instance_name=instance_name
            )
            nursery.start_soon(watch_loop_lag, worker.metrics.event_loop_lag.observe)
            if worker.transceiver is not None:
                await nursery.start(worker.transceiver.run)
            await nursery.start(worker.executor.run)
            binds: list[str]
            if config.api_server_count > 0:  # the HTTP API in front processes
                binds = await nursery.start(serve_fronts, config, worker.executor, worker.service)
            else:
                app = create_app(worker.service)
                serve_http = functools.partial(
                    serve_asgi, app, hypercorn_config(config.host, config.port)
                )
                binds = await nursery.start(serve_http)
            pool = worker.executor.scheduler.pool
            log.info(
                "worker ready: role=%s model=%s kv_blocks=%d tokens_per_block=%d url=%s",
                config.role.value,
                worker.service.served_model_name,
                pool.num_blocks,
                pool.tokens_per_block,
                binds[0],
            )
            if config.cluster is not None:  # etcd membership and the SIGTERM drain
                # (imported here: its etcd client's HTTP stack costs a worker's start time)
                from trtdisagg.membership.registration import Drain, serve_registration

                executor = worker.executor
                url = advertised_url(binds[0], config.advertise_host)
                info = to_json(worker.service.server_info())
                record = WorkerRecord.from_server_info(info, url=url, instance=instance_name)
                drain = Drain(
                    busy=lambda: executor.num_active() > 0 or executor.tracker.in_flight,
                    stop=nursery.cancel_scope.cancel,
                )
                await nursery.start(
                    functools.partial(serve_registration, config.cluster, record, drain=drain)
                )
            task_status.started(binds)
    finally:
        if followers is not None:
            followers.stop()
