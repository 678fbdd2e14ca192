"""disagg.yaml validation: every problem is a ConfigError naming its key path."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from trtdisagg.config import ConfigError
from trtdisagg.coordinator.config import (
    CoordinatorConfig,
    RouterType,
    ScheduleStyle,
    coordinator_config_from_dict,
    load_coordinator_config,
    normalize_url,
    to_dict,
)

REPO = Path(__file__).resolve().parents[2]

BASE: dict[str, Any] = {
    "context_servers": {"urls": ["127.0.0.1:8001"]},
    "generation_servers": {"urls": ["127.0.0.1:8002"], "router": {"type": "kv_cache_aware"}},
}


def build(**changes: Any) -> CoordinatorConfig:
    data = copy.deepcopy(BASE)
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return coordinator_config_from_dict(data, source="disagg.yaml")


def test_repo_config_loads() -> None:
    config = load_coordinator_config(REPO / "conf" / "disagg.yaml")
    assert config.schedule_style is ScheduleStyle.CONTEXT_FIRST
    assert config.context_servers.urls == ["127.0.0.1:8001"]


def test_defaults_and_types() -> None:
    config = build()
    assert config.generation_servers.router.type is RouterType.KV_CACHE_AWARE
    assert config.max_retries == 1 and config.request_timeout == 180.0
    assert build(request_timeout=5).request_timeout == 5.0  # an integer is a number
    assert config.max_migrations == 1
    assert (config.ctx_first_token_timeout, config.gen_first_token_timeout) == (60.0, 60.0)
    assert config.inter_token_timeout == 10.0
    assert build(inter_token_timeout=None).inter_token_timeout is None  # no deadline
    assert build(max_migrations=0, gen_first_token_timeout=2).gen_first_token_timeout == 2.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"context_servers__urls": "127.0.0.1:8001"},
            r"\$\.context_servers\.urls: expected a list",
        ),
        (
            {"context_servers__urls": [8001]},
            r"\$\.context_servers\.urls: element 0: expected a string",
        ),
        ({"context_servers__urls": []}, r"\$\.context_servers\.urls: must list at least one"),
        (
            {"context_servers__urls": ["nonsense"]},
            r"\$\.context_servers\.urls\[0\]: expected host:port",
        ),
        ({"context_servers__nope": 1}, r"\$\.context_servers\.nope: unknown key"),
        ({"bogus": 1}, r"\$\.bogus: unknown key"),
        ({"port": "8000"}, r"\$\.port: expected an integer, got a string"),
        ({"port": True}, r"\$\.port: expected an integer, got a boolean"),
        ({"port": 70000}, r"\$\.port: must be in"),
        ({"schedule_style": "sideways"}, r"\$\.schedule_style: expected one of context_first"),
        ({"generation_servers__router__type": "random"}, r"\$\.generation_servers\.router\.type"),
        ({"generation_servers__router__colour": "red"}, r"\$\.generation_servers\.router\.colour"),
        ({"generation_servers__num_instances": 2}, r"\$\.generation_servers\.num_instances: is 2"),
        ({"node_id": 300}, r"\$\.node_id: must be in \[0, 256\)"),
        ({"max_retries": -1}, r"\$\.max_retries"),
        ({"request_timeout": 0}, r"\$\.request_timeout: must be positive"),
        ({"health_check_timeout": -1}, r"\$\.health_check_timeout: must be positive, got -1"),
        ({"max_migrations": -1}, r"\$\.max_migrations: must be in \[0, 8\], got -1"),
        ({"max_migrations": 9}, r"\$\.max_migrations: must be in \[0, 8\]"),
        ({"max_migrations": 1.5}, r"\$\.max_migrations: expected an integer, got a number"),
        ({"inter_token_timeout": 0}, r"\$\.inter_token_timeout: must be positive"),
        ({"ctx_first_token_timeout": -1}, r"\$\.ctx_first_token_timeout: must be positive"),
        ({"gen_first_token_timeout": "5"}, r"\$\.gen_first_token_timeout: expected a number"),
        ({"num_workers": 0}, r"\$\.num_workers"),
        ({"disagg_coordinator_url": "localhost:9"}, r"\$\.disagg_coordinator_url"),
        (
            {"conditional_disagg_config": {"max_local_prefill_length": "x"}},
            r"\$\.conditional_disagg_config\.max_local_prefill_length: expected an integer",
        ),
        ({"context_servers": None}, r"\$\.context_servers: expected a mapping, got null"),
        ({"generation_servers__urls": ["127.0.0.1:8001"]}, r"also listed as context servers"),
    ],
)
def test_errors_name_the_key(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=r"^disagg\.yaml: .*" + message):
        build(**changes)


def test_file_errors_start_with_the_file_name(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**BASE, "context_servers": {"urls": 5}}))
    with pytest.raises(ConfigError, match=r"bad\.yaml: \$\.context_servers\.urls"):
        load_coordinator_config(path)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"\$: expected a mapping"):
        load_coordinator_config(path)


def test_overrides_apply_and_none_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(BASE))
    config = load_coordinator_config(path, {"port": 9100, "hostname": None})
    assert config.port == 9100 and config.hostname == "localhost"


def test_round_trip() -> None:
    config = build(conditional_disagg_config={"max_local_prefill_length": 8})
    again = coordinator_config_from_dict(to_dict(config), source="x")
    assert again == config


MEMBERS: dict[str, Any] = {"cluster": {"etcd": "http://etcd:2379", "name": "prod"}}


def test_servers_from_etcd_instead_of_url_lists() -> None:
    config = coordinator_config_from_dict(
        {**MEMBERS, "generation_servers": {"router": {"type": "load_balancing"}}}, source="x"
    )
    assert config.cluster is not None and config.cluster.name == "prod"
    assert config.context_servers.urls == [] and config.generation_servers.urls == []
    assert config.generation_servers.router.type is RouterType.LOAD_BALANCING


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"cluster": {"etcd": "etcd", "name": "p"}}, r"\$\.cluster\.etcd: expected http://host"),
        ({"cluster": {"etcd": "e:1", "name": "a/b"}}, r"\$\.cluster\.name: expected 1-63"),
        ({"cluster": {"etcd": "e:1"}}, r"\$\.cluster\.name: required key missing"),
        ({"context_servers": {"urls": ["h:1"]}}, r"\$\.context_servers\.urls: not with cluster"),
        ({"generation_servers": {"num_instances": 1}}, r"\$\.generation_servers\.urls: not with"),
    ],
)
def test_membership_errors_name_the_key(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=r"^x: .*" + message):
        coordinator_config_from_dict({**MEMBERS, **changes}, source="x")


def test_the_old_fleet_keys_still_load() -> None:
    """`disagg_coordinator_url` names a state process that no longer exists: accepted (and
    ignored with a warning at start), so an old disagg.yaml still starts."""
    config = build(num_workers=2, disagg_coordinator_url="http://c:1", port=1)
    assert config.num_workers == 2 and config.disagg_coordinator_url == "http://c:1"


@pytest.mark.parametrize(
    ("raw", "url"),
    [
        ("127.0.0.1:8001", "http://127.0.0.1:8001"),
        ("http://host:80/", "http://host:80"),
        ("https://host:443", "https://host:443"),
        ("[::1]:8000", "http://[::1]:8000"),
        ("host", None),
        ("host:0", None),
    ],
)
def test_normalize_url(raw: str, url: str | None) -> None:
    assert normalize_url(raw) == url
