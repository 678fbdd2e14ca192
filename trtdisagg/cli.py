"""Command line: argv → config objects → trio.run(serve_*). The only reader of argv and env.

python -m trtdisagg ctx  --config conf/ctx.yaml [--port N] [--model M] ...
python -m trtdisagg gen  --config conf/gen.yaml [--port N] [--model M] ...
python -m trtdisagg coordinator --config conf/disagg.yaml [--port N]
python -m trtdisagg up [conf/local.yaml]
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Sequence

import trio

from trtdisagg.config import ConfigError, Role, load_worker_config
from trtdisagg.cpu_affinity import CpuAffinityError, pin_engine
from trtdisagg.open_files import raise_open_file_limit
from trtdisagg.security.policy import (
    SECURED_LOG,
    UNSECURED_LOOPBACK_LOG,
    ControlPlaneMode,
    control_plane_mode,
)
from trtdisagg.security.secret import cluster_secret_of
from trtdisagg.startup_gc import resume_gc
from trtdisagg.stop_signals import serve_until_signal

log = logging.getLogger("trtdisagg")  # its stop lines: "received SIGTERM, stopping"


def _setup_logging(level: str, prefix: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {prefix} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per call (etcd, peers)


def _worker_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], role: Role) -> None:
    p = sub.add_parser(role.value, help=f"run a {role.value} worker instance")
    p.add_argument("--config", help="worker YAML (conf/ctx.yaml, conf/gen.yaml)")
    p.add_argument("--host")
    p.add_argument(
        "--advertise-host", dest="advertise_host", help="the address peers reach this worker at"
    )
    p.add_argument("--port", type=int)
    p.add_argument(
        "--model", help='"tiny", "synthetic:NAME[@SEED]" or a local Hugging Face checkpoint dir'
    )
    p.add_argument("--served-model-name", dest="served_model_name")
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--cuda-device", dest="cuda_device", type=int, help="GPU index (CUDA only)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tp", dest="tensor_parallel_size", type=int)
    p.add_argument("--pp", dest="pipeline_parallel_size", type=int)
    p.add_argument("--max-batch-size", dest="max_batch_size", type=int)
    p.add_argument("--max-num-tokens", dest="max_num_tokens", type=int)
    p.add_argument("--prefill-chunk-tokens", dest="prefill_chunk_tokens", type=int)
    p.add_argument("--cpu-threads", dest="cpu_threads", type=int)
    p.add_argument(
        "--cpu-affinity", dest="cpu_affinity", help='CPUs the engine runs on, e.g. "2" or "0-3,8"'
    )
    p.add_argument("--log-level", dest="log_level")
    p.set_defaults(role=role)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trtdisagg", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _worker_parser(sub, Role.CTX)
    _worker_parser(sub, Role.GEN)
    coord = sub.add_parser("coordinator", help="run the OpenAI front end")
    coord.add_argument("--config", required=True, help="coordinator YAML (conf/disagg.yaml)")
    coord.add_argument("--host", dest="hostname")
    coord.add_argument("--port", type=int)
    coord.add_argument("--log-level", dest="log_level", default="info")
    up = sub.add_parser("up", help="start a local cluster (ctx, gen, coordinator)")
    up.add_argument("config", nargs="?", help="cluster YAML (default: 1 ctx + 1 gen on tiny)")
    up.add_argument("--log-level", dest="log_level", default="info")
    return parser


_WORKER_KEYS = (
    "host", "advertise_host", "port", "model", "served_model_name", "device", "cuda_device",
    "dtype", "tensor_parallel_size",
    "pipeline_parallel_size", "max_batch_size", "max_num_tokens", "prefill_chunk_tokens",
    "cpu_threads", "cpu_affinity", "log_level",
)  # fmt: skip


def _run_worker(args: argparse.Namespace) -> int:
    overrides: dict[str, object] = {k: getattr(args, k) for k in _WORKER_KEYS}
    overrides["role"] = args.role.value
    if "TRTDISAGG_API_KEY" in os.environ:
        overrides["api_key"] = os.environ["TRTDISAGG_API_KEY"]
    if os.environ.get("TRTDISAGG_TEST_HOOKS") == "1":
        overrides["enable_test_hooks"] = True
    if os.environ.get("TRTDISAGG_FAULTS"):  # empty counts as unset
        overrides["fault_injection"] = os.environ["TRTDISAGG_FAULTS"]
    config = load_worker_config(
        args.config, overrides, cluster_secret=os.environ.get("TRTDISAGG_CLUSTER_SECRET")
    )
    transfer = config.cache_transceiver_config
    mode = None
    if transfer.backend is not None:  # a control plane: with a secret, or on loopback only
        mode = control_plane_mode(config.host, cluster_secret_of(transfer.cluster_secret))
    _setup_logging(config.log_level, f"[{config.role.value}:{config.port}]")
    if mode is ControlPlaneMode.UNSECURED_LOOPBACK:
        logging.getLogger("trtdisagg.worker").warning(UNSECURED_LOOPBACK_LOG, config.host)
    elif mode is ControlPlaneMode.CURVE:
        logging.getLogger("trtdisagg.worker").info(SECURED_LOG)
    if config.cpu_affinity is not None:  # before any thread starts: they inherit it
        try:
            pin_engine(config.cpu_affinity, config.world_size, threads=config.cpu_threads)
        except CpuAffinityError as exc:
            raise ConfigError(f"cpu_affinity: {exc}") from None
    # Imported only now: a bad config is reported at once, not after loading torch.
    from trtdisagg.worker.front.supervisor import FrontDied
    from trtdisagg.worker.ranks import RankDied
    from trtdisagg.worker.serve import serve_worker

    resume_gc()
    died = False
    try:
        trio.run(serve_until_signal, functools.partial(serve_worker, config), log)
    except* (RankDied, FrontDied):
        died = True  # already logged, naming the process; a traceback would add nothing
    # Every service stopped and every rank was reaped in `serve_worker`. Tearing down the
    # interpreter (collecting the model's objects module by module) would only hold the port's
    # owner process a second or two longer: leave now, with the logs flushed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if died else 0)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    raise_open_file_limit()
    try:
        if args.command in ("ctx", "gen"):
            return _run_worker(args)
        if args.command == "coordinator":
            from trtdisagg.coordinator.config import load_coordinator_config
            from trtdisagg.coordinator.serve import run_coordinator

            resume_gc()
            overrides = {"hostname": args.hostname, "port": args.port}
            if "TRTDISAGG_API_KEY" in os.environ:
                overrides["api_key"] = os.environ["TRTDISAGG_API_KEY"]
            coord = load_coordinator_config(args.config, overrides)
            _setup_logging(args.log_level, "[coordinator]")
            return run_coordinator(coord)
        if args.command == "up":
            from trtdisagg.launcher import run_local_cluster

            resume_gc()
            _setup_logging(args.log_level, "[up]")
            return run_local_cluster(args.config)
    except ConfigError as exc:
        print(f"trtdisagg: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2
