"""etcd's v3 HTTP/JSON gateway, as data: request bodies, answers, watch events. Pure.

The gateway (etcd 3.4+, ``/v3/...``) is grpc-gateway over etcd's gRPC API: keys and values are
base64 in JSON, 64-bit integers (revisions, lease ids, TTLs) are JSON strings, and fields that
hold their zero value are left out (a PUT event has no ``type``; a lease that is gone answers a
keepalive with no ``TTL``). Every answer is parsed here into frozen values, and a body that is
not what the API promises raises `EtcdProtocolError` naming the field, so the shell
(`etcd.py`) never reads raw JSON.

A watch is one streaming POST to ``/v3/watch`` whose answer is newline-delimited JSON, one
``{"result": {...}}`` object per line: first ``created``, then batches of events, each batch at
one revision. A ``canceled`` result (the watched revision was compacted away, or the server is
going away) ends the stream.
"""

from __future__ import annotations

import base64
import enum
import json
from typing import Any, Final

import attrs

from trtdisagg.errors import TrtDisaggError

Json = dict[str, Any]

API: Final = "/v3"


class EtcdError(TrtDisaggError):
    """etcd could not be reached, or answered with an error."""


class EtcdProtocolError(EtcdError):
    """An answer that is not shaped as etcd's v3 JSON API promises."""


class LeaseGone(EtcdError):
    """The lease expired or was revoked: its keys are deleted."""


