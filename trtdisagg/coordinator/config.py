"""Coordinator configuration (`disagg.yaml`): frozen attrs values, validated at start.

Keys follow TensorRT-LLM's `disagg_config.yaml` (DESIGN.md §4)::

    hostname: 127.0.0.1
    port: 8000
    context_servers:
      num_instances: 1            # optional; must equal len(urls) when given
      urls: ["127.0.0.1:8001"]
      router: {type: round_robin} # round_robin | load_balancing | kv_cache_aware | conversation
    generation_servers:
      urls: ["127.0.0.1:8002"]
      router: {type: load_balancing, use_tokens: false}
    cluster: null                 # {etcd: URL, name: NAME}: the servers are the workers
                                  # registered there (instead of the two groups' urls)
    num_workers: 1                # >1: a fleet of front ends sharing the port
    disagg_coordinator_url: null  # accepted and ignored (a warning): every front end places itself
    node_id: null                 # [0, 256); default: hash of hostname:port
    schedule_style: context_first # context_first | generation_first
    conditional_disagg_config: {max_local_prefill_length: 0}
                                  # with it, context_servers may be empty (aggregated mode)
    max_retries: 1
    request_timeout: 180          # seconds, whole request
    ctx_first_token_timeout: 60   # seconds: ctx leg posted → ctx's answer (its first token)
    gen_first_token_timeout: 60   # seconds: gen leg posted → its first token (KV transfer in it)
    inter_token_timeout: 10       # seconds: the longest gap between two tokens of a gen stream
    max_migrations: 1             # times one choice's stream may resume on another gen
    server_start_timeout: 180     # seconds
    health_check_interval: 1.0    # seconds between /health polls of each worker
    health_check_timeout: null    # seconds a poll waits (null: 2 x the interval, within 2..5)
    api_key: null                 # clients must send "Authorization: Bearer <key>" when set

Types are checked strictly (`port: "8000"` is an error, not a cast) and every failure is a
`ConfigError` naming the key path, e.g. ``disagg.yaml: $.context_servers.urls: expected a list``.
"""

from __future__ import annotations

import enum
import re
from pathlib import Path
from typing import Any, Final

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn

from trtdisagg.config import ConfigError, read_yaml, scalar_hook, type_name
from trtdisagg.membership.records import check_cluster_name, check_etcd_url

PHASE_TIMEOUTS: Final = (
    "ctx_first_token_timeout",
    "gen_first_token_timeout",
    "inter_token_timeout",
)
MAX_MIGRATIONS: Final = 8


class RouterType(enum.Enum):
    ROUND_ROBIN = "round_robin"
    LOAD_BALANCING = "load_balancing"
    KV_CACHE_AWARE = "kv_cache_aware"
    CONVERSATION = "conversation"


class ScheduleStyle(enum.Enum):
    CONTEXT_FIRST = "context_first"
    GENERATION_FIRST = "generation_first"


@attrs.frozen(kw_only=True)
class RouterConfig:
    """`router:` of a server group. Arguments a router type does not use are ignored."""

    type: RouterType = RouterType.ROUND_ROBIN
    # load_balancing / kv_cache_aware: weigh load by prompt tokens instead of requests.
    use_tokens: bool = False
    # kv_cache_aware: override the values read from each worker's /server_info.
    max_batch_size: int | None = None
    tokens_per_block: int | None = None
    # kv_cache_aware: seconds between background polls of each worker's /kv_cache_events
    # (a worker is also polled right after each request it served).
    events_poll_interval: float = 1.0
    # conversation: implicit prefix routing above this matched fraction of the prompt's blocks.
    match_threshold: float = 0.75
    # conversation: prompt blocks remembered for implicit routing (least recently used go)
    max_sessions: int = 100_000


@attrs.frozen(kw_only=True)
class ServerGroupConfig:
    num_instances: int | None = None
    urls: list[str] = attrs.Factory(list)
    router: RouterConfig = attrs.Factory(RouterConfig)


@attrs.frozen(kw_only=True)
class ConditionalDisaggConfig:
    """Prompts whose uncached part is at most this many tokens are prefilled on gen itself."""

    max_local_prefill_length: int = 0


@attrs.frozen(kw_only=True)
class MembershipConfig:
    """`cluster:`: the servers are the workers registered in this etcd under this name."""

    etcd: str
    name: str


