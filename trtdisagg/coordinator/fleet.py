"""Fleet mode (``num_workers > 1``): N front-end processes share the public port.

Each front end binds its own socket on the public port with ``SO_REUSEPORT`` and the kernel
spreads connections between them. Each is a whole coordinator: it checks the servers' health,
keeps its own routers (a router's decisions stay local: its load counts are its own requests,
its KV-aware view the events it reads), and learns the servers from the same place as the
others: the configured url lists, or the workers registered in etcd (``cluster``), which each
front end watches for itself. Front ends on other hosts join the same fleet by using the same
lists or the same etcd cluster. Nothing passes between the front ends themselves.

The supervisor (this process, no event loop) first binds a reservation socket without
listening: it claims the port (and resolves port 0) and receives no connections. Children are
started with ``spawn`` and front end ``i`` mints ids with process id ``i``. They count their
metrics in files of one directory the supervisor makes (prometheus_client's multiprocess mode),
so `/metrics`, whichever front end answers it, shows the whole fleet's counters.

Supervision: SIGINT/SIGTERM stop every child (terminate, then kill after a grace period). A
front end that exits ends the fleet with its exit code; a supervisor that dies (SIGKILL) takes
its front ends with it (`orphans.py`), so none is left serving the port with the old settings.
"""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import types
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Final

import attrs
import trio

from trtdisagg.api.listen import bind_socket
from trtdisagg.coordinator.config import CoordinatorConfig
from trtdisagg.coordinator.metrics import MULTIPROCESS_DIR_ENV
from trtdisagg.coordinator.serve import EXIT_STARTUP_FAILED, run_service, serve_coordinator
from trtdisagg.errors import StartupError
from trtdisagg.orphans import exit_with_parent

log = logging.getLogger("trtdisagg.coordinator.fleet")

STOP_GRACE: Final = 10.0
METRICS_DIR_PREFIX: Final = "trtdisagg-fleet-metrics-"
METRICS_LOCK: Final = ".held"  # flocked by the supervisor while its fleet runs


def _setup_child_logging(level: str, prefix: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {prefix} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def front_end_main(config: CoordinatorConfig, process_id: int, supervisor: int) -> None:
    """Entry point of front-end process `process_id` (spawned by process `supervisor`)."""
    _setup_child_logging(config.log_level, f"[coordinator-w{process_id}]")
    try:
        sock = bind_socket(config.hostname, config.port, reuse_port=True)
    except StartupError as exc:
        log.error("start-up failed: %s", exc)
        sys.exit(EXIT_STARTUP_FAILED)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(exit_with_parent, supervisor, log, f"front end w{process_id}")
            await serve_coordinator(config, process_id=process_id, sock=sock)
            nursery.cancel_scope.cancel()

    sys.exit(run_service(serve))


@attrs.define(eq=False, kw_only=True)
class _Stop(Exception):
    signum: int


def _raise_stop(signum: int, _frame: types.FrameType | None) -> None:
    raise _Stop(signum=signum)


def run_fleet(config: CoordinatorConfig) -> int:
    """Start and supervise the fleet until a signal (0) or a fatal child exit (non-zero)."""
    try:
        reservation = bind_socket(config.hostname, config.port, reuse_port=True, listen=False)
    except StartupError as exc:
        log.error("start-up failed: %s", exc)
        return EXIT_STARTUP_FAILED
    port = reservation.getsockname()[1]
    config = attrs.evolve(config, port=port)
    spawn = multiprocessing.get_context("spawn")
    fronts: list[BaseProcess] = []
    # Set before the children start: prometheus_client picks its value store when imported.
    metrics_dir, held = hold_metrics_dir(Path(tempfile.gettempdir()))
    previous_dir = os.environ.get(MULTIPROCESS_DIR_ENV)
    os.environ[MULTIPROCESS_DIR_ENV] = str(metrics_dir)
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i in range(config.num_workers):
            proc = spawn.Process(target=front_end_main, args=(config, i, os.getpid()), name=f"w{i}")
            proc.start()
            fronts.append(proc)
        log.info(
            "fleet of %d front ends on http://%s:%d (pids %s)",
            len(fronts), config.hostname, port, [p.pid for p in fronts],
        )  # fmt: skip
        return _supervise(fronts)
    except _Stop as stop:
        log.info("received %s, stopping the fleet", signal.Signals(stop.signum).name)
        return 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop_all(fronts)
        reservation.close()
        if previous_dir is None:
            os.environ.pop(MULTIPROCESS_DIR_ENV, None)
        else:
            os.environ[MULTIPROCESS_DIR_ENV] = previous_dir
        shutil.rmtree(metrics_dir, ignore_errors=True)
        os.close(held)


def hold_metrics_dir(parent: Path) -> tuple[Path, int]:
    """A new directory for the fleet's metric files, and the descriptor that holds its lock until
    the supervisor closes it or dies. The directories of fleets whose supervisor died without
    removing its own (SIGKILL), which nobody holds, are removed first: prometheus_client's files
    take megabytes each, and a host that restarts a killed fleet would collect them."""
    remove_orphaned_metrics_dirs(parent)
    path = Path(tempfile.mkdtemp(prefix=METRICS_DIR_PREFIX, dir=parent))
    held = os.open(path / (METRICS_LOCK + ".new"), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(path / (METRICS_LOCK + ".new"), path / METRICS_LOCK)  # held before it is seen
    return path, held


def remove_orphaned_metrics_dirs(parent: Path) -> list[Path]:
    """Remove the fleet metrics directories under `parent` whose lock nobody holds; the removed."""
    removed = []
    for path in parent.glob(METRICS_DIR_PREFIX + "*"):
        try:
            lock = os.open(path / METRICS_LOCK, os.O_RDWR)
        except OSError:
            continue  # still being made, or not ours to open
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock)
            continue  # its fleet runs
        shutil.rmtree(path, ignore_errors=True)
        os.close(lock)
        removed.append(path)
    return removed


def _supervise(fronts: list[BaseProcess]) -> int:
    watched: dict[int, BaseProcess] = {p.sentinel: p for p in fronts}
    while True:
        for sentinel in multiprocessing.connection.wait(list(watched)):
            assert isinstance(sentinel, int)
            proc = watched.pop(sentinel)
            proc.join()
            log.error("front end %s exited with %s; stopping the fleet", proc.name, proc.exitcode)
            return proc.exitcode or 1


def _stop_all(procs: list[BaseProcess]) -> None:
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.terminate()
    for proc in alive:
        proc.join(STOP_GRACE)
        if proc.is_alive():
            log.warning("%s did not stop within %gs; killing it", proc.name, STOP_GRACE)
            proc.kill()
            proc.join(STOP_GRACE)
