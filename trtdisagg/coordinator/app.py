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

import logging
import os
from typing import Any, Final, cast

from quart import Response, request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection

from trtdisagg import __version__
from trtdisagg.api.codec import parse_json
from trtdisagg.api.errors import ApiError
from trtdisagg.api.http import error_response, install_common_handlers, json_response
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
    install_common_handlers(app, max_body_bytes=max_body_bytes, api_key=api_key)
    app.config["RESPONSE_TIMEOUT"] = None  # streams end by the request deadline, not quart's
    app.config["BODY_TIMEOUT"] = 60
    placement = service.placement

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
        # With servers from etcd, "membership" says whether this front end still hears etcd;
        # one that lost it serves its last known servers (200 while it has some) and says so.
        membership = placement.membership_status()
        extra = {"membership": membership} if membership is not None else {}
        if placement.is_ready():
            return json_response({"status": "ok", "pid": os.getpid(), **extra})
        reason = placement.not_ready_reason()
        body = {"status": "not ready", "reason": reason, "pid": os.getpid(), **extra}
        return json_response(body, 503)

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
