"""The coordinator's HTTP routes (quart-trio). No policy: JSON in, `DisaggService`, JSON/SSE out.

Errors become OpenAI error bodies here and only here:

=====================================  ======
ApiError (bad body, names the field)   its own status (400, 401, 404, 413)
UpstreamRejected (a worker's 4xx)      the worker's status and body, unchanged
NotReady / NoServerAvailable /
CoordinatorUnavailable                 503
UpstreamError (unreachable, 5xx, bad)  502
RequestTimeout                         504
anything else                          500
=====================================  ======
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Final, cast

from quart import Response, request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from trtdisagg import __version__
from trtdisagg.api.codec import parse_json
from trtdisagg.api.errors import ApiError
from trtdisagg.coordinator.metrics import CONTENT_TYPE, CoordinatorMetrics
from trtdisagg.coordinator.placement import CoordinatorUnavailable
from trtdisagg.coordinator.relay import ReplyBody
from trtdisagg.coordinator.routers import NoServerAvailable
from trtdisagg.coordinator.service import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    DisaggService,
    Endpoint,
    JsonReply,
    RequestTimeout,
)
from trtdisagg.coordinator.upstream import UpstreamError, UpstreamRejected

log = logging.getLogger(__name__)

_BODIES_KEY: Final = "trtdisagg.reply_bodies"
FORWARDED_HEADERS: Final = ("Authorization",)


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def json_response(value: Any, status: int = 200) -> Response:
    return Response(dumps(value), status=status, content_type="application/json")


def error_response(exc: ApiError) -> Response:
    return json_response(exc.to_json(), exc.status)


class _ClosingConnection(TrioASGIHTTPConnection):
    """Closes streaming bodies a handler produced, even when the response never started.

    quart closes a body only from inside its send loop; if the client disconnects between the
    handler returning and the loop starting, the body (holding an upstream stream and a gen
    reservation) would be dropped unclosed. Bodies are registered in the ASGI scope by the route
    and closed here, after the request task ends for any reason. Closing is idempotent.
    """

    async def handle_request(  # type: ignore[override]  # quart-trio's own signature
        self, nursery: Any, request: Any, send: Any
    ) -> None:
        try:
            await super().handle_request(nursery, request, send)
        finally:
            scope = cast(dict[str, Any], self.scope)
            bodies: list[ReplyBody] = scope.get(_BODIES_KEY, [])
            for body in bodies:
                await body.aclose()


class CoordinatorApp(QuartTrio):
    asgi_http_class = _ClosingConnection


def create_app(
    service: DisaggService,
    *,
    metrics: CoordinatorMetrics,
    api_key: str | None,
    max_body_bytes: int,
) -> QuartTrio:
    app = CoordinatorApp(__name__)
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # streams end by the request deadline, not quart's
    app.config["BODY_TIMEOUT"] = 60
    placement = service.placement

    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError) -> Response:
        return error_response(exc)

    @app.errorhandler(UpstreamRejected)
    async def rejected(exc: UpstreamRejected) -> Response:
        return json_response(exc.json_body(), exc.status)

    @app.errorhandler(UpstreamError)
    async def upstream(exc: UpstreamError) -> Response:
        return error_response(ApiError(502, f"upstream failure: {exc}"))

    @app.errorhandler(NoServerAvailable)
    async def no_server(exc: NoServerAvailable) -> Response:
        return error_response(ApiError(503, str(exc)))

    @app.errorhandler(CoordinatorUnavailable)
    async def unavailable(exc: CoordinatorUnavailable) -> Response:
        return error_response(ApiError(503, str(exc)))

    @app.errorhandler(RequestTimeout)
    async def timeout(exc: RequestTimeout) -> Response:
        return error_response(ApiError(504, str(exc)))

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        message = {
            404: f"route {request.path} not found",
            405: f"method {request.method} not allowed on {request.path}",
            413: f"request body exceeds {max_body_bytes} bytes",
        }.get(status, exc.description or exc.name)
        return error_response(ApiError(status, message))

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.before_request
    async def authorize() -> Response | None:
        if api_key is None or not request.path.startswith("/v1/"):
            return None
        if request.headers.get("Authorization", "") != f"Bearer {api_key}":
            return error_response(ApiError(401, "missing or invalid API key"))
        return None

    async def serve(endpoint: Endpoint) -> Response:
        data = await request.get_data(cache=False, as_text=False)
        raw = parse_json(data if isinstance(data, bytes) else data.encode())
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        reply = await service.handle(endpoint, raw, headers)
        if isinstance(reply, JsonReply):
            return json_response(reply.body, reply.status)
        cast(dict[str, Any], request.scope).setdefault(_BODIES_KEY, []).append(reply.body)
        response = Response(reply.body, content_type="text/event-stream")
        response.headers["Cache-Control"] = "no-cache"
        response.timeout = None
        return response

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await serve(COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await serve(CHAT_COMPLETIONS)

    @app.get("/health")
    async def health() -> Response:
        if placement.is_ready():
            return json_response({"status": "ok", "pid": os.getpid()})
        reason = placement.not_ready_reason()
        return json_response({"status": "not ready", "reason": reason, "pid": os.getpid()}, 503)

    @app.get("/cluster_info")
    async def cluster_info() -> Response:
        return json_response(placement.cluster_info())

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": __version__})

    @app.get("/v1/models")
    async def models() -> Response:
        info = placement.model_info()
        if info is None or info.model is None:
            raise ApiError(503, "no healthy server to read the served model from")
        model = {"id": info.model, "object": "model", "owned_by": "trtdisagg"}
        return json_response({"object": "list", "data": [model]})

    @app.get("/metrics")
    @app.get("/prometheus/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), content_type=CONTENT_TYPE)

    return app
