"""Building one worker's engine (rank 0): every part constructed once, in dependency order.

The wake-up comes first: the transceiver wakes the loop through it, and the loop waits on it, so
neither needs the other. The transceiver comes next (it needs the runner's KV pool and a bound
control-plane ROUTER), then the engine's parts around it: scheduler, step driver, transfer
tracker, output processor, loop, and the HTTP side's `WorkerService`. Test hooks, when enabled,
wrap the runner and the transceiver here; nothing else knows of them.

Starting the services is `serve.py`'s, in its nursery and documented order.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import trio

from trtdisagg.config import WorkerConfig
from trtdisagg.kv.block_pool import BlockPool
from trtdisagg.membership.records import advertised_endpoint
from trtdisagg.metrics import WorkerMetrics
from trtdisagg.model.parallel import Parallel
from trtdisagg.model.synthetic import is_synthetic
from trtdisagg.transfer.runtime.driver import KvTransceiver
from trtdisagg.worker.engine.executor import Executor
from trtdisagg.worker.engine.host_stream import HostStream
from trtdisagg.worker.engine.live import Inbox
from trtdisagg.worker.engine.local import LocalDriver
from trtdisagg.worker.engine.loop import StepLoop
from trtdisagg.worker.engine.multi_rank import MultiRankDriver
from trtdisagg.worker.engine.outputs import OutputProcessor
from trtdisagg.worker.engine.ports import StepDriver, Transceiver
from trtdisagg.worker.engine.test_hooks import DigestingTransceiver, FaultyRunner, TestHooks
from trtdisagg.worker.engine.tracker import TransferTracker
from trtdisagg.worker.engine.wakeup import Wakeup
from trtdisagg.worker.fault_hooks import arm_faults
from trtdisagg.worker.http.engine import LocalEngine
from trtdisagg.worker.http.service import WorkerService
from trtdisagg.worker.rank_group import RankGroup
from trtdisagg.worker.rank_plan import RankReport
from trtdisagg.worker.ranks import share_infos_with
from trtdisagg.worker.runner import ModelRunner, build_runner
from trtdisagg.worker.scheduler import Scheduler
from trtdisagg.worker.tokenization import Tokenizer
from trtdisagg.worker.transfer_setup import build_transceiver, control_secret, hold_router

log = logging.getLogger("trtdisagg.worker")

ReportSink = Callable[[Sequence[RankReport]], None]

# What one step may spend on prompt logprobs' logits: each prompt position that asks for them is
# a float32 row of the whole vocabulary (twice, with its log-softmax). Unbounded, one request's
# long prompt could take gigabytes in one step, fail it and every request in it.
PROMPT_LOGITS_BYTES = 1 << 30


@attrs.frozen(kw_only=True)
class Worker:
    """One worker's built parts; `serve.py` starts them."""

    service: WorkerService
    executor: Executor
    transceiver: KvTransceiver | None
    metrics: WorkerMetrics


async def build_worker(
    config: WorkerConfig,
    model_dir: Path,
    *,
    nursery: trio.Nursery,
    group: RankGroup | None,
    instance_name: str,
) -> Worker:
    """Rank 0's model, KV pool, transceiver, engine and HTTP service. The control-plane ROUTER
    is bound here, in `nursery` (the transceiver's RankInfo names its endpoint)."""
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
    metrics = WorkerMetrics.create()
    faults = arm_faults(config, metrics)
    wakeup = Wakeup()
    hooks = None
    if config.enable_test_hooks:
        hooks = TestHooks(world_size=config.world_size)
        log.warning("test hooks are enabled (TRTDISAGG_TEST_HOOKS=1): not for production")
    transceiver = None
    transfer = config.cache_transceiver_config
    if transfer.backend is None:
        log.info("cache_transceiver is disabled")
    else:
        router = await nursery.start(hold_router, config.host, faults, control_secret(config))
        router.endpoint = advertised_endpoint(router.endpoint, config.advertise_host)
        transceiver = await build_transceiver(
            config,
            runner,
            model_dir,
            router,
            wakeup.set,
            metrics,
            instance_name=instance_name,
            share_infos=share_infos_with(group) if group is not None else None,
            faults=faults,
            # A multi-rank instance merges its ranks' outcomes: see KvTransceiver.early_failures.
            early_failures=group is None,
        )
        log.info(
            "Using KvCacheTransceiver backend=%s endpoint=%s instance=%s",
            transfer.backend.value,
            transceiver.info_endpoint,
            transceiver.local.instance_name,
        )
    executor = assemble_executor(
        config,
        runner=runner,
        tokenizer=tokenizer,
        metrics=metrics,
        wakeup=wakeup,
        transceiver=transceiver,
        group=group,
        test_hooks=hooks,
    )
    named = config.model == "tiny" or is_synthetic(config.model)  # no directory name to show
    service = WorkerService(
        config=config,
        served_model_name=config.served_model_name or (config.model if named else model_dir.name),
        model_dir=model_dir,
        tokenizer=tokenizer,
        engine=LocalEngine(executor=executor),
        max_seq_len=executor.max_seq_len,
        faults=faults,
        ctx_info_endpoint=transceiver.info_endpoint if transceiver is not None else None,
        ctx_instance=transceiver.local.instance_name if transceiver is not None else None,
        # Only `serve.py` opens the HTTP port, and it does so last: whoever can reach the
        # service finds the engine running.
        ready=True,
    )
    return Worker(service=service, executor=executor, transceiver=transceiver, metrics=metrics)