@attrs.frozen(kw_only=True)
class CoordinatorConfig:
    hostname: str = "localhost"
    port: int = 8000
    context_servers: ServerGroupConfig = attrs.Factory(ServerGroupConfig)
    generation_servers: ServerGroupConfig = attrs.Factory(ServerGroupConfig)
    cluster: MembershipConfig | None = None
    num_workers: int = 1
    disagg_coordinator_url: str | None = None
    node_id: int | None = None
    schedule_style: ScheduleStyle = ScheduleStyle.CONTEXT_FIRST
    conditional_disagg_config: ConditionalDisaggConfig | None = None
    max_retries: int = 1
    request_timeout: float = 180.0
    # Deadlines per phase (seconds; null: only request_timeout bounds the phase). A worker that
    # misses one leaves rotation until its next good health check (`service.py`, `resume.py`).
    ctx_first_token_timeout: float | None = 60.0
    gen_first_token_timeout: float | None = 60.0
    inter_token_timeout: float | None = 10.0
    max_migrations: int = 1
    """Continuations of one choice's gen stream on another gen after its leg died or stalled."""
    server_start_timeout: float = 180.0
    health_check_interval: float = 1.0
    health_check_timeout: float | None = None
    api_key: str | None = attrs.field(default=None, repr=False)  # a secret: never in a repr
    max_request_body_bytes: int = 16 * 1024 * 1024
    log_level: str = "info"


# ---- strict structuring ----


