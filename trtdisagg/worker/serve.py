"""serve_worker: one worker process (one rank) — model, KV pool, executor, HTTP, in one nursery.

Start-up order is explicit (DESIGN.md §1): model and KV pool loaded → executor ready → HTTP
serving → the "ready" log line. Until then the port is closed, so a health check cannot see a
half-started worker.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from trtdisagg.config import WorkerConfig
from trtdisagg.kv.block_pool import BlockPool
from trtdisagg.loop_lag import watch_loop_lag
from trtdisagg.metrics import WorkerMetrics
from trtdisagg.model.loader import resolve_model
from trtdisagg.model.parallel import Parallel
from trtdisagg.model.synthetic import is_synthetic
from trtdisagg.transfer.protocol.rank_info import make_instance_name
from trtdisagg.worker.app import create_app
from trtdisagg.worker.executor import Executor
from trtdisagg.worker.fault_hooks import arm_faults
from trtdisagg.worker.rank_group import RankGroup
from trtdisagg.worker.ranks import Followers, share_infos_with, start_followers
from trtdisagg.worker.runner import build_runner
from trtdisagg.worker.scheduler import Scheduler
from trtdisagg.worker.service import WorkerService
from trtdisagg.worker.test_hooks import TestHooks
from trtdisagg.worker.tokenization import Tokenizer
from trtdisagg.worker.transfer_setup import build_transceiver, hold_router

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
                port = store.port
                followers = start_followers(
                    config, model_dir, port=port, instance_name=instance_name
                )
                nursery.start_soon(followers.watch)  # a rank that dies stops the instance
                group = await trio.to_thread.run_sync(
                    functools.partial(
                        RankGroup.join,
                        rank=0,
                        tp_size=config.tensor_parallel_size,
                        pp_size=config.pipeline_parallel_size,
                        port=port,
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
            await _serve_rank0(config, model_dir, instance_name, group, nursery, task_status)
    finally:
        if followers is not None:
            followers.stop()


async def _serve_rank0(
    config: WorkerConfig,
    model_dir: Path,
    instance_name: str,
    group: RankGroup | None,
    nursery: trio.Nursery,
    task_status: trio.TaskStatus[list[str]],
) -> None:
    tokenizer = await trio.to_thread.run_sync(Tokenizer.from_dir, model_dir)
    parallel = group.parallel if group is not None else Parallel(device_index=config.cuda_device)
    runner = await trio.to_thread.run_sync(
        functools.partial(
            build_runner,
            config,
            model_dir,
            parallel,
            agree_blocks=group.agree_min if group is not None else None,
        ),
        abandon_on_cancel=group is not None,
    )
    max_seq_len = config.max_seq_len or runner.model.args.max_position_embeddings
    kv = config.kv_cache_config
    pool = BlockPool(
        num_blocks=runner.cache.num_blocks,
        tokens_per_block=kv.tokens_per_block,
        enable_block_reuse=kv.enable_block_reuse,
    )
    scheduler = Scheduler(
        pool=pool,
        max_batch_size=config.max_batch_size,
        max_num_tokens=config.max_num_tokens,
        max_seq_len=max_seq_len,
    )
    metrics = WorkerMetrics.create()
    nursery.start_soon(watch_loop_lag, metrics.event_loop_lag.observe)
    executor = Executor(
        scheduler=scheduler,
        runner=runner,
        tokenizer=tokenizer,
        metrics=metrics,
        role=config.role.value,
        max_seq_len=max_seq_len,
        ranks=group,
    )
    if config.enable_test_hooks:
        executor.test_hooks = TestHooks(
            layer_ids=runner.model.local_layer_ids, head_ids=runner.model.local_kv_head_ids
        )
        log.warning("test hooks are enabled (TRTDISAGG_TEST_HOOKS=1): not for production")
    named = config.model == "tiny" or is_synthetic(config.model)  # no directory name to show
    served = config.served_model_name or (config.model if named else model_dir.name)
    service = WorkerService(
        config=config,
        served_model_name=served,
        model_dir=model_dir,
        tokenizer=tokenizer,
        executor=executor,
        metrics=metrics,
        max_seq_len=max_seq_len,
        faults=(faults := arm_faults(config, metrics)),
    )
    transfer = config.cache_transceiver_config
    if transfer.backend is None:
        log.info("cache_transceiver is disabled")
    else:
        router = await nursery.start(hold_router, config.host, faults)
        executor.transceiver = await build_transceiver(
            config,
            runner,
            model_dir,
            router,
            executor.wake,
            metrics,
            instance_name=instance_name,
            share_infos=share_infos_with(group) if group is not None else None,
            faults=faults,
            early_failures=group is None,  # see KvTransceiver.early_failures
        )
        await nursery.start(executor.transceiver.run)
        service.ctx_info_endpoint = executor.transceiver.info_endpoint
        service.ctx_instance = executor.transceiver.local.instance_name
        log.info(
            "Using KvCacheTransceiver backend=%s endpoint=%s instance=%s",
            transfer.backend.value,
            service.ctx_info_endpoint,
            executor.transceiver.local.instance_name,
        )
    await nursery.start(executor.run)
    app = create_app(service)
    serve_http = functools.partial(hypercorn_serve, app, hypercorn_config(config.host, config.port))
    binds: list[str] = await nursery.start(serve_http)
    service.ready = True
    log.info(
        "worker ready: role=%s model=%s kv_blocks=%d tokens_per_block=%d url=%s",
        config.role.value,
        served,
        pool.num_blocks,
        kv.tokens_per_block,
        binds[0],
    )
    task_status.started(binds)
