"""The worker's HTTP routes (quart-trio): JSON in, executor commands, JSON or SSE out.

No policy lives here. Parsing and validation go through `trtdisagg.api.codec`; generation goes
through `WorkerService`; errors become OpenAI error bodies in one handler.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from quart import Response, request
from quart.wrappers.response import ResponseBody
from quart_trio import QuartTrio

from trtdisagg import __version__
from trtdisagg.api.codec import parse_json, parse_request, structure_body, to_json
from trtdisagg.api.errors import ApiError, bad_request
from trtdisagg.api.http import (
    ClosingQuartTrio,
    close_with_exchange,
    install_common_handlers,
    json_body,
    json_response,
    model_not_found,
    model_object,
)
from trtdisagg.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    KvEventsRead,
    KvRelease,
)
from trtdisagg.api.responses_api import ResponsesRequest, as_responses_error, chat_body
from trtdisagg.api.responses_events import ResponseHead, ResponsesStream, response_body
from trtdisagg.api.streaming import ResponsesBody
from trtdisagg.api.tokenize import detokenize, model_of, tokenize
from trtdisagg.metrics import CONTENT_TYPE
from trtdisagg.worker.http.service import WorkerService

if TYPE_CHECKING:
    from trtdisagg.faults.spec import FaultInjector

log = logging.getLogger(__name__)


def create_app(service: WorkerService) -> QuartTrio:
    app = ClosingQuartTrio(__name__)
    install_common_handlers(
        app, max_body_bytes=service.config.max_request_body_bytes, api_key=service.config.api_key
    )
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60

    @app.get("/health")
    async def health() -> Response:
        stopped = service.engine.stopped
        if stopped is not None:  # for good: its model steps kept failing (executor.py)
            return json_response({"status": "unhealthy", "reason": stopped}, status=503)
        if service.ready:
            return json_response({"status": "ok", "boot_id": service.boot_id})
        return json_response({"status": "starting"}, status=503)

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": __version__})

    @app.get("/metrics")
    @app.get("/prometheus/metrics")
    async def metrics() -> Response:
        return Response(await service.render_metrics(), content_type=CONTENT_TYPE)

    @app.get("/server_info")
    async def server_info() -> Response:
        return json_response(to_json(service.server_info()))

    @app.post("/kv_cache_events")
    async def kv_cache_events() -> Response:
        raw = await request.get_data(cache=False, as_text=False)
        if not raw.strip():
            return json_response(await service.drain_kv_events())
        read = structure_body(parse_json(raw), KvEventsRead)
        if read.after < -1:
            raise bad_request(f"after: must be an event id or -1, got {read.after}", param="after")
        return json_response(await service.drain_kv_events(read.after))

    @app.get("/debug/kv_digests")
    async def kv_digests() -> Response:
        if not service.engine.has_test_hooks:
            raise ApiError(404, f"route {request.path} not found")
        digests = await service.engine.kv_digests()
        return json_response({str(key): digest for key, digest in digests.items()})

    @app.post("/debug/step_failures")
    async def step_failures() -> Response:
        """Make the next `count` model steps raise: body `{"count": 1}` (test hooks only)."""
        if not service.engine.has_test_hooks:
            raise ApiError(404, f"route {request.path} not found")
        body = parse_json(await request.get_data(cache=False, as_text=False))
        count = body.get("count") if isinstance(body, dict) else None
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= 1000:
            raise bad_request("count: required, an integer in [0, 1000]", param="count")
        await service.engine.fail_steps(count)
        log.warning("the next %d model steps will fail on purpose (test hooks)", count)
        return json_response({"step_failures": count})

    @app.get("/debug/faults")
    async def faults_state() -> Response:
        return json_response(to_json(_armed_faults(service).statistics()))

    @app.post("/debug/faults")
    async def faults_replace() -> Response:
        """Replace the armed fault plan: body `{"spec": "drop:TRANSFER_RESULT:1"}`."""
        from trtdisagg.faults.spec import FaultSpecError, parse_faults  # armed: tests only

        faults = _armed_faults(service)
        body = parse_json(await request.get_data(cache=False, as_text=False))
        spec = body.get("spec") if isinstance(body, dict) else None
        if not isinstance(spec, str):
            raise bad_request("spec: required, a fault spec string", param="spec")
        try:
            plan = parse_faults(spec)
        except FaultSpecError as exc:
            raise bad_request(f"spec: {exc}", param="spec") from None
        faults.replace(plan)
        log.warning("fault plan replaced: %s", plan)
        return json_response(to_json(faults.statistics()))

    @app.post("/disagg/release")
    async def release_kv() -> Response:
        body = parse_json(await request.get_data(cache=False, as_text=False))
        ask = structure_body(body, KvRelease)
        released = await service.release_send(ask)
        return json_response({"transfer_key": ask.key, "released": released})

    def model_card() -> dict[str, object]:
        return model_object(
            service.served_model_name, created=int(service.started_at), max_len=service.max_seq_len
        )

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        if model_id != service.served_model_name:
            raise model_not_found(model_id, service.served_model_name)
        return json_response(model_card())

    def served(body: object) -> object:
        model = model_of(body)
        if model is not None and model != service.served_model_name:
            raise model_not_found(model, service.served_model_name)
        return body

    @app.post("/tokenize")
    async def tokenize_route() -> Response:
        body = served(await json_body())
        return json_response(tokenize(body, service.tokenizer, max_model_len=service.max_seq_len))

    @app.post("/detokenize")
    async def detokenize_route() -> Response:
        return json_response(detokenize(served(await json_body()), service.tokenizer))

    @app.post("/v1/completions")
    async def completions() -> Response:
        req = parse_request(await json_body(), CompletionRequest)
        return await _generate(service, req)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        req = parse_request(await json_body(), ChatCompletionRequest)
        return await _generate(service, req)

    @app.post("/v1/responses")
    async def responses() -> Response:
        asked = parse_request(await json_body(), ResponsesRequest)
        with as_responses_error():
            req = parse_request(chat_body(asked), ChatCompletionRequest)
            job = await service.start(req)
        close_with_exchange(job)  # its requests end with the exchange, answered or not
        head = ResponseHead.of(asked, created_at=int(time.time()), model=service.served_model_name)
        if req.stream:
            return _sse(ResponsesBody(inner=job.stream_body(), stream=ResponsesStream(head=head)))
        with as_responses_error():
            return json_response(response_body(head, await job.collect()))

    return app


def _armed_faults(service: WorkerService) -> FaultInjector:
    """The worker's fault injector; without TRTDISAGG_FAULTS the fault routes are a 404."""
    if service.faults is None:
        raise ApiError(404, f"route {request.path} not found")
    return service.faults


async def _generate(
    service: WorkerService, req: CompletionRequest | ChatCompletionRequest
) -> Response:
    started = time.time()
    job = await service.start(req)
    close_with_exchange(job)  # its requests end with the exchange, answered or not
    # ctx answers context_only once, whole: the coordinator needs its params, not a stream.
    if req.stream and job.transfer_key is None:
        return _sse(job.stream_body())
    body = await job.collect()
    log.debug("request %d done in %.3fs", job.request_id, time.time() - started)
    return json_response(body)


def _sse(body: ResponseBody) -> Response:
    response = Response(body, content_type="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.timeout = None
    return response
