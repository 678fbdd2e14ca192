"""serve_worker: one worker process (one rank) — model, KV pool, executor, HTTP, in one nursery.

Start-up order is explicit (DESIGN.md §1): model and KV pool loaded → executor ready → HTTP
serving → the "ready" log line. Until then the port is closed, so a health check cannot see a
half-started worker.
"""

from __future__ import annotations

import functools
import logging

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from trtdisagg.config import WorkerConfig
from trtdisagg.kv.block_pool import BlockPool
from trtdisagg.metrics import WorkerMetrics
from trtdisagg.model.loader import resolve_model
from trtdisagg.model.parallel import Parallel
from trtdisagg.model.synthetic import is_synthetic
from trtdisagg.transfer.messenger import Router, open_router
from trtdisagg.worker.app import create_app
from trtdisagg.worker.executor import Executor
from trtdisagg.worker.runner import build_runner
from trtdisagg.worker.scheduler import Scheduler
from trtdisagg.worker.service import WorkerService
from trtdisagg.worker.test_hooks import TestHooks
from trtdisagg.worker.tokenization import Tokenizer
from trtdisagg.worker.transfer_setup import build_transceiver

log = logging.getLogger("trtdisagg.worker")


async def _hold_router(
    host: str, *, task_status: trio.TaskStatus[Router] = trio.TASK_STATUS_IGNORED
) -> None:
    """Own this rank's control-plane ROUTER for the life of the worker (bound to `host` only)."""
    address = f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"
    async with open_router(bind=address) as router:
        task_status.started(router)
        await trio.sleep_forever()


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
    tokenizer = await trio.to_thread.run_sync(Tokenizer.from_dir, model_dir)
    parallel = Parallel(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, tp_group=None, device_index=config.cuda_device
    )
    runner = await trio.to_thread.run_sync(build_runner, config, model_dir, parallel)
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
    executor = Executor(
        scheduler=scheduler,
        runner=runner,
        tokenizer=tokenizer,
        metrics=metrics,
        role=config.role.value,
        max_seq_len=max_seq_len,
    )
    if config.enable_test_hooks:
        executor.test_hooks = TestHooks()
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
    )
    async with trio.open_nursery() as nursery:
        transfer = config.cache_transceiver_config
        if transfer.backend is None:
            log.info("cache_transceiver is disabled")
        else:
            router = await nursery.start(_hold_router, config.host)
            executor.transceiver = await build_transceiver(
                config, runner, model_dir, router, executor, metrics
            )
            await nursery.start(executor.transceiver.run)
            service.ctx_info_endpoint = executor.transceiver.info_endpoint
            log.info(
                "Using KvCacheTransceiver backend=%s endpoint=%s instance=%s",
                transfer.backend.value,
                service.ctx_info_endpoint,
                executor.transceiver.local.instance_name,
            )
        await nursery.start(executor.run)
        app = create_app(service)
        serve_http = functools.partial(
            hypercorn_serve, app, hypercorn_config(config.host, config.port)
        )
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
