"""`python -m trtdisagg up [local.yaml]`: a whole local cluster as child processes.

Starts every ctx and gen worker and the coordinator (``sys.executable -m trtdisagg ctx|gen|
coordinator --config <generated file>``), writes each one's output to ``<log_dir>/<name>.log``
and to the terminal with a ``[name]`` prefix, waits until every ``/health`` answers 200, prints
the URL and a curl line, and runs until Ctrl-C / SIGTERM (exit 0) or until any child exits
(exit 1). Stopping terminates every child, then kills those still alive after ``stop_grace``.

The cluster file (format documented in ``conf/local.yaml``)::

    log_dir: logs
    host: 127.0.0.1
    health_timeout: 300
    stop_grace: 10
    ctx:                       # list of worker configs: a path, or a mapping of worker keys
      - config: ctx.yaml       #   (DESIGN.md §4) with an optional base file under `config:`
        port: 8001
    gen:
      - gen.yaml
    coordinator:               # disagg.yaml keys (or `config:` a file); server urls are filled
      port: 8000               # in from ctx/gen unless given
    etcd: null                 # "embedded", or an etcd URL: membership instead of url lists
    cluster_name: local        # the name the workers register under (with etcd)

With ``etcd`` set, every worker gets ``cluster: {etcd: URL, name: cluster_name}`` and registers
itself, and the coordinator gets the same ``cluster`` instead of server urls: it serves whoever
registered. ``etcd: embedded`` starts a single-member etcd first, as one more child (``etcd``;
``etcd`` must be on PATH), with its data under ``<log_dir>/etcd-data`` (wiped at each start).

The control plane runs secured (trtdisagg/security/): unless ``TRTDISAGG_CLUSTER_SECRET`` is set
here or a worker's config sets ``cache_transceiver_config.cluster_secret``, ``up`` generates a
secret for the run and gives it to every child in that variable (never to a file or the log).

Every child gets this process's environment. To put workers on different GPUs, give each its
``cuda_device`` key (a GPU index as this process numbers them); ``ctx`` may be an empty list when
the coordinator has ``conditional_disagg_config`` (aggregated workers listed under ``gen``).

Top-level keys starting with ``x-`` are ignored (a place for YAML anchors that several workers
merge with ``<<: *name``). Paths inside the file are relative to the file's directory. Every
generated config is written to ``log_dir`` (ctx-0.yaml, ..., coordinator.yaml) and validated
before anything starts, so a bad key fails at once with its path (``local.yaml: $.ctx[0]: ...``).
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import attrs
import httpx
import trio
import yaml

from trtdisagg.config import ConfigError, WorkerConfig, read_yaml, structure
from trtdisagg.coordinator.config import coordinator_config_from_dict
from trtdisagg.free_ports import free_port, is_free
from trtdisagg.membership.embedded import EtcdNotInstalled, etcd_args, etcd_binary
from trtdisagg.membership.records import check_cluster_name, check_etcd_url
from trtdisagg.security.secret import ENV_VAR

log = logging.getLogger("trtdisagg.launcher")

Json = dict[str, Any]

DEFAULT_CLUSTER: Final[Json] = {
    "log_dir": "logs",
    "host": "127.0.0.1",
    "ctx": [
        {
            "model": "tiny",
            "cache_transceiver_config": {"backend": "NIXL", "nixl_progress_thread": False},
        }
    ],
    "gen": [
        {
            "model": "tiny",
            "cache_transceiver_config": {"backend": "NIXL", "nixl_progress_thread": False},
        }
    ],
    "coordinator": {"port": 8000},
}
HEALTH_POLL: Final = 0.2
_TOP_KEYS: Final = {
    "log_dir", "host", "health_timeout", "stop_grace", "ctx", "gen", "coordinator", "etcd",
    "cluster_name",
}  # fmt: skip


class ChildExited(Exception):
    def __init__(self, name: str, code: int) -> None:
        super().__init__(f"{name} exited with code {code}")
        self.name = name
        self.code = code


@attrs.frozen(kw_only=True)
class Child:
    name: str
    args: tuple[str, ...]
    url: str
    log_path: Path


@attrs.frozen(kw_only=True)
class ClusterPlan:
    children: tuple[Child, ...]
    coordinator_url: str
    health_timeout: float
    stop_grace: float
    log_dir: Path
    etcd_data: Path | None = None
    """The embedded etcd's data directory (emptied before it starts)."""
    secret_configured: bool = False
    """A worker's config sets its cluster secret: none is generated for the run."""


