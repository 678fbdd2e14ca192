"""HTTP to the workers: one `httpx.AsyncClient` per process.

Every transport failure becomes one typed error, so the service decides retries on types, not on
httpx internals:

* `UpstreamUnreachable`: refused, reset, or died mid-answer (retryable; the server is suspect);
* `UpstreamFailed`: answered 5xx (retryable);
* `UpstreamRejected`: answered 4xx (passed to the client as is; never retried);
* `UpstreamProtocolError` (from `split`): a 2xx body the coordinator cannot use (retryable).

Deadlines are set by the caller with Trio cancel scopes (the request's `request_timeout`); the
httpx timeouts here are a backstop a little longer than that.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Final

import attrs
import httpx

from trtdisagg.errors import TrtDisaggError

Json = dict[str, Any]

ERROR_BODY_LIMIT: Final = 2048
HEALTH_REASON_LIMIT: Final = 300
KEEPALIVE_EXPIRY: Final = 30.0
"""Idle pooled connections are closed after this; workers' and our servers' keep-alive is 75 s."""


class UpstreamError(TrtDisaggError):
    """A leg failed at `server`; `retryable` says whether another server may succeed."""

    retryable: bool = True

    def __init__(self, message: str, *, server: str, role: str) -> None:
        super().__init__(message)
        self.server = server
        self.role = role


class UpstreamUnreachable(UpstreamError):
    """No HTTP answer. `sent`: the request may have reached the server (the connection broke or
    timed out after it was made), so the server may have acted on it."""

    def __init__(self, message: str, *, server: str, role: str, sent: bool = True) -> None:
        super().__init__(message, server=server, role=role)
        self.sent = sent


class UpstreamFailed(UpstreamError):
    def __init__(self, message: str, *, server: str, role: str, status: int) -> None:
        super().__init__(message, server=server, role=role)
        self.status = status


class UpstreamRejected(UpstreamError):
    """A 4xx answer: the request itself is at fault, so it goes back to the client unchanged."""

    retryable = False

    def __init__(self, *, server: str, role: str, status: int, body: bytes) -> None:
        super().__init__(f"{role} server {server} answered {status}", server=server, role=role)
        self.status = status
        self.body = body[:ERROR_BODY_LIMIT]

    def json_body(self) -> Json:
        """The worker's error body when it is OpenAI-shaped JSON, else one built around it."""
        try:
            data = json.loads(self.body)
        except ValueError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            return data
        text = self.body.decode(errors="replace")
        return {"error": {"message": text, "type": "invalid_request_error", "code": self.status}}


POOL_SHARDS: Final = 8
"""Connection pools per client (`ShardedTransport`)."""


class ShardedTransport(httpx.AsyncBaseTransport):
    """Requests spread round-robin over `shards` independent connection pools.

    httpcore 1.0's pool does work proportional to (queued requests x pooled connections) at
    every request's start and end (encode/httpcore#1035). With 64 requests in flight through the
    coordinator, that bookkeeping was about a third of its CPU (a cProfile under
    `tools/bench_frontend.py`). Each of K pools holds about 1/K of the connections and requests,
    so the work falls by about K; keep-alive reuse works within each pool as before.
    """

    def __init__(self, *, shards: int, limits: httpx.Limits) -> None:
        def share(total: int | None) -> int | None:
            return None if total is None else max(1, -(-total // shards))

        per_shard = httpx.Limits(
            max_connections=share(limits.max_connections),
            max_keepalive_connections=share(limits.max_keepalive_connections),
            keepalive_expiry=limits.keepalive_expiry,
        )
        # One TLS context for all (making one loads the CA bundle: ~15-50 ms each).
        tls = httpx.create_ssl_context()
        self._pools = [
            httpx.AsyncHTTPTransport(limits=per_shard, verify=tls) for _ in range(shards)
        ]
        self._turn = itertools.count()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        pool = self._pools[next(self._turn) % len(self._pools)]
        return await pool.handle_async_request(request)

    async def aclose(self) -> None:
        for pool in self._pools:
            await pool.aclose()


def make_http_client(*, timeout: float, max_connections: int = 1024) -> httpx.AsyncClient:
    """The process's one client. Keep-alive connections are reused across requests; the pool is
    large because every in-flight stream holds one connection (a small pool queues requests
    behind streams, as TensorRT-LLM found with aiohttp's default of 100). It is split into
    `POOL_SHARDS` pools (`ShardedTransport`)."""
    limits = httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=256,
        keepalive_expiry=KEEPALIVE_EXPIRY,
    )
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout + 5.0, connect=min(10.0, timeout)),
        transport=ShardedTransport(shards=POOL_SHARDS, limits=limits),
        trust_env=False,
    )


@attrs.frozen(kw_only=True)
class HealthCheck:
    ok: bool
    reason: str = ""  # why not healthy
    answered: bool = True  # False: no HTTP answer at all (refused, reset, timed out)
    boot_id: str | None = None  # a healthy worker's start (None: it named none)