def encode_bytes(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def decode_bytes(value: object, *, field: str) -> bytes:
    if not isinstance(value, str):
        raise EtcdProtocolError(f"{field}: expected base64 text, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise EtcdProtocolError(f"{field}: not base64: {value[:40]!r}") from None


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with `prefix`.

    etcd's rule: the prefix with its last byte below 0xff incremented and the rest dropped;
    ``\\0`` (every key) when no byte can be incremented.
    """
    for i in range(len(prefix) - 1, -1, -1):
        if prefix[i] < 0xFF:
            return prefix[:i] + bytes([prefix[i] + 1])
    return b"\0"


def _int(data: Json, key: str, *, where: str, default: int | None = None) -> int:
    """A 64-bit integer field, sent as a JSON string (or left out when zero)."""
    value = data.get(key)
    if value is None:
        if default is None:
            raise EtcdProtocolError(f"{where}.{key}: missing")
        return default
    if isinstance(value, bool):
        raise EtcdProtocolError(f"{where}.{key}: expected an integer, got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise EtcdProtocolError(f"{where}.{key}: expected an integer, got {value!r}")


def _object(data: object, *, where: str) -> Json:
    if not isinstance(data, dict):
        raise EtcdProtocolError(f"{where}: expected an object, got {type(data).__name__}")
    return data


# ---- requests ----


def put_body(key: bytes, value: bytes, *, lease: int | None = None) -> Json:
    body: Json = {"key": encode_bytes(key), "value": encode_bytes(value)}
    if lease is not None:
        body["lease"] = str(lease)
    return body


def range_body(key: bytes, *, prefix: bool = False) -> Json:
    body: Json = {"key": encode_bytes(key)}
    if prefix:
        body["range_end"] = encode_bytes(prefix_end(key))
    return body


def delete_body(key: bytes) -> Json:
    return {"key": encode_bytes(key)}


def grant_body(ttl_s: int) -> Json:
    return {"TTL": str(ttl_s)}


def lease_body(lease: int) -> Json:
    return {"ID": str(lease)}


def create_if_absent_body(key: bytes, value: bytes, *, lease: int | None = None) -> Json:
    """A transaction that puts `key` only if it does not exist (its create revision is 0)."""
    return {
        "compare": [
            {
                "key": encode_bytes(key),
                "target": "CREATE",
                "result": "EQUAL",
                "create_revision": "0",
            }
        ],
        "success": [{"request_put": put_body(key, value, lease=lease)}],
    }


def watch_body(prefix: bytes, *, start_revision: int) -> Json:
    """Watch every key under `prefix` from `start_revision` on (deleted keys' values too)."""
    return {
        "create_request": {
            "key": encode_bytes(prefix),
            "range_end": encode_bytes(prefix_end(prefix)),
            "start_revision": str(start_revision),
            "prev_kv": True,
        }
    }


# ---- answers ----


@attrs.frozen(kw_only=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int = 0

    @classmethod
    def parse(cls, data: object, *, where: str) -> KeyValue:
        kv = _object(data, where=where)
        return cls(
            key=decode_bytes(kv.get("key"), field=f"{where}.key"),
            value=decode_bytes(kv.get("value", ""), field=f"{where}.value"),
            mod_revision=_int(kv, "mod_revision", where=where, default=0),
            lease=_int(kv, "lease", where=where, default=0),
        )


def check_error(data: object) -> Json:
    """The answer object, or EtcdError with etcd's own message when it is an error body."""
    body = _object(data, where="$")
    if "error" in body or ("code" in body and "message" in body):
        message = str(body.get("message") or body.get("error"))
        if "lease not found" in message:  # a put or keepalive naming an expired lease
            raise LeaseGone(f"etcd: {message}")
        raise EtcdError(f"etcd: {message}")
    return body


def parse_revision(data: object) -> int:
    """The store revision from any answer's ``header``."""
    body = check_error(data)
    header = _object(body.get("header", {}), where="$.header")
    return _int(header, "revision", where="$.header", default=0)


@attrs.frozen(kw_only=True)
class RangeAnswer:
    revision: int
    kvs: tuple[KeyValue, ...]

    @classmethod
    def parse(cls, data: object) -> RangeAnswer:
        body = check_error(data)
        kvs = body.get("kvs", [])
        if not isinstance(kvs, list):
            raise EtcdProtocolError("$.kvs: expected a list")
        return cls(
            revision=parse_revision(body),
            kvs=tuple(KeyValue.parse(kv, where=f"$.kvs[{i}]") for i, kv in enumerate(kvs)),
        )


def parse_grant(data: object) -> tuple[int, int]:
    """(lease id, granted TTL in seconds)."""
    body = check_error(data)
    return _int(body, "ID", where="$"), _int(body, "TTL", where="$")


def parse_keepalive(data: object) -> int:
    """The lease's renewed TTL. Raises LeaseGone when the lease no longer exists.

    The gateway wraps the streaming keepalive's answer in ``result``; a lease that expired
    answers with its id and no TTL (TTL 0 is left out of the JSON).
    """
    body = check_error(data)
    result = _object(body.get("result", body), where="$.result")
    ttl = _int(result, "TTL", where="$.result", default=0)
    if ttl <= 0:
        raise LeaseGone(f"lease {result.get('ID', '?')} expired or was revoked")
    return ttl


def parse_txn_succeeded(data: object) -> bool:
    return bool(check_error(data).get("succeeded", False))


class EventType(enum.Enum):
    PUT = "PUT"
    DELETE = "DELETE"


@attrs.frozen(kw_only=True)
class WatchEvent:
    type: EventType
    key: bytes
    value: bytes
    """The new value of a PUT; the last value of a deleted key (``prev_kv``), or b"" if unknown."""
    revision: int


@attrs.frozen(kw_only=True)
class WatchBatch:
    """One line of a watch stream: its events (in order) and the revision they bring us to."""

    revision: int
    events: tuple[WatchEvent, ...] = ()
    created: bool = False
    canceled: bool = False
    cancel_reason: str = ""
    compact_revision: int = 0


def parse_watch_line(line: str | bytes) -> WatchBatch:
    """One line of the ``/v3/watch`` stream.

    Raises:
        EtcdError: the line is an error object (the stream broke on the server's side).
        EtcdProtocolError: the line is not JSON, or its fields are not etcd's.
    """
    try:
        data = json.loads(line)
    except ValueError:
        raise EtcdProtocolError(f"watch: a line that is not JSON: {str(line)[:80]!r}") from None
    body = check_error(data)
    result = _object(body.get("result"), where="$.result")
    header = _object(result.get("header", {}), where="$.result.header")
    raw_events = result.get("events", [])
    if not isinstance(raw_events, list):
        raise EtcdProtocolError("$.result.events: expected a list")
    events = []
    for i, raw in enumerate(raw_events):
        where = f"$.result.events[{i}]"
        event = _object(raw, where=where)
        kind = event.get("type", "PUT")  # PUT is the enum's zero value: left out
        if kind not in ("PUT", "DELETE"):
            raise EtcdProtocolError(f"{where}.type: expected PUT or DELETE, got {kind!r}")
        kv = KeyValue.parse(event.get("kv"), where=f"{where}.kv")
        value = kv.value
        if kind == "DELETE":
            prev = event.get("prev_kv")
            value = KeyValue.parse(prev, where=f"{where}.prev_kv").value if prev else b""
        events.append(
            WatchEvent(type=EventType(kind), key=kv.key, value=value, revision=kv.mod_revision)
        )
    return WatchBatch(
        revision=_int(header, "revision", where="$.result.header", default=0),
        events=tuple(events),
        created=bool(result.get("created", False)),
        canceled=bool(result.get("canceled", False)),
        cancel_reason=str(result.get("cancel_reason", "")),
        compact_revision=_int(result, "compact_revision", where="$.result", default=0),
    )