def _str_list(value: object, _t: object) -> list[str]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list of strings, got {type_name(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise TypeError(f"element {i}: expected a string, got {type_name(item)}")
    return list(value)


def _enum_hook(value: object, cls: type[enum.Enum]) -> enum.Enum:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in cls)
        raise ValueError(f"expected one of {allowed}; got {value!r}") from None


def _is_enum(t: object) -> bool:
    return isinstance(t, type) and issubclass(t, enum.Enum)


def _mapping_factory(converter: cattrs.Converter) -> Any:
    def factory(cls: type) -> Any:
        inner: Any = make_dict_structure_fn(
            cls,
            converter,
            _cattrs_forbid_extra_keys=True,
            _cattrs_detailed_validation=converter.detailed_validation,
        )

        def hook(value: object, t: type) -> object:
            if not isinstance(value, dict):
                raise TypeError(f"expected a mapping, got {type_name(value)}")
            return inner(value, t)

        return hook

    return factory


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    for scalar in (bool, int, float, str):
        converter.register_structure_hook(scalar, scalar_hook(scalar))
    converter.register_structure_hook_func(lambda t: t == list[str], _str_list)
    converter.register_structure_hook_func(_is_enum, _enum_hook)
    converter.register_structure_hook_factory(attrs.has, _mapping_factory(converter))
    return converter


_converter = _make_converter()


def _describe(exc: BaseException, path: str, out: list[str]) -> None:
    """Flatten a cattrs error tree into 'path: problem' lines."""
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        for key in sorted(exc.extra_fields):
            out.append(f"{path}.{key}: unknown key")
        return
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            sub_path = path
            for note in getattr(sub, "__notes__", []):
                if isinstance(note, cattrs.AttributeValidationNote):
                    sub_path = f"{path}.{note.name}"
                elif isinstance(note, cattrs.IterableValidationNote):
                    sub_path = f"{path}[{note.index}]"
            _describe(sub, sub_path, out)
        return
    if isinstance(exc, KeyError):
        out.append(f"{path}: required key missing")
    else:
        out.append(f"{path}: {exc}")


def _structure(data: object, source: str) -> CoordinatorConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: $: expected a mapping, got {type_name(data)}")
    try:
        return _converter.structure(data, CoordinatorConfig)
    except (cattrs.BaseValidationError, ValueError, TypeError) as exc:
        lines: list[str] = []
        _describe(exc, "$", lines)
        raise ConfigError(f"{source}: " + "; ".join(lines)) from None


# ---- semantic checks, each naming its key ----

_URL = re.compile(
    r"^(?:(?P<scheme>https?)://)?(?P<host>\[[0-9a-fA-F:]+\]|[^:/\s]+):(?P<port>\d+)/?$"
)


def normalize_url(url: str) -> str | None:
    """'host:port' or 'http://host:port' → 'http://host:port'; None when malformed."""
    match = _URL.match(url.strip())
    if match is None or not 0 < int(match["port"]) < 65536:
        return None
    return f"{match['scheme'] or 'http'}://{match['host']}:{int(match['port'])}"


def _check_urls(group: ServerGroupConfig, path: str) -> list[str]:
    errors = []
    if not group.urls:
        errors.append(f"{path}.urls: must list at least one server (host:port)")
    for i, url in enumerate(group.urls):
        if normalize_url(url) is None:
            errors.append(f"{path}.urls[{i}]: expected host:port or http://host:port, got {url!r}")
    if len(set(group.urls)) != len(group.urls):
        errors.append(f"{path}.urls: lists a server twice")
    if group.num_instances is not None and group.num_instances != len(group.urls):
        errors.append(
            f"{path}.num_instances: is {group.num_instances} but urls lists {len(group.urls)}"
        )
    return errors


def _check_router(group: ServerGroupConfig, path: str) -> list[str]:
    errors = []
    router = group.router
    for name in ("max_batch_size", "tokens_per_block", "max_sessions"):
        value = getattr(router, name)
        if value is not None and value <= 0:
            errors.append(f"{path}.router.{name}: must be positive, got {value}")
    if router.events_poll_interval <= 0:
        errors.append(f"{path}.router.events_poll_interval: must be positive")
    if not 0.0 < router.match_threshold <= 1.0:
        errors.append(f"{path}.router.match_threshold: must be in (0, 1]")
    return errors


def _check_servers(config: CoordinatorConfig) -> list[str]:
    """Where the servers come from: static url lists, or the workers registered in etcd."""
    groups = (
        ("$.context_servers", config.context_servers),
        ("$.generation_servers", config.generation_servers),
    )
    errors = [e for path, group in groups for e in _check_router(group, path)]
    if config.cluster is not None:
        if (why := check_etcd_url(config.cluster.etcd)) is not None:
            errors.append(f"$.cluster.etcd: {why}")
        if (why := check_cluster_name(config.cluster.name)) is not None:
            errors.append(f"$.cluster.name: {why}")
        for path, group in groups:
            if group.urls or group.num_instances is not None:
                errors.append(
                    f"{path}.urls: not with cluster: the servers are the workers registered in "
                    f"etcd (leave urls and num_instances out, or remove cluster)"
                )
        return errors
    # Aggregated mode: no context servers, and conditional disaggregation serves every prompt
    # within max_local_prefill_length on one generation server alone (longer ones get a 503).
    aggregated = config.conditional_disagg_config is not None and not config.context_servers.urls
    if not aggregated:
        ctx_errors = _check_urls(config.context_servers, "$.context_servers")
        if not config.context_servers.urls:
            ctx_errors[0] += (
                "; or set conditional_disagg_config to serve requests on gen alone, or cluster "
                "to serve the workers registered in etcd"
            )
        errors += ctx_errors
    errors += _check_urls(config.generation_servers, "$.generation_servers")
    overlap = {normalize_url(u) for u in config.context_servers.urls} & {
        normalize_url(u) for u in config.generation_servers.urls
    }
    if overlap - {None}:
        both = sorted(u for u in overlap if u is not None)
        errors.append(f"$.generation_servers.urls: also listed as context servers: {both}")
    return errors


def validate(config: CoordinatorConfig) -> list[str]:
    """Every semantic problem of a structured config, as 'key path: problem' lines."""
    errors = _check_servers(config)
    if not 0 <= config.port < 65536:
        errors.append(f"$.port: must be in [0, 65536), got {config.port}")
    if not 1 <= config.num_workers <= 64:
        errors.append(f"$.num_workers: must be in [1, 64], got {config.num_workers}")
    url = config.disagg_coordinator_url
    if url is not None and not url.startswith(("http://", "https://")):
        errors.append(f"$.disagg_coordinator_url: expected http://host:port, got {url!r}")
    if config.node_id is not None and not 0 <= config.node_id < 256:
        errors.append(f"$.node_id: must be in [0, 256), got {config.node_id}")
    if config.max_retries < 0:
        errors.append(f"$.max_retries: must not be negative, got {config.max_retries}")
    if not 0 <= config.max_migrations <= MAX_MIGRATIONS:
        errors.append(
            f"$.max_migrations: must be in [0, {MAX_MIGRATIONS}], got {config.max_migrations}"
        )
    for name in PHASE_TIMEOUTS:
        value = getattr(config, name)
        if value is not None and value <= 0:
            errors.append(f"$.{name}: must be positive (or null: no deadline), got {value}")
    durations = ("request_timeout", "server_start_timeout", "health_check_interval")
    for name in (*durations, "health_check_timeout"):
        value = getattr(config, name)
        if value is not None and value <= 0:
            errors.append(f"$.{name}: must be positive, got {value}")
    conditional = config.conditional_disagg_config
    if conditional is not None and conditional.max_local_prefill_length < 0:
        errors.append("$.conditional_disagg_config.max_local_prefill_length: must not be negative")
    if config.max_request_body_bytes <= 0:
        errors.append("$.max_request_body_bytes: must be positive")
    return errors


def load_coordinator_config(
    path: str | Path | None, overrides: dict[str, object] | None = None
) -> CoordinatorConfig:
    """Read `disagg.yaml` (or defaults), apply non-None CLI overrides, validate.

    Raises:
        ConfigError: the file cannot be read or parsed, a key is unknown, a value has the wrong
            type or is out of range. The message starts with the file name and names the key
            path of every problem (``$.context_servers.urls``).
    """
    data = read_yaml(path) if path is not None else {}
    source = str(path) if path is not None else "coordinator config"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: $: expected a mapping, got {type_name(data)}")
    merged = {**data, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    config = _structure(merged, source)
    errors = validate(config)
    if errors:
        raise ConfigError(f"{source}: " + "; ".join(errors))
    return config


def coordinator_config_from_dict(data: dict[str, Any], *, source: str) -> CoordinatorConfig:
    """Structure and validate an in-memory mapping (the launcher's inline configs)."""
    config = _structure(data, source)
    errors = validate(config)
    if errors:
        raise ConfigError(f"{source}: " + "; ".join(errors))
    return config


def to_dict(config: CoordinatorConfig) -> dict[str, Any]:
    """Plain data that `load_coordinator_config` reads back to an equal config."""
    data: dict[str, Any] = _converter.unstructure(config)
    return data