def _describe(exc: httpx.TransportError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


@attrs.define(eq=False, kw_only=True)
class WorkerClient:
    """Calls to one role's servers; `role` only labels errors ("context", "generation")."""

    http: httpx.AsyncClient
    api_key: str | None = attrs.field(default=None, repr=False)  # a secret: never in a repr
    """Sent on the coordinator's own POSTs (`/kv_cache_events`): with an API key, every POST
    route of a worker needs it. A client's requests carry the client's own key instead."""

    async def post_json(
        self, url: str, path: str, body: Json, *, role: str, headers: dict[str, str] | None = None
    ) -> Json:
        """POST a JSON body and return the JSON answer of a 200.

        Raises:
            UpstreamUnreachable, UpstreamFailed, UpstreamRejected, UpstreamError (not JSON).
        """
        try:
            response = await self.http.post(url + path, json=body, headers=headers)
        except httpx.TransportError as exc:
            raise UpstreamUnreachable(
                f"{role} server {url} unreachable: {_describe(exc)}",
                server=url,
                role=role,
                sent=not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)),
            ) from None
        _check_status(response.status_code, response.content, url=url, role=role)
        try:
            data = response.json()
        except ValueError:
            raise UpstreamError(
                f"{role} server {url}: answer is not JSON", server=url, role=role
            ) from None
        if not isinstance(data, dict):
            raise UpstreamError(
                f"{role} server {url}: answer is not an object", server=url, role=role
            )
        return data

    async def open_stream(
        self, url: str, path: str, body: Json, *, role: str, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        """POST and return the open streaming response of a 200; the caller must `aclose()` it.

        Raises:
            as `post_json`; a non-200 answer is read whole and closed first.
        """
        request = self.http.build_request("POST", url + path, json=body, headers=headers)
        try:
            response = await self.http.send(request, stream=True)
        except httpx.TransportError as exc:
            raise UpstreamUnreachable(
                f"{role} server {url} unreachable: {_describe(exc)}", server=url, role=role
            ) from None
        if response.status_code != 200:
            try:
                content = await response.aread()
            except httpx.TransportError:
                content = b""
            finally:
                await response.aclose()
            _check_status(response.status_code, content, url=url, role=role)
        return response

    async def get_json(self, url: str, path: str, *, limit_s: float, role: str) -> Json:
        data = await self._json(url, path, method="GET", limit_s=limit_s, role=role)
        if not isinstance(data, dict):
            raise UpstreamError(f"{url}{path}: answer is not an object", server=url, role=role)
        return data

    async def is_healthy(self, url: str, *, limit_s: float) -> HealthCheck:
        """``GET /health``; never raises for transport errors."""
        try:
            response = await self.http.get(url + "/health", timeout=limit_s)
        except httpx.TransportError as exc:
            return HealthCheck(ok=False, reason=_describe(exc), answered=False)
        if response.status_code == 200:
            return HealthCheck(ok=True, boot_id=_health_field(response.content, "boot_id"))
        reason = f"/health answered {response.status_code}"
        why = _health_reason(response.content)
        return HealthCheck(ok=False, reason=f"{reason}: {why}" if why else reason)

    async def post_for_json(
        self, url: str, path: str, *, limit_s: float, role: str, body: object = None
    ) -> object:
        """POST `body` (none when None) and return any JSON answer (``/kv_cache_events``)."""
        return await self._json(url, path, method="POST", limit_s=limit_s, role=role, body=body)

    async def _json(
        self, url: str, path: str, *, method: str, limit_s: float, role: str, body: object = None
    ) -> object:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            response = await self.http.request(
                method, url + path, timeout=limit_s, headers=headers, json=body
            )
        except httpx.TransportError as exc:
            raise UpstreamUnreachable(
                f"{role} server {url} unreachable: {_describe(exc)}", server=url, role=role
            ) from None
        _check_status(response.status_code, response.content, url=url, role=role)
        try:
            return response.json()
        except ValueError:
            raise UpstreamError(f"{url}{path}: answer is not JSON", server=url, role=role) from None


def _health_reason(content: bytes) -> str:
    """The `reason` a worker gives with an unhealthy answer (`{"status": "unhealthy", "reason":
    ...}`), so that the coordinator's log says why; "" when there is none."""
    return _health_field(content, "reason") or ""


def _health_field(content: bytes, name: str) -> str | None:
    """A string field of a /health answer, cut to HEALTH_REASON_LIMIT; None when there is none
    (or the answer is no JSON object, or too long to read)."""
    if len(content) > ERROR_BODY_LIMIT:
        return None
    try:
        body = json.loads(content)
    except ValueError:
        return None
    value = body.get(name) if isinstance(body, dict) else None
    return value[:HEALTH_REASON_LIMIT] if isinstance(value, str) else None


def _check_status(status: int, content: bytes, *, url: str, role: str) -> None:
    if status == 200:
        return
    if 400 <= status < 500:
        raise UpstreamRejected(server=url, role=role, status=status, body=content)
    snippet = content[:300].decode(errors="replace")
    raise UpstreamFailed(
        f"{role} server {url} answered {status}: {snippet}", server=url, role=role, status=status
    )
