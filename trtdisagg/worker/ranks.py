"""The ranks of a multi-rank instance: rank 0 (the worker process) starts and watches the rest.

Ranks 1..N-1 are spawned (`spawn`: torch and UCX are not fork-safe) and run `follow`: the same
model shard, KV pool, transfer agent and control endpoint as rank 0 has for its own shard, but
no HTTP and no scheduler. Each step they apply what rank 0 broadcast (`rank_plan.StepCommand`)
and report their finished transfers back.

A rank that dies takes the instance down: rank 0 watches every follower's process sentinel and
stops with a log line naming the rank; a follower exits when rank 0's links close.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import trio

from trtdisagg.config import WorkerConfig
from trtdisagg.cpu_affinity import pin_process, rank_share
from trtdisagg.errors import TrtDisaggError
from trtdisagg.membership.records import advertised_endpoint
from trtdisagg.orphans import exit_with_parent
from trtdisagg.startup_gc import run_after_imports
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.wire import PROTOCOL_VERSION, InstanceInfo, decode, encode
from trtdisagg.worker.engine.ports import Transceiver
from trtdisagg.worker.engine.test_hooks import DigestBuffer, DigestingTransceiver
from trtdisagg.worker.rank_group import RankGroup
from trtdisagg.worker.rank_plan import RankOutcome, RankReport, Side, StepCommand, WriteRecord
from trtdisagg.worker.runner import ModelRunner, build_runner

log = logging.getLogger("trtdisagg.worker")


class RankDied(TrtDisaggError):
    """A rank of this instance exited; the instance cannot serve without it."""


@attrs.define(eq=False, kw_only=True)
class Followers:
    processes: list[multiprocessing.process.BaseProcess]

    async def watch(self) -> None:
        """Return never; raise RankDied as soon as any follower exits."""
        by_sentinel = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes, start=1)}
        ready: list[Any] = await trio.to_thread.run_sync(
            multiprocessing.connection.wait, list(by_sentinel), abandon_on_cancel=True
        )
        rank, process = by_sentinel[ready[0]]
        process.join(5)  # the sentinel fires as it exits; reap it for the exit code
        message = (
            f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}; "
            "stopping the instance"
        )
        log.error(message)
        raise RankDied(message)

    def stop(self, timeout: float = 5.0) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join(timeout)


def start_followers(
    config: WorkerConfig, model_dir: Path, *, port: int, instance_name: str
) -> Followers:
    context = multiprocessing.get_context("spawn")
    processes: list[multiprocessing.process.BaseProcess] = []
    rank0, entry = os.getpid(), (__name__, run_follower.__name__)
    for rank in range(1, config.world_size):
        process = context.Process(
            target=run_after_imports,
            args=(*entry, config, model_dir, rank, port, instance_name, rank0),
            name=f"trtdisagg-rank{rank}",
            daemon=True,
        )
        process.start()
        processes.append(process)
    return Followers(processes=processes)


def share_infos_with(group: RankGroup) -> Callable[[RankInfo], Awaitable[tuple[RankInfo, ...]]]:
    """Swap RankInfos with every rank (the wire codec serialises them, as peers see them)."""

    async def share(info: RankInfo) -> tuple[RankInfo, ...]:
        mine = encode(InstanceInfo(protocol_version=PROTOCOL_VERSION, ranks=(info,)))
        gathered = await trio.to_thread.run_sync(group.all_gather_bytes, mine)
        infos: list[RankInfo] = []
        for data in gathered:
            message = decode(data)
            assert isinstance(message, InstanceInfo)
            infos.extend(message.ranks)
        return tuple(infos)

    return share


def rank_outcomes(transceiver: Transceiver | None) -> tuple[RankOutcome, ...]:
    """This rank's transfers that reached a final state since the last call."""
    if transceiver is None:
        return ()
    return tuple(
        [RankOutcome(side=Side.RECEIVE, outcome=o) for o in transceiver.check_gen_transfer_status()]
        + [
            RankOutcome(side=Side.SEND, outcome=o)
            for o in transceiver.check_context_transfer_status()
        ]
    )


