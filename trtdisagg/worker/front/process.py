"""A front process: the worker's whole HTTP API, with the engine in another process.

Spawned by the engine process (`supervisor.py`). It connects its DEALER to the engine's link
and says HELLO; once the engine answers, it opens the worker's port (and says SERVING), and
tokenizes, validates and renders exactly as a one-process worker does (`WorkerService`, the
same Quart app). It shares the port with the other fronts through `SO_REUSEPORT`. Its
requests' ids are `index`, `index + count`, ...: the engine takes no id twice.

The engine process alone decides when a front stops: a front ignores SIGINT and SIGTERM (a
terminal's Ctrl-C, or a SIGTERM to the process group during a drain, must not cut its streams).
When the worker stops, the engine sends STOP: the front ends its server as a one-process worker
does (hypercorn's graceful shutdown) and exits; one that does not is killed. A front whose
engine process is gone exits by itself.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
from pathlib import Path

import attrs
import trio
import zmq
from prometheus_client import CollectorRegistry

from trtdisagg.api.listen import bind_socket, serve_http
from trtdisagg.config import WorkerConfig
from trtdisagg.loop_lag import watch_loop_lag
from trtdisagg.metrics import event_loop_lag_histogram
from trtdisagg.orphans import exit_with_parent
from trtdisagg.worker.front.client import EngineFacts, RemoteEngine
from trtdisagg.worker.front.link import Link, open_socket
from trtdisagg.worker.http.app import create_app
from trtdisagg.worker.http.service import WorkerService
from trtdisagg.worker.tokenization import Tokenizer

log = logging.getLogger("trtdisagg.worker.front")

# The loop-lag histogram of a front: the engine's keeps today's name, so /metrics holds both.
FRONT_LOOP_LAG = "trtdisagg_api_server_event_loop_lag_seconds"


@attrs.frozen(kw_only=True)
class FrontSpec:
    """Everything a front needs, passed at spawn (pickled)."""

    index: int
    count: int
    config: WorkerConfig  # its `port` is the one the fronts share (port 0 resolved)
    engine_endpoint: str  # ipc:// in the engine's private directory
    facts: EngineFacts
    served_model_name: str
    model_dir: Path
    ctx_info_endpoint: str | None
    ctx_instance: str | None
    boot_id: str  # the engine's WorkerService's: one worker start, one id
    engine_pid: int  # the front exits once it is gone (orphans.py)
    cpus: frozenset[int] | None = None  # where it runs (`cpu_affinity.front_cpus`); None: anywhere


def front_main(spec: FrontSpec) -> None:
    """Process entry of front `spec.index`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if spec.cpus is not None:  # spawned on its engine's pinned CPUs: off them, before threads
        os.sched_setaffinity(0, spec.cpus)
    config = spec.config
    logging.basicConfig(
        level=getattr(logging, config.log_level.upper(), logging.INFO),
        format=f"%(asctime)s [{config.role.value}:{config.port}/api{spec.index}] %(levelname)s "
        "%(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        trio.run(serve_front, spec)
    except Exception:
        log.exception("front %d failed", spec.index)
        sys.exit(1)


async def serve_front(spec: FrontSpec) -> None:
    registry = CollectorRegistry()
    lag = event_loop_lag_histogram(registry, name=FRONT_LOOP_LAG)
    socket = open_socket(zmq.DEALER, identity=f"api{spec.index}".encode())
    socket.connect(spec.engine_endpoint)
    engine = RemoteEngine(facts=spec.facts, registry=registry, link=Link(socket=socket))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(exit_with_parent, spec.engine_pid, log, f"api server {spec.index}")
        nursery.start_soon(engine.link.run, engine.on_message)
        engine.hello(spec.index)
        with trio.fail_after(60):
            await engine.connected.wait()
        tokenizer = await trio.to_thread.run_sync(Tokenizer.from_dir, spec.model_dir)
        service = WorkerService(
            config=spec.config,
            served_model_name=spec.served_model_name,
            model_dir=spec.model_dir,
            tokenizer=tokenizer,
            engine=engine,
            max_seq_len=spec.facts.max_seq_len,
            ctx_info_endpoint=spec.ctx_info_endpoint,
            ctx_instance=spec.ctx_instance,
            boot_id=spec.boot_id,
            ready=True,
            ids=itertools.count(spec.index, spec.count),
        )
        nursery.start_soon(watch_loop_lag, lag.observe)
        sock = bind_socket(spec.config.host, spec.config.port, reuse_port=True)
        await nursery.start(serve_http, create_app(service), sock)
        engine.serving()
        log.info("api server %d serving on port %d", spec.index, spec.config.port)
        await engine.stopping.wait()
        log.info("api server %d stopping", spec.index)
        nursery.cancel_scope.cancel()  # hypercorn lets the responses under way end first
    engine.link.close()