def _next_free_port(host: str, after: int, used: set[int], where: str, source: str) -> int:
    """The first port after `after` that no other process of the cluster is given and that no
    process on this host holds now."""
    for port in range(after + 1, 65536):
        if port not in used and is_free(host, port):
            return port
    raise ConfigError(f"{source}: {where}.port: no free port after {after} on {host}")


def _membership(data: Json, *, host: str, log_dir: Path, source: str) -> tuple[Json, Child | None]:
    """The `cluster:` every process gets, and the embedded etcd child (if one is asked for)."""
    etcd = data["etcd"]
    name = str(data.get("cluster_name", "local"))
    if why := check_cluster_name(name):
        raise ConfigError(f"{source}: $.cluster_name: {why}")
    if etcd != "embedded":
        if not isinstance(etcd, str) or (why := check_etcd_url(etcd)):
            raise ConfigError(f"{source}: $.etcd: 'embedded' or an etcd URL; {why or etcd!r}")
        return {"etcd": etcd, "name": name}, None
    try:
        binary = etcd_binary()
    except EtcdNotInstalled as exc:
        raise ConfigError(f"{source}: $.etcd: embedded: {exc}") from None
    client_port, peer_port = free_port(host), free_port(host)
    args = etcd_args(
        binary, data_dir=log_dir / "etcd-data", client_port=client_port, peer_port=peer_port,
        host=host,
    )  # fmt: skip
    url = f"http://{host}:{client_port}"
    child = Child(name="etcd", args=tuple(args), url=url, log_path=log_dir / "etcd.log")
    return {"etcd": url, "name": name}, child


def _merge(base: Json, over: Json) -> Json:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _entry(item: object, *, where: str, source: str, root: Path) -> Json:
    """One worker or coordinator entry: a path, or a mapping with an optional `config` file."""
    if isinstance(item, str):
        item = {"config": item}
    if not isinstance(item, dict):
        raise ConfigError(f"{source}: {where}: expected a path or a mapping")
    inline = dict(item)
    path = inline.pop("config", None)
    if path is None:
        return inline
    if not isinstance(path, str):
        raise ConfigError(f"{source}: {where}.config: expected a path")
    base = read_yaml(root / path) or {}
    if not isinstance(base, dict):
        raise ConfigError(f"{root / path}: $ must be a mapping")
    return _merge(base, inline)


