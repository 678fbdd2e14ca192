"""The coordinator's HTTP routes (quart-trio). No policy: JSON in, `DisaggService`, JSON/SSE out.

Errors become OpenAI error bodies here and only here:

=====================================  ======
ApiError (bad body, names the field)   its own status (400, 401, 404, 413)
UpstreamRejected (a worker's 4xx)      the worker's status and body, unchanged
NotReady / NoServerAvailable /
CoordinatorUnavailable                 503
UpstreamError (unreachable, 5xx, bad)  502
DeadlineMissed (a phase deadline)      504
RequestTimeout                         504
anything else                          500
=====================================  ======
"""

from __future__ import annotations

import logging
import os
import time
from typing import Final

from quart import Response, request
from quart_trio import QuartTrio

from trtdisagg import __version__
from trtdisagg.api.codec import parse_request
from trtdisagg.api.errors import ApiError
from trtdisagg.api.http import (
    ClosingQuartTrio,
    close_with_exchange,
    error_response,
    install_common_handlers,
    json_body,
    json_response,
    model_not_found,
    model_object,
)
from trtdisagg.api.responses_api import (
    ResponsesRequest,
    as_responses_error,
    chat_body,
    responses_rejection,
)
from trtdisagg.api.responses_events import ResponseHead, ResponsesStream, response_body
from trtdisagg.api.streaming import ResponsesBody
from trtdisagg.coordinator.forward import forward
from trtdisagg.coordinator.metrics import CONTENT_TYPE, CoordinatorMetrics
from trtdisagg.coordinator.placement import CoordinatorUnavailable, Placement
from trtdisagg.coordinator.relay import ReplyBody
from trtdisagg.coordinator.replies import CHAT_COMPLETIONS, COMPLETIONS, Endpoint, JsonReply
from trtdisagg.coordinator.resume import DeadlineMissed
from trtdisagg.coordinator.routers import NoServerAvailable
from trtdisagg.coordinator.service import DisaggService, RequestTimeout
from trtdisagg.coordinator.upstream import UpstreamError, UpstreamRejected

log = logging.getLogger(__name__)

FORWARDED_HEADERS: Final = ("Authorization",)


def create_app(
    service: DisaggService,
    *,
    metrics: CoordinatorMetrics,
    api_key: str | None,
    max_body_bytes: int,
) -> QuartTrio:
    app = ClosingQuartTrio(__name__)
    started = int(time.time())
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

    @app.errorhandler(DeadlineMissed)
    async def deadline_missed(exc: DeadlineMissed) -> Response:
        return error_response(ApiError(504, f"upstream deadline missed: {exc}"))

    @app.errorhandler(NoServerAvailable)
    async def no_server(exc: NoServerAvailable) -> Response:
        return error_response(ApiError(503, str(exc)))

    @app.errorhandler(CoordinatorUnavailable)
    async def unavailable(exc: CoordinatorUnavailable) -> Response:
        return error_response(ApiError(503, str(exc)))

    @app.errorhandler(RequestTimeout)
    async def timeout(exc: RequestTimeout) -> Response:
        return error_response(ApiError(504, str(exc)))

    def forwarded() -> dict[str, str]:
        return {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}

    def sse(body: ReplyBody) -> Response:
        close_with_exchange(body)
        response = Response(body, content_type="text/event-stream")
        response.headers["Cache-Control"] = "no-cache"
        response.timeout = None
        return response

    async def serve(endpoint: Endpoint) -> Response:
        reply = await service.handle(endpoint, await json_body(), forwarded())
        if isinstance(reply, JsonReply):
            return json_response(reply.body, reply.status)
        return sse(reply.body)

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await serve(COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await serve(CHAT_COMPLETIONS)

    @app.post("/tokenize")
    async def tokenize() -> Response:
        return json_response(await forward(service, "/tokenize", await json_body(), forwarded()))

    @app.post("/detokenize")
    async def detokenize() -> Response:
        answer = await forward(service, "/detokenize", await json_body(), forwarded())
        return json_response(answer)

    @app.post("/v1/responses")
    async def responses() -> Response:
        """Served as a chat completion (split like any), its answer told as a Response."""
        asked = parse_request(await json_body(), ResponsesRequest)
        with as_responses_error():
            chat = chat_body(asked)
            try:
                reply = await service.handle(CHAT_COMPLETIONS, chat, forwarded())
            except UpstreamRejected as exc:
                return json_response(responses_rejection(exc.json_body()), exc.status)
        info = placement.model_info()
        model = asked.model or (info.model if info is not None else None) or ""
        head = ResponseHead.of(asked, created_at=int(time.time()), model=model)
        if isinstance(reply, JsonReply):
            return json_response(response_body(head, reply.body), reply.status)
        return sse(ResponsesBody(inner=reply.body, stream=ResponsesStream(head=head)))

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

    def model_card() -> dict[str, object]:
        info = placement.model_info()
        if info is None or info.model is None:
            raise ApiError(503, "no healthy server to read the served model from")
        return model_object(info.model, created=started, max_len=_max_model_len(placement))

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        card = model_card()
        if model_id != card["id"]:
            raise model_not_found(model_id, str(card["id"]))
        return json_response(card)

    @app.get("/metrics")
    @app.get("/prometheus/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(placement.cluster_info()), content_type=CONTENT_TYPE)

    return app


def _max_model_len(placement: Placement) -> int | None:
    """The smallest context among the servers a request may go to (they may differ)."""
    lists = placement.cluster_info().get("server_lists") or {}
    urls = [url for role in ("context", "generation") for url in lists.get(role) or []]
    lengths = [
        info.max_seq_len
        for info in map(placement.server_info, urls)
        if info is not None and info.max_seq_len is not None
    ]
    if lengths:
        return min(lengths)
    info = placement.model_info()
    return info.max_seq_len if info is not None else None
