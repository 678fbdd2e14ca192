"""Configuration: frozen attrs classes, loaded from YAML through one cattrs converter.

Keys follow TensorRT-LLM's worker and `disagg_config.yaml` names where one exists (DESIGN.md §4).
Unknown keys and wrong types fail at start-up with the key path (`$.kv_cache_config.layout`),
never deep inside a request.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar

import attrs
import cattrs
import yaml

from trtdisagg.cpu_affinity import CpuAffinityError, CpuList, parse_cpu_list
from trtdisagg.kv.page_table import Layout
from trtdisagg.membership.records import check_cluster_name, check_etcd_url, is_wildcard_host
from trtdisagg.security.secret import (
    InvalidClusterSecret,
    check_cluster_secret,
    resolve_cluster_secret,
)


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid; the message names the key path."""


class Role(enum.Enum):
    CTX = "ctx"
    GEN = "gen"


class TransceiverBackend(enum.Enum):
    NIXL = "NIXL"
    LOOPBACK = "LOOPBACK"


def _positive(_inst: object, attr: attrs.Attribute[Any], value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{attr.name}: must be positive, got {value}")


def _non_negative(_inst: object, attr: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ConfigError(f"{attr.name}: must not be negative, got {value}")


def _fault_spec(_inst: object, attr: attrs.Attribute[Any], value: str | None) -> None:
    if value is None:
        return
    from trtdisagg.faults.spec import FaultSpecError, parse_faults  # tests only: lazily

    try:
        parse_faults(value)
    except FaultSpecError as exc:
        raise ConfigError(f"{attr.name} (TRTDISAGG_FAULTS): {exc}") from None


def _cluster_secret(_inst: object, _attr: attrs.Attribute[Any], value: str | None) -> None:
    if value is None:
        return
    try:
        check_cluster_secret(value)
    except InvalidClusterSecret as exc:
        raise ConfigError(str(exc)) from None  # names the key, never the value


@attrs.frozen(kw_only=True)
class KvCacheConfig:
    tokens_per_block: int = attrs.field(default=32, validator=_positive)
    max_tokens: int | None = 65536
    free_gpu_memory_fraction: float | None = None
    layout: Layout = Layout.HND
    enable_block_reuse: bool = True

    def __attrs_post_init__(self) -> None:
        if self.max_tokens is None and self.free_gpu_memory_fraction is None:
            raise ConfigError("set max_tokens or free_gpu_memory_fraction")
        if self.max_tokens is not None and self.max_tokens < self.tokens_per_block:
            raise ConfigError(
                f"max_tokens: {self.max_tokens} is less than one block "
                f"({self.tokens_per_block} tokens)"
            )
        fraction = self.free_gpu_memory_fraction
        if fraction is not None and not 0.0 < fraction < 1.0:
            raise ConfigError(f"free_gpu_memory_fraction: must be in (0, 1), got {fraction}")


@attrs.frozen(kw_only=True)
class CacheTransceiverConfig:
    backend: TransceiverBackend | None = None
    kv_transfer_timeout_ms: int = attrs.field(default=60000, validator=_positive)
    kv_cache_bounce_size_mb: int = attrs.field(default=0, validator=_non_negative)
    # With the bounce buffer on: a pairing whose direct transfer would write pieces smaller than
    # this goes through staging (one write per transfer). Both ends must agree.
    kv_cache_bounce_threshold_bytes: int = attrs.field(default=16384, validator=_positive)
    # NIXL's own progress thread. It spins a core even when idle; with it off, the transceiver's
    # polling drives transfers, which suits CPU clusters where cores are scarce. None: on for a
    # worker on CUDA, off on the CPU (`WorkerConfig.nixl_progress_thread`).
    nixl_progress_thread: bool | None = None
    # A peer instance silent this long is probed; three unanswered probes this long apart mean
    # it is gone, and it is forgotten, its agents unloaded (transfer/liveness.py).
    peer_probe_ms: int = attrs.field(default=5000, validator=_positive)
    # ctx: transfers one gen instance may hold here at once (sessions bound to it and its
    # messages waiting for a session); a REQUEST_DATA past it is refused at once, and counted.
    max_sessions_per_peer: int = attrs.field(default=1024, validator=_positive)
    # ZeroMQ CURVE on every control socket, keyed by this (trtdisagg/security/). A secret:
    # never in a repr, a log line or /server_info. TRTDISAGG_CLUSTER_SECRET overrides it.
    cluster_secret: str | None = attrs.field(default=None, repr=False, validator=_cluster_secret)
    # ctx: a KV write under this many GB/s (of those of 4 MiB or more that took 1 ms or more) is
    # counted in trtdisagg_kv_slow_writes_total and logged: a transport that fell back to TCP,
    # or a link below its speed (worker/slow_writes.py). None: no floor.
    kv_transfer_min_gbps: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive)
    )