def plan_cluster(data: object, *, source: str, root: Path) -> tuple[ClusterPlan, dict[Path, Json]]:
    """Validate a cluster spec; return the plan and the config files to write (path → data).

    Raises:
        ConfigError: naming the key path of the first problem found.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: $ must be a mapping")
    # "x-" keys are the file's own (YAML anchors shared by workers), as in compose files.
    unknown = sorted(k for k in set(data) - _TOP_KEYS if not str(k).startswith("x-"))
    if unknown:
        raise ConfigError(f"{source}: $.{unknown[0]}: unknown key (allowed: {sorted(_TOP_KEYS)})")
    host = str(data.get("host", "127.0.0.1"))
    log_dir = Path(str(data.get("log_dir", "logs")))
    coord = _entry(data.get("coordinator", {}), where="$.coordinator", source=source, root=root)
    coord_port = int(coord.setdefault("port", 8000))
    coord.setdefault("hostname", host)
    files: dict[Path, Json] = {}
    children: list[Child] = []
    membership: Json | None = None
    if data.get("etcd") is not None:
        membership, etcd_child = _membership(data, host=host, log_dir=log_dir, source=source)
        children += [etcd_child] if etcd_child is not None else []
    used = {coord_port}
    urls: dict[str, list[str]] = {"ctx": [], "gen": []}
    for role in ("ctx", "gen"):
        items = data.get(role, [])
        # Aggregated mode: no ctx workers, every request is served by one gen worker alone.
        aggregated = role == "ctx" and coord.get("conditional_disagg_config") is not None
        if not isinstance(items, list) or not (items or aggregated):
            hint = " (or empty with coordinator.conditional_disagg_config)" if role == "ctx" else ""
            raise ConfigError(
                f"{source}: $.{role}: expected a non-empty list of worker configs{hint}"
            )
        for i, item in enumerate(items):
            where = f"$.{role}[{i}]"
            worker = _entry(item, where=where, source=source, root=root)
            worker.setdefault("host", host)
            if data.get("ctx"):  # split serving: a worker without a KV transceiver cannot take part
                transceiver = dict(worker.get("cache_transceiver_config") or {})
                transceiver.setdefault("backend", "NIXL")
                worker["cache_transceiver_config"] = transceiver
            if "port" not in worker:
                worker["port"] = _next_free_port(
                    str(worker["host"]), coord_port, used, where, source
                )
            worker["role"] = role
            if membership is not None:
                worker.setdefault("cluster", membership)
            structure(worker, WorkerConfig, source=f"{source}: {where}")
            if worker["port"] in used:
                raise ConfigError(f"{source}: {where}.port: {worker['port']} is already taken")
            used.add(worker["port"])
            name = f"{role}-{i}"
            path = log_dir / f"{name}.yaml"
            files[path] = {k: v for k, v in worker.items() if k != "role"}
            url = f"http://{worker['host']}:{worker['port']}"
            urls[role].append(f"{worker['host']}:{worker['port']}")
            args = (sys.executable, "-m", "trtdisagg", role, "--config", str(path))
            children.append(Child(name=name, args=args, url=url, log_path=log_dir / f"{name}.log"))
    if membership is not None:
        coord.setdefault("cluster", membership)  # the servers are whoever registers
    for key, role in (("context_servers", "ctx"), ("generation_servers", "gen")):
        group = dict(coord.get(key) or {})
        if membership is None:
            group.setdefault("urls", urls[role])
        coord[key] = group
    config = coordinator_config_from_dict(coord, source=f"{source}: $.coordinator")
    coord_path = log_dir / "coordinator.yaml"
    files[coord_path] = coord
    coordinator_url = f"http://{config.hostname}:{config.port}"
    args = (sys.executable, "-m", "trtdisagg", "coordinator", "--config", str(coord_path))
    children.append(
        Child(
            name="coordinator", args=args, url=coordinator_url, log_path=log_dir / "coordinator.log"
        )
    )
    plan = ClusterPlan(
        children=tuple(children),
        coordinator_url=coordinator_url,
        health_timeout=float(data.get("health_timeout", 300)),
        stop_grace=float(data.get("stop_grace", 10)),
        log_dir=log_dir,
        etcd_data=log_dir / "etcd-data" if data.get("etcd") == "embedded" else None,
        secret_configured=any(
            (content.get("cache_transceiver_config") or {}).get("cluster_secret") is not None
            for content in files.values()
        ),
    )
    return plan, files


def children_environment(plan: ClusterPlan, environ: dict[str, str]) -> dict[str, str]:
    """The environment every child runs with: this one, plus a cluster secret generated for
    the run unless one is set already (here, or in a worker's config)."""
    env = {**environ, "PYTHONUNBUFFERED": "1"}
    if not env.get(ENV_VAR) and not plan.secret_configured:
        env[ENV_VAR] = secrets.token_urlsafe(32)
        log.info("control plane secured with a cluster secret generated for this run")
    return env


async def _pump(proc: trio.Process, child: Child) -> None:
    """Copy a child's output to its log file and to the terminal, line by line, prefixed."""
    assert proc.stdout is not None
    prefix = f"[{child.name}] ".encode()
    pending = b""
    with open(child.log_path, "ab") as log_file:  # noqa: ASYNC230  # local file, line-sized writes
        async for chunk in proc.stdout:
            log_file.write(chunk)
            log_file.flush()
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                sys.stdout.buffer.write(prefix + line + b"\n")
            sys.stdout.buffer.flush()
        if pending:
            sys.stdout.buffer.write(prefix + pending + b"\n")
            sys.stdout.buffer.flush()


async def _watch(proc: trio.Process, child: Child) -> None:
    code = await proc.wait()
    raise ChildExited(child.name, code)


async def _wait_healthy(plan: ClusterPlan) -> None:
    pending = {c.name: c.url for c in plan.children}
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        with trio.move_on_after(plan.health_timeout):
            last_report = trio.current_time()
            while pending:
                for name, url in list(pending.items()):
                    try:
                        if (await client.get(url + "/health")).status_code == 200:
                            log.info("%s is healthy at %s", name, url)
                            del pending[name]
                    except httpx.HTTPError:
                        pass
                if trio.current_time() - last_report > 15:
                    log.info("still waiting for %s", sorted(pending))
                    last_report = trio.current_time()
                await trio.sleep(HEALTH_POLL)
            return
    raise TimeoutError(f"not healthy after {plan.health_timeout:g}s: {sorted(pending)}")


async def _model_name(url: str) -> str:
    try:
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            data = (await client.get(url + "/v1/models")).json()
            return str(data["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return "tiny"


def _announce(plan: ClusterPlan, model: str) -> None:
    body = f'{{"model": "{model}", "prompt": "The quick brown fox", "max_tokens": 16}}'
    curl = (
        f"curl {plan.coordinator_url}/v1/completions -H 'Content-Type: application/json' "
        f"-d {shlex.quote(body)}"
    )
    print(
        f"\ntrtdisagg cluster ready: {plan.coordinator_url}  (logs in {plan.log_dir}/)\n{curl}\n",
        flush=True,
    )


async def _stop(
    procs: list[tuple[trio.Process, Child]],
    grace: float,
    signals: AsyncIterator[int],
) -> None:
    """Terminate every child, wait up to `grace`, then kill what is left. An embedded etcd goes
    last, once the others are gone: draining workers leave it first.

    A second SIGINT/SIGTERM while waiting (Ctrl-C pressed again, a supervisor's repeat) cuts
    the wait short: the children are killed at once rather than orphaned by our own death.
    """
    waves = [[p for p in procs if p[1].name != "etcd"], [p for p in procs if p[1].name == "etcd"]]
    with trio.CancelScope(shield=True):
        async with trio.open_nursery() as nursery:

            async def hurry() -> None:
                async for signum in signals:
                    log.warning(
                        "received %s again: killing the cluster now", signal.Signals(signum).name
                    )
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(hurry)
            with trio.move_on_after(grace):
                for wave in waves:
                    for proc, _ in reversed(wave):
                        if proc.returncode is None:
                            proc.send_signal(signal.SIGTERM)
                    for proc, _ in wave:
                        await proc.wait()
            nursery.cancel_scope.cancel()
        for proc, child in procs:
            if proc.returncode is None:
                log.warning("%s did not stop in time; killing it", child.name)
                proc.kill()
                await proc.wait()


async def _until_signal(
    signals: AsyncIterator[int],
    cancel_scope: trio.CancelScope,
) -> None:
    async for signum in signals:
        log.info("received %s, stopping the cluster", signal.Signals(signum).name)
        cancel_scope.cancel()
        return


def _first(exc: BaseException, cls: type[BaseException]) -> BaseException | None:
    if isinstance(exc, cls):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = _first(sub, cls)
            if found is not None:
                return found
    return None


async def run_cluster(plan: ClusterPlan) -> int:
    """Run the cluster until a signal (0), a child exit or a start-up timeout (1).

    Children run in their own sessions, so a Ctrl-C reaches only this process, which then
    stops them in reverse start order (coordinator first).
    """
    procs: list[tuple[trio.Process, Child]] = []
    env = children_environment(plan, dict(os.environ))
    # One receiver for the whole run, stop included: with none installed, a second signal
    # during the stop would kill this process and leave its children running.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_until_signal, signals, nursery.cancel_scope)
                for child in plan.children:
                    proc = await trio.lowlevel.open_process(
                        list(child.args),
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
                    procs.append((proc, child))
                    nursery.start_soon(_pump, proc, child)
                    nursery.start_soon(_watch, proc, child)
                    log.info(
                        "started %s (pid %d): %s", child.name, proc.pid, shlex.join(child.args)
                    )
                await _wait_healthy(plan)
                _announce(plan, await _model_name(plan.coordinator_url))
                await trio.sleep_forever()
        except BaseException as exc:
            failure = _first(exc, ChildExited) or _first(exc, TimeoutError)
            if failure is None:
                raise
            log.error("%s; stopping the cluster (see the logs in %s/)", failure, plan.log_dir)
            return 1
        finally:
            await _stop(procs, plan.stop_grace, signals)
    return 0


def run_local_cluster(path: str | None) -> int:
    """Entry point of ``python -m trtdisagg up [path]``.

    Raises:
        ConfigError: the cluster file or one of the configs it names is invalid.
    """
    if path is None:
        data: object = DEFAULT_CLUSTER
        source, root = "default cluster", Path.cwd()
    else:
        data = read_yaml(path)
        source, root = str(path), Path(path).resolve().parent
    plan, files = plan_cluster(data, source=source, root=root)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    if plan.etcd_data is not None:  # a fresh etcd: an old one's members and peers mean nothing
        shutil.rmtree(plan.etcd_data, ignore_errors=True)
    for file, content in files.items():
        file.write_text(yaml.safe_dump(content, sort_keys=False))
    for child in plan.children:
        child.log_path.write_bytes(b"")
    try:
        return trio.run(run_cluster, plan)
    except KeyboardInterrupt:
        return 0
