"""The worker's HTTP routes (quart-trio): JSON in, executor commands, JSON or SSE out.

No policy lives here. Parsing and validation go through `trtdisagg.api.codec`; generation goes
through `WorkerService`; errors become OpenAI error bodies in one handler.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from trtdisagg import __version__
from trtdisagg.api.codec import parse_json, structure_body, to_json, validate_request
from trtdisagg.api.errors import ApiError
from trtdisagg.api.protocol import ChatCompletionRequest, CompletionRequest
from trtdisagg.metrics import CONTENT_TYPE
from trtdisagg.worker.service import WorkerService

log = logging.getLogger(__name__)

OPENAI_ROUTES = ("/v1/",)


def _error_response(exc: ApiError) -> Response:
    return Response(_dumps(exc.to_json()), status=exc.status, content_type="application/json")


def _dumps(value: Any) -> str:
    import json

    return json.dumps(value, separators=(",", ":"))


def _json(value: Any, status: int = 200) -> Response:
    return Response(_dumps(value), status=status, content_type="application/json")


def create_app(service: WorkerService) -> QuartTrio:
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = service.config.max_request_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60

    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError) -> Response:
        return _error_response(exc)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        message = {
            404: f"route {request.path} not found",
            405: f"method {request.method} not allowed on {request.path}",
            413: f"request body exceeds {service.config.max_request_body_bytes} bytes",
        }.get(status, exc.description or exc.name)
        return _error_response(ApiError(status, message))

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.before_request
    async def authorize() -> Response | None:
        key = service.config.api_key
        if key is None or not request.path.startswith(OPENAI_ROUTES):
            return None
        if request.headers.get("Authorization", "") != f"Bearer {key}":
            return _error_response(ApiError(401, "missing or invalid API key"))
        return None

    @app.get("/health")
    async def health() -> Response:
        if service.ready:
            return _json({"status": "ok"})
        return _json({"status": "starting"}, status=503)

    @app.get("/version")
    async def version() -> Response:
        return _json({"version": __version__})

    @app.get("/metrics")
    @app.get("/prometheus/metrics")
    async def metrics() -> Response:
        return Response(service.render_metrics(), content_type=CONTENT_TYPE)

    @app.get("/server_info")
    async def server_info() -> Response:
        return _json(to_json(service.server_info()))

    @app.post("/kv_cache_events")
    async def kv_cache_events() -> Response:
        return _json(service.drain_kv_events())

    @app.get("/debug/kv_digests")
    async def kv_digests() -> Response:
        hooks = service.executor.test_hooks
        if hooks is None:
            raise ApiError(404, f"route {request.path} not found")
        return _json({str(key): digest for key, digest in hooks.digests.items()})

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": service.served_model_name,
                        "object": "model",
                        "created": int(service.started_at),
                        "owned_by": "trtdisagg",
                        "max_model_len": service.max_seq_len,
                    }
                ],
            }
        )

    @app.post("/v1/completions")
    async def completions() -> Response:
        body = parse_json(await request.get_data(cache=False, as_text=False))
        req = structure_body(body, CompletionRequest)
        validate_request(req)
        return await _generate(service, req)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        body = parse_json(await request.get_data(cache=False, as_text=False))
        req = structure_body(body, ChatCompletionRequest)
        validate_request(req)
        return await _generate(service, req)

    return app


async def _generate(
    service: WorkerService, req: CompletionRequest | ChatCompletionRequest
) -> Response:
    started = time.time()
    job = service.start(req)
    # ctx answers context_only once, whole: the coordinator needs its params, not a stream.
    if req.stream and job.transfer_key is None:
        response = Response(job.stream(), content_type="text/event-stream")
        response.headers["Cache-Control"] = "no-cache"
        response.timeout = None
        return response
    body = await job.collect()
    log.debug("request %d done in %.3fs", job.request_id, time.time() - started)
    return _json(body)