def assemble_executor(
    config: WorkerConfig,
    *,
    runner: ModelRunner,
    tokenizer: Tokenizer,
    metrics: WorkerMetrics,
    wakeup: Wakeup,
    transceiver: KvTransceiver | None = None,
    group: RankGroup | None = None,
    test_hooks: TestHooks | None = None,
) -> Executor:
    """The engine around a built runner (and transceiver): what `build_worker` does once the
    slow parts are there, and what a test does around a runner it shares."""
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
        prefill_chunk_tokens=config.prefill_chunk_tokens,
        max_seq_len=max_seq_len,
        max_logit_rows=max(1, PROMPT_LOGITS_BYTES // (4 * runner.model.args.vocab_size)),
    )
    moves: Transceiver | None = transceiver
    if test_hooks is not None and transceiver is not None:
        moves = DigestingTransceiver(
            inner=transceiver,
            cache=runner.cache,
            layer_ids=runner.model.local_layer_ids,
            head_ids=runner.model.local_kv_head_ids,
            record=functools.partial(test_hooks.add_parts, 0),
        )
    driver: StepDriver
    if group is None:
        stepper = runner if test_hooks is None else FaultyRunner(runner=runner, hooks=test_hooks)
        driver = LocalDriver(
            runner=stepper,
            wakeup=wakeup,
            transceiver=moves,
            overlaps=config.async_scheduling,
            host_stream=HostStream(lost=stepper.lost) if runner.device.type == "cpu" else None,
        )
    else:
        driver = MultiRankDriver(
            group=group,
            runner=runner,
            wakeup=wakeup,
            transceiver=moves,
            on_reports=_on_reports(transceiver, test_hooks),
        )
    tracker = TransferTracker(scheduler=scheduler, port=driver, vocab_size=tokenizer.vocab_size)
    outputs = OutputProcessor(
        eos_token_ids=tokenizer.eos_token_ids,
        max_seq_len=max_seq_len,
        observe_first_token=metrics.time_to_first_token.observe,
        observe_inter_token=metrics.inter_token_latency.observe,
    )
    inbox = Inbox(wake=wakeup.set)
    loop = StepLoop(
        scheduler=scheduler,
        driver=driver,
        tracker=tracker,
        outputs=outputs,
        inbox=inbox,
        metrics=metrics,
        role=config.role.value,
    )
    return Executor(
        loop=loop,
        inbox=inbox,
        tracker=tracker,
        tokenizer=tokenizer,
        device=runner.device,
        vocab_size=runner.model.args.vocab_size,
        max_seq_len=max_seq_len,
        metrics=metrics,
        transceiver=transceiver,
        test_hooks=test_hooks,
    )


def _on_reports(transceiver: KvTransceiver | None, hooks: TestHooks | None) -> ReportSink:
    """What rank 0 keeps of every tick's reports besides the transfer outcomes."""
    count = functools.partial(count_follower_writes, transceiver)
    if hooks is None:
        return count
    return functools.partial(_to_both, count, hooks.take_reports)


def count_follower_writes(transceiver: KvTransceiver | None, reports: Sequence[RankReport]) -> None:
    """The followers' KV writes, in rank 0's transfer metrics (it counts its own as it writes)."""
    if transceiver is None:
        return
    for report in reports:
        for write in report.writes:
            transceiver.tally.count(
                write.num_bytes, write.num_descriptors, write.seconds, write.peer
            )


def _to_both(first: ReportSink, second: ReportSink, reports: Sequence[RankReport]) -> None:
    first(reports)
    second(reports)
