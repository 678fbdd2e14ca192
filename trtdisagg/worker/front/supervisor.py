"""The engine process's side of `api_server_count`: start the fronts, serve them, watch them.

`serve_fronts` makes a private directory (mode 0700, so only this user's processes can reach
the link), binds the engine's ROUTER in it, claims the worker's port with a reservation socket
that does not listen (as the coordinator's fleet does: it resolves port 0 and takes no
connection), and spawns `count` fronts on that port. It is started once every front serves, and
then watches them: a front that exits stops the worker (`FrontDied`), as a rank that dies
does. When the worker stops, its fronts are told to stop (and killed if they do not) and
reaped, and the directory is removed.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import attrs
import trio
import zmq

from trtdisagg.api.listen import bind_socket
from trtdisagg.config import WorkerConfig
from trtdisagg.cpu_affinity import front_cpus
from trtdisagg.errors import TrtDisaggError
from trtdisagg.worker.engine.executor import Executor
from trtdisagg.worker.front.client import EngineFacts
from trtdisagg.worker.front.link import Link, open_socket
from trtdisagg.worker.front.process import FrontSpec, front_main
from trtdisagg.worker.front.server import EngineServer
from trtdisagg.worker.http.engine import LocalEngine
from trtdisagg.worker.http.service import WorkerService

log = logging.getLogger("trtdisagg.worker")

FRONT_START_TIMEOUT_S = 120.0
STOP_GRACE_S = 5.0  # a front's graceful shutdown takes hypercorn's graceful_timeout (1 s)
_REAP_S = 5.0


class FrontDied(TrtDisaggError):
    """A front process exited; the worker stops with it."""


@attrs.define(eq=False, kw_only=True)
class Fronts:
    processes: list[multiprocessing.process.BaseProcess]

    async def watch(self) -> None:
        """Return never; raise FrontDied as soon as any front exits."""
        by_sentinel = {p.sentinel: (i, p) for i, p in enumerate(self.processes)}
        ready: list[Any] = await trio.to_thread.run_sync(
            multiprocessing.connection.wait, list(by_sentinel), abandon_on_cancel=True
        )
        index, process = by_sentinel[ready[0]]
        process.join(_REAP_S)
        message = (
            f"api server {index} (pid {process.pid}) exited with code {process.exitcode}; "
            "stopping the worker"
        )
        log.error(message)
        raise FrontDied(message)

    def stop(self) -> None:
        """Reap every front, told to stop before; kill those that do not within the grace
        (they ignore SIGTERM: `process.py`)."""
        for process in self.processes:
            process.join(STOP_GRACE_S)
            if process.is_alive():
                log.warning("api server %s did not stop; killing it", process.name)
                process.kill()
                process.join(_REAP_S)


async def serve_fronts(
    config: WorkerConfig,
    executor: Executor,
    service: WorkerService,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run `config.api_server_count` fronts until cancelled; started with their URL once all
    of them are connected.

    Raises:
        FrontDied: a front exited.
        StartupError: the port cannot be claimed.
    """
    count = config.api_server_count
    private = Path(tempfile.mkdtemp(prefix="trtdisagg-api-"))  # mode 0700
    reservation = bind_socket(config.host, config.port, reuse_port=True, listen=False)
    fronts: Fronts | None = None
    server: EngineServer | None = None
    try:
        port = int(reservation.getsockname()[1])
        endpoint = f"ipc://{private / 'engine'}"
        router = open_socket(zmq.ROUTER)
        router.bind(endpoint)
        server = EngineServer(
            executor=executor,
            num_fronts=count,
            tokenizer_json=service.tokenizer.to_json(),
            link=Link(socket=router),
        )
        facts = engine_facts(executor)
        specs = [
            FrontSpec(
                index=i,
                count=count,
                config=attrs.evolve(config, port=port),
                engine_endpoint=endpoint,
                facts=facts,
                served_model_name=service.served_model_name,
                model_dir=service.model_dir,
                ctx_info_endpoint=service.ctx_info_endpoint,
                ctx_instance=service.ctx_instance,
                boot_id=service.boot_id,
                engine_pid=os.getpid(),
                cpus=front_cpus(config.cpu_affinity) if config.cpu_affinity else None,
            )
            for i in range(count)
        ]
        context = multiprocessing.get_context("spawn")
        fronts = Fronts(processes=[])
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            for spec in specs:
                process = context.Process(
                    target=front_main, args=(spec,), name=f"trtdisagg-api{spec.index}", daemon=True
                )
                process.start()
                fronts.processes.append(process)
            nursery.start_soon(fronts.watch)
            with trio.fail_after(FRONT_START_TIMEOUT_S):
                await server.all_serving.wait()
            host = f"[{config.host}]" if ":" in config.host else config.host
            task_status.started([f"http://{host}:{port}"])
    finally:
        if server is not None:
            server.stop_fronts()
        if fronts is not None:  # reaping waits up to seconds: off the loop, even when cancelled
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(fronts.stop)
        if server is not None:
            server.link.close()
        reservation.close()
        shutil.rmtree(private, ignore_errors=True)


def engine_facts(executor: Executor) -> EngineFacts:
    pool = executor.scheduler.pool
    local = LocalEngine(executor=executor)
    return EngineFacts(
        vocab_size=executor.vocab_size,
        max_seq_len=executor.max_seq_len,
        kv_capacity_tokens=pool.num_blocks * pool.tokens_per_block,
        kv_compat=local.kv_compat,
        has_test_hooks=local.has_test_hooks,
    )