def _cluster_name(_inst: object, attr: attrs.Attribute[Any], value: str) -> None:
    if why := check_cluster_name(value):
        raise ConfigError(f"{attr.name}: {why}")


def _etcd_url(_inst: object, attr: attrs.Attribute[Any], value: str) -> None:
    if why := check_etcd_url(value):
        raise ConfigError(f"{attr.name}: {why}")


@attrs.frozen(kw_only=True)
class ClusterConfig:
    """`cluster:` of a worker: register in etcd under `/trtdisagg/<name>/workers/<role>/<id>`
    (trtdisagg/membership/). Without it the worker is found only through static url lists."""

    etcd: str = attrs.field(validator=_etcd_url)
    name: str = attrs.field(validator=_cluster_name)
    # The key lives while the worker renews this lease (every third of it): a worker that dies
    # leaves the cluster within about this long. etcd raises TTLs below its own minimum.
    lease_ttl_s: int = attrs.field(default=10, validator=_positive)
    # SIGTERM drains: the key goes first, then in-flight requests finish, for at most this long.
    drain_timeout_s: float = attrs.field(default=600.0, validator=_non_negative)


@attrs.frozen(kw_only=True)
class WorkerConfig:
    role: Role = Role.CTX
    model: str = "tiny"
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    # The address peers and the coordinator use to reach this worker when `host` binds every
    # interface (0.0.0.0): its URL in etcd, its control endpoints, the interface UCX may use.
    advertise_host: str | None = None
    port: int = 8001
    device: str = "cpu"
    # CUDA only: the GPU index this worker runs on (as numbered in this process, i.e. after
    # CUDA_VISIBLE_DEVICES). Lets `up` place workers of one cluster file on different GPUs.
    cuda_device: int = attrs.field(default=0, validator=_non_negative)
    dtype: str = "float32"
    tensor_parallel_size: int = attrs.field(default=1, validator=_positive)
    pipeline_parallel_size: int = attrs.field(default=1, validator=_positive)
    max_batch_size: int = attrs.field(default=64, validator=_positive)
    max_num_tokens: int = attrs.field(default=8192, validator=_positive)
    # While requests decode, a step takes at most this many tokens (its decode rows included) per
    # prompt waiting to be admitted (at least one), up to max_num_tokens: prompts ride on the
    # decode steps in small chunks that slow them less (`worker/step_plan.py`). None: off.
    prefill_chunk_tokens: int | None = None
    max_seq_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_config: KvCacheConfig = attrs.Factory(KvCacheConfig)
    cache_transceiver_config: CacheTransceiverConfig = attrs.Factory(CacheTransceiverConfig)
    # torch intra-op threads on CPU. Workers of one machine share its cores, and OpenMP threads
    # that spin against each other slow a step down tenfold, so the default is 1 per worker.
    cpu_threads: int = attrs.field(default=1, validator=_positive)
    # The CPUs this worker's engine runs on (`cpu_affinity.py`): a list, or text like "0-3,8".
    # Each rank takes an equal slice; the API fronts run on the CPUs left. None: anywhere.
    cpu_affinity: CpuList | None = None
    # CUDA only: replay decode steps from CUDA graphs captured at start (batch sizes 1..64),
    # and mixed and prefill steps of up to cuda_graph_max_tokens tokens from graphs captured
    # per token-count bucket (0: those run eagerly).
    cuda_graphs: bool = True
    cuda_graph_max_tokens: int = attrs.field(default=2048, validator=_non_negative)
    # CPU only, one rank: run decode steps through a torch.compile'd forward (compiled at
    # start, cached on disk by torch), which dispatches a fraction of the eager step's ops.
    cpu_compile: bool = False
    # Launch each step before the previous one's tokens reach the host (the loop processes a
    # step's outputs while the next one runs). Multi-rank instances always step synchronously.
    async_scheduling: bool = True
    # A streamed choice's chunks after its first carry at least this many tokens (fewer only at
    # the end): fewer, larger SSE writes when many streams are open, burstier gaps between them.
    stream_interval: int = attrs.field(default=1, validator=_positive)
    api_key: str | None = attrs.field(default=None, repr=False)  # a secret: never in a repr
    # Test-only introspection and fault hooks (KV digests at /debug/kv_digests). Set through the
    # TRTDISAGG_TEST_HOOKS=1 environment variable; never on in production.
    enable_test_hooks: bool = False
    # Test-only fault injection (trtdisagg/faults/spec.py), set through TRTDISAGG_FAULTS. None: off,
    # and no hook is installed at all.
    fault_injection: str | None = attrs.field(default=None, validator=_fault_spec)
    max_request_body_bytes: int = attrs.field(default=16 * 1024 * 1024, validator=_positive)
    log_level: str = "info"
    # 0: this process serves the HTTP API itself. N >= 1: N front processes serve it on the same
    # port (SO_REUSEPORT), and this process runs the engine alone (`worker/front/`).
    api_server_count: int = attrs.field(default=0, validator=_non_negative)
    cluster: ClusterConfig | None = None

    def __attrs_post_init__(self) -> None:
        if self.cluster is not None and is_wildcard_host(self.host) and not self.advertise_host:
            raise ConfigError(
                f"advertise_host: required with cluster and host {self.host!r}: the address "
                "the coordinator and peers reach this worker at"
            )
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device: must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype: must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port: must be in [0, 65536), got {self.port}")
        if self.cpu_affinity is not None:
            self._check_cpu_affinity(self.cpu_affinity)
        chunk = self.prefill_chunk_tokens
        if chunk is not None and chunk <= self.max_batch_size:
            raise ConfigError(
                f"prefill_chunk_tokens: must exceed max_batch_size ({self.max_batch_size}), so "
                f"a chunk fits beside a full batch of decode rows; got {chunk}"
            )

    def _check_cpu_affinity(self, cpus: CpuList) -> None:
        # NIXL's progress thread spins: on a rank's only CPU it starves that rank's own threads
        # (a KV transfer on one H200 took 8 ms instead of 0.9: docs/BENCHMARKS.md, "On one H200").
        spinning = (
            self.cache_transceiver_config.backend is TransceiverBackend.NIXL
            and self.nixl_progress_thread
        )
        each = 2 if spinning else 1
        if len(cpus) < each * self.world_size:
            why = " while NIXL's progress thread runs (it spins one)" if spinning else ""
            raise ConfigError(
                f"cpu_affinity: lists {len(cpus)} CPU(s) for {self.world_size} rank(s); each "
                f"rank needs {each} at least{why}"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def nixl_progress_thread(self) -> bool:
        """Whether this worker's NIXL agents run NIXL's progress thread."""
        chosen = self.cache_transceiver_config.nixl_progress_thread
        return self.device == "cuda" if chosen is None else chosen


def _cpu_list(value: object, _type: object) -> CpuList:
    try:
        return parse_cpu_list(value)
    except CpuAffinityError as exc:
        raise ConfigError(f"cpu_affinity: {exc}") from None


_JSON_TYPES: Final = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def type_name(value: object) -> str:
    """What a YAML or JSON value is, in words ("an integer", "a mapping", "null")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def scalar_hook(expected: type) -> Callable[[object, object], object]:
    """A cattrs structure hook that takes a value of exactly `expected` (an integer, too, for a
    float), where cattrs would convert: bool("maybe") is true and int(9001.7) is 9001."""

    def hook(value: object, _type: object) -> object:
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
            raise ConfigError(f"expected {_JSON_TYPES[expected]}, got {type_name(value)}")
        return value

    return hook


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(CpuList, _cpu_list)
    for scalar in (bool, int, float, str):
        converter.register_structure_hook(scalar, scalar_hook(scalar))
    return converter


_converter = _make_converter()


def _format_leaf(exc: BaseException, type_: type | None) -> str:
    # Our own validators already say what is wrong; cattrs adds where (" @ $.path").
    if isinstance(exc, ConfigError):
        return str(exc)
    return cattrs.v.format_exception(exc, type_)


def _format_error(exc: Exception, source: str) -> ConfigError:
    messages = (
        cattrs.transform_error(exc, format_exception=_format_leaf)
        if isinstance(exc, cattrs.BaseValidationError)
        else []
    )
    if not messages:
        messages = [str(exc)]
    # transform_error words unknown keys as "extra fields found (x) @ $"; keep its key path.
    return ConfigError(f"{source}: " + "; ".join(messages))


T = TypeVar("T")


def structure(data: object, cls: type[T], *, source: str = "config") -> T:
    """Build `cls` from plain data, turning every failure into one ConfigError with key paths."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: $ must be a mapping, got {type(data).__name__}")
    try:
        return _converter.structure(data, cls)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except (cattrs.BaseValidationError, ValueError, TypeError) as exc:
        raise _format_error(exc, source) from None


def unstructure(value: object) -> Any:
    return _converter.unstructure(value)


def read_yaml(path: str | Path) -> object:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None


def load_worker_config(
    path: str | Path | None,
    overrides: dict[str, object] | None = None,
    *,
    cluster_secret: str | None = None,
) -> WorkerConfig:
    """Read a worker YAML file (or defaults), apply CLI overrides, validate. `cluster_secret`
    (TRTDISAGG_CLUSTER_SECRET) replaces the file's `cache_transceiver_config.cluster_secret`."""
    data = read_yaml(path) if path is not None else {}
    source = str(path) if path is not None else "worker config"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: $ must be a mapping, got {type(data).__name__}")
    merged = {**data, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    transceiver = merged.get("cache_transceiver_config") or {}
    if isinstance(transceiver, dict):  # anything else: `structure` says what is wrong
        configured = transceiver.get("cluster_secret")
        secret = resolve_cluster_secret(configured, cluster_secret)
        if secret != configured:
            merged["cache_transceiver_config"] = {**transceiver, "cluster_secret": secret}
    return structure(merged, WorkerConfig, source=source)
