"""Coordinator services and the process entry point.

* `serve_coordinator(config)`: one front end (HTTP + `DisaggService` + `LocalPlacement`): it
  checks the servers' health and places requests itself, whether alone or in a fleet. Its
  servers are the configured url lists, or the workers registered in etcd (``cluster``), which
  every front end of a fleet watches for itself.
* `run_coordinator(config) -> int`: the sync entry point (`python -m trtdisagg coordinator`):
  one process for ``num_workers: 1``, else the fleet supervisor (`fleet.run_fleet`).

Start-up order inside a service: socket bound → HTTP serving (``/health`` answers 503) → servers
healthy (or etcd read) → ``task_status.started(address)`` and a "ready" log.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Final

import trio

from trtdisagg.api.listen import bind_socket, serve_http
from trtdisagg.coordinator.app import create_app
from trtdisagg.coordinator.config import CoordinatorConfig
from trtdisagg.coordinator.local import LocalPlacement
from trtdisagg.coordinator.metrics import CoordinatorMetrics
from trtdisagg.coordinator.service import DisaggService
from trtdisagg.coordinator.upstream import WorkerClient, make_http_client
from trtdisagg.errors import StartupError
from trtdisagg.ids import SnowflakeGenerator, derive_node_id
from trtdisagg.loop_lag import watch_loop_lag
from trtdisagg.stop_signals import serve_until_signal

log = logging.getLogger("trtdisagg.coordinator")

EXIT_STARTUP_FAILED: Final = 3

Address = tuple[str, int]


def _node_id(config: CoordinatorConfig) -> int:
    if config.node_id is not None:
        return config.node_id
    return derive_node_id(config.hostname, config.port)


async def serve_coordinator(
    config: CoordinatorConfig,
    *,
    process_id: int = 0,
    sock: socket.socket | None = None,
    task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one coordinator front end until cancelled.

    Args:
        config: validated coordinator config.
        process_id: this process's snowflake process id (a fleet gives each front end its own).
        sock: a bound, listening socket to serve on (fleet: SO_REUSEPORT); default: bind
            ``hostname:port``.

    Resource handling: one httpx client for all upstream calls, closed on exit; the socket is
    owned by hypercorn once serving.

    Raises:
        StartupError: the port cannot be bound, the servers never became healthy, or etcd
            did not answer within ``server_start_timeout``.
    """
    metrics = CoordinatorMetrics.create()
    ids = SnowflakeGenerator(node_id=_node_id(config), process_id=process_id)
    listener = sock or bind_socket(config.hostname, config.port, reuse_port=False)
    async with make_http_client(timeout=config.request_timeout) as http:
        client = WorkerClient(http=http, api_key=config.api_key)
        placement = LocalPlacement.create(config, client)
        service = DisaggService(
            config=config, placement=placement, client=client, ids=ids, metrics=metrics
        )
        app = create_app(
            service,
            metrics=metrics,
            api_key=config.api_key,
            max_body_bytes=config.max_request_body_bytes,
        )
        async with trio.open_nursery() as nursery:
            host, port = listener.getsockname()[:2]
            await nursery.start(serve_http, app, listener)
            nursery.start_soon(watch_loop_lag, metrics.event_loop_lag.observe)
            log.info("coordinator listening on http://%s:%d, waiting for servers", host, port)
            await nursery.start(placement.serve)
            info = placement.model_info()
            if info is not None:  # loaded now, not by the first request that needs it
                nursery.start_soon(service.prompts.tokenizer, info.model_path)
            log.info("coordinator ready on http://%s:%d", host, port)
            task_status.started((host, port))


def _first(exc: BaseException, cls: type[BaseException]) -> BaseException | None:
    if isinstance(exc, cls):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = _first(sub, cls)
            if found is not None:
                return found
    return None


def run_service(serve: Callable[[], Awaitable[None]]) -> int:
    """`trio.run` one service until SIGINT/SIGTERM (0) or a start-up failure (logged, 3)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per upstream call
    try:
        trio.run(serve_until_signal, serve, log)
    except BaseException as exc:
        startup = _first(exc, StartupError)
        if startup is not None:
            log.error("start-up failed: %s", startup)
            return EXIT_STARTUP_FAILED
        if _first(exc, KeyboardInterrupt) is not None:
            return 0
        raise
    return 0


def run_coordinator(config: CoordinatorConfig) -> int:
    """Run the coordinator (or the whole fleet) in this process until SIGINT/SIGTERM.

    Returns:
        0 after a signal; non-zero when start-up failed (the reason is logged).
    """
    if config.disagg_coordinator_url is not None:
        log.warning(
            "disagg_coordinator_url is ignored: every front end checks the servers and places "
            "requests itself (there is no coordinator state process); a fleet shares its "
            "servers through the same url lists or the same etcd (cluster)"
        )
    if config.num_workers > 1:
        from trtdisagg.coordinator.fleet import run_fleet

        return run_fleet(config)

    async def serve() -> None:
        await serve_coordinator(config)

    return run_service(serve)
