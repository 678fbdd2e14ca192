"""What a worker publishes in etcd, under which key, and the membership a watch builds. Pure.

Layout (DESIGN.md §11)::

    /trtdisagg/<cluster>/workers/<role>/<instance>  →  WorkerRecord (JSON), under the lease

`<role>` is ``ctx`` or ``gen``, `<instance>` the worker's transceiver instance name (unique per
process). A key exists while its worker's lease is kept alive; it disappears when the worker
drains (it revokes its lease first) or dies (the lease expires).

A record is read by front ends that may run another version, so unknown fields are ignored and
a record that cannot be read is reported (`BadRecord`) and left out, never fatal.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

import attrs
import cattrs

from trtdisagg.errors import TrtDisaggError

ROLES: Final = ("ctx", "gen")
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


class BadRecord(TrtDisaggError):
    """A key or value under the workers' prefix that is not a worker record."""


def check_cluster_name(name: str) -> str | None:
    """Why `name` cannot be a cluster name (it becomes a key segment), or None."""
    if not _NAME.fullmatch(name):
        return f"expected 1-63 of [A-Za-z0-9_.-] starting with a letter or digit, got {name!r}"
    return None


def check_etcd_url(url: str) -> str | None:
    """Why `url` cannot be an etcd client URL, or None (``http://host:port`` or ``host:port``)."""
    match = re.fullmatch(r"(?:https?://)?(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})/?", url)
    if match is None or not 0 < int(match[2]) < 65536:
        return f"expected http://host:port, got {url!r}"
    return None


def workers_prefix(cluster: str) -> bytes:
    return f"/trtdisagg/{cluster}/workers/".encode()


def worker_key(cluster: str, role: str, instance: str) -> bytes:
    return workers_prefix(cluster) + f"{role}/{instance}".encode()


def is_wildcard_host(host: str) -> bool:
    """Whether `host` binds every interface (``0.0.0.0``, ``::``, empty)."""
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def advertised_url(bound_url: str, advertise_host: str | None) -> str:
    """The URL peers use for a server bound at `bound_url` (``http://0.0.0.0:8001``): its host
    replaced by `advertise_host` when one is given."""
    if advertise_host is None:
        return bound_url
    scheme, _, rest = bound_url.partition("://")
    port = rest.rsplit(":", 1)[1]
    return f"{scheme}://{_url_host(advertise_host)}:{port}"


def advertised_endpoint(bound: str, advertise_host: str | None) -> str:
    """A bound ZMQ endpoint (``tcp://0.0.0.0:5555``) as peers must dial it: with the wildcard
    replaced by `advertise_host`. A specific bound address is kept: it is what peers reach."""
    head, _, port = bound.rpartition(":")
    host = head.removeprefix("tcp://")
    if advertise_host is None or not is_wildcard_host(host.strip("[]")):
        return bound
    return f"tcp://{_url_host(advertise_host)}:{port}"


@attrs.frozen(kw_only=True)
class WorkerRecord:
    """One registered worker: where to reach it and what it can pair with."""

    url: str
    role: str
    instance: str
    model: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_compat: dict[str, str | int] | None = None
    """What a peer must match to exchange KV (the worker's `/server_info` field)."""
    ctx_info_endpoint: str | None = None

    @classmethod
    def from_server_info(cls, info: Mapping[str, Any], *, url: str, instance: str) -> WorkerRecord:
        """Built from the worker's own ``/server_info`` body."""
        params = info.get("disaggregated_params") or {}
        return cls(
            url=url,
            role=str(info["role"]),
            instance=instance,
            model=str(info["model"]),
            tensor_parallel_size=int(info.get("tensor_parallel_size", 1)),
            pipeline_parallel_size=int(info.get("pipeline_parallel_size", 1)),
            kv_compat=info.get("kv_compat"),
            ctx_info_endpoint=params.get("ctx_info_endpoint"),
        )

    def encode(self) -> bytes:
        return json.dumps(_converter.unstructure(self), sort_keys=True).encode()


def _compat(value: object, _type: object) -> dict[str, str | int] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"kv_compat: expected a mapping, got {value!r}")
    out: dict[str, str | int] = {}
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str | int) or isinstance(v, bool):
            raise ValueError(f"kv_compat.{k}: expected a string or an integer, got {v!r}")
        out[k] = v
    return out


_converter = cattrs.Converter()  # unknown fields are ignored: a newer worker may add some
_converter.register_structure_hook(dict[str, str | int] | None, _compat)


def decode_record(key: bytes, value: bytes, *, cluster: str) -> WorkerRecord:
    """The record stored at `key`; its role and instance must match the key's.

    Raises:
        BadRecord: naming the key and what is wrong.
    """
    prefix = workers_prefix(cluster)
    name = key.decode(errors="replace")
    parts = key[len(prefix) :].decode(errors="replace").split("/") if key.startswith(prefix) else []
    if len(parts) != 2 or parts[0] not in ROLES or not parts[1]:
        raise BadRecord(
            f"{name}: not a worker key (expected {prefix.decode()}<ctx|gen>/<instance>)"
        )
    try:
        record = _converter.structure(json.loads(value), WorkerRecord)
    except (ValueError, TypeError, KeyError, cattrs.BaseValidationError) as exc:
        raise BadRecord(f"{name}: not a worker record: {exc}") from None
    if (record.role, record.instance) != (parts[0], parts[1]):
        raise BadRecord(
            f"{name}: the record names role {record.role!r} instance {record.instance!r}"
        )
    return record


@attrs.frozen(kw_only=True)
class MembershipChange:
    joined: tuple[WorkerRecord, ...] = ()
    left: tuple[WorkerRecord, ...] = ()
    bad: tuple[str, ...] = ()
    """Why keys were left out (`BadRecord` messages)."""


@attrs.define(eq=False, kw_only=True)
class Membership:
    """The registered workers of one cluster, by key, as a watch reports them."""

    cluster: str
    members: dict[bytes, WorkerRecord] = attrs.Factory(dict)

    def reset(self, kvs: Iterable[tuple[bytes, bytes]]) -> MembershipChange:
        """Replace everything with a fresh read of the prefix (start-up, or after a lost watch)."""
        fresh: dict[bytes, WorkerRecord] = {}
        bad = []
        for key, value in kvs:
            try:
                fresh[key] = decode_record(key, value, cluster=self.cluster)
            except BadRecord as exc:
                bad.append(str(exc))
        left = [r for k, r in self.members.items() if fresh.get(k) != r]
        joined = [r for k, r in fresh.items() if self.members.get(k) != r]
        self.members = fresh
        return MembershipChange(joined=tuple(joined), left=tuple(left), bad=tuple(bad))

    def put(self, key: bytes, value: bytes) -> MembershipChange:
        try:
            record = decode_record(key, value, cluster=self.cluster)
        except BadRecord as exc:
            gone = self.members.pop(key, None)
            return MembershipChange(left=(gone,) if gone else (), bad=(str(exc),))
        previous = self.members.get(key)
        if previous == record:
            return MembershipChange()
        self.members[key] = record
        return MembershipChange(joined=(record,), left=(previous,) if previous else ())

    def delete(self, key: bytes) -> MembershipChange:
        gone = self.members.pop(key, None)
        return MembershipChange(left=(gone,) if gone else ())

    def urls(self, role: str) -> list[str]:
        return sorted({r.url for r in self.members.values() if r.role == role})