def run_follower(
    config: WorkerConfig, model_dir: Path, rank: int, port: int, instance_name: str, rank0: int
) -> None:
    """Process entry of rank `rank` (>= 1), spawned by rank 0's process (pid `rank0`)."""
    # Ctrl-C in a terminal reaches the whole process group; rank 0 alone decides when its ranks
    # stop (it terminates them), so a follower never dies first with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=getattr(logging, config.log_level.upper(), logging.INFO),
        format=f"%(asctime)s [{config.role.value}:{config.port}/rank{rank}] %(levelname)s "
        "%(name)s: %(message)s",
        stream=sys.stderr,
    )
    if config.cpu_affinity is not None:  # (rank 0 checked that every CPU listed is usable)
        share = rank_share(config.cpu_affinity, rank, config.world_size)
        pin_process(share, threads=config.cpu_threads)
    try:
        trio.run(_follow, config, model_dir, rank, port, instance_name, rank0)
    except Exception:
        log.exception("rank %d failed", rank)
        sys.exit(1)


async def _follow(
    config: WorkerConfig, model_dir: Path, rank: int, port: int, instance_name: str, rank0: int
) -> None:
    from trtdisagg.worker.transfer_setup import build_transceiver, control_secret, hold_router

    group = await trio.to_thread.run_sync(
        lambda: RankGroup.join(
            rank=rank,
            tp_size=config.tensor_parallel_size,
            pp_size=config.pipeline_parallel_size,
            port=port,
            device=torch.device(config.device),
            device_index=config.cuda_device + rank if config.device == "cuda" else 0,
        )
    )
    runner = await trio.to_thread.run_sync(
        lambda: build_runner(config, model_dir, group.parallel, agree_blocks=group.agree_min)
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(exit_with_parent, rank0, log, f"rank {rank}")
        transceiver: Transceiver | None = None
        writes: list[WriteRecord] = []
        digests: DigestBuffer | None = None
        if config.cache_transceiver_config.backend is not None:
            router = await nursery.start(hold_router, config.host, None, control_secret(config))
            router.endpoint = advertised_endpoint(router.endpoint, config.advertise_host)
            built = await build_transceiver(
                config,
                runner,
                model_dir,
                router,
                lambda: None,  # nothing to wake: this rank moves only when rank 0 ticks
                None,
                instance_name=instance_name,
                share_infos=share_infos_with(group),
                on_write=lambda num_bytes, descriptors, seconds, peer: writes.append(
                    WriteRecord(
                        num_bytes=num_bytes, num_descriptors=descriptors, seconds=seconds, peer=peer
                    )
                ),
                early_failures=False,  # see KvTransceiver.early_failures
            )
            await nursery.start(built.run)
            transceiver = built
            if config.enable_test_hooks:  # digests of the KV this rank moves, for rank 0
                digests = DigestBuffer()
                transceiver = DigestingTransceiver(
                    inner=built,
                    cache=runner.cache,
                    layer_ids=runner.model.local_layer_ids,
                    head_ids=runner.model.local_kv_head_ids,
                    record=digests.add,
                )
        log.info("rank %d ready (%s)", rank, group.parallel)
        while True:
            command = await trio.to_thread.run_sync(
                group.broadcast_command, None, abandon_on_cancel=True
            )
            if command.stop:
                break
            _apply(command, transceiver, runner)
            if command.has_forward:
                await trio.to_thread.run_sync(
                    _forward, runner, command, group, abandon_on_cancel=True
                )
            outcomes = rank_outcomes(transceiver)  # digests what landed, with test hooks
            report = RankReport(
                rank=rank,
                outcomes=outcomes,
                digests=digests.take() if digests is not None else (),
                writes=tuple(writes),
            )
            writes.clear()
            await trio.to_thread.run_sync(group.gather_reports, report, abandon_on_cancel=True)
        nursery.cancel_scope.cancel()


def _forward(runner: ModelRunner, command: StepCommand, group: RankGroup) -> None:
    """A follower's share of one step: the forks' block copies, then the forward."""
    runner.copy_blocks(command.copies)
    runner.forward_items(command.items, group)


def _apply(command: StepCommand, transceiver: Transceiver | None, runner: ModelRunner) -> None:
    """The transfer work of one command, in rank 0's order: sends, receives, cancels."""
    if transceiver is None:
        return
    if command.sends:
        runner.kv_ready()  # the KV the last steps wrote is in memory before NIXL reads it
    for send in command.sends:
        transceiver.respond_and_send_async(
            send.key, [list(send.block_ids)], send.num_tokens, send.first_tokens
        )
    for receive in command.receives:
        transceiver.request_and_receive_async(
            receive.key,
            receive.endpoint,
            [list(receive.block_ids)],
            receive.num_tokens,
            ctx_instance=receive.ctx_instance,
        )
    for key in command.cancels:
        transceiver.cancel_request(key)
