"""The coordinator state process of a fleet: cluster state and stateful routers behind HTTP.

Fleet front ends call ``POST /select`` and ``POST /finish`` (bodies in `state_wire`) and read
``GET /cluster_info``; ``GET /health`` answers 200 once the cluster is ready (503 before), with
this process's pid. Each select is a reservation keyed by (role, key); one never finished (its
front end died) is released after ``request_timeout + RESERVATION_GRACE`` seconds with
``success=False``, so a lost front end cannot leak load.
"""

from __future__ import annotations

import logging
import os
from typing import Final

import attrs
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from trtdisagg import __version__
from trtdisagg.api.errors import ApiError
from trtdisagg.coordinator.app import error_response, json_response
from trtdisagg.coordinator.cluster import ServerRole
from trtdisagg.coordinator.local import LocalPlacement
from trtdisagg.coordinator.metrics import CONTENT_TYPE, CoordinatorMetrics
from trtdisagg.coordinator.routers import NoServerAvailable
from trtdisagg.coordinator.state_wire import (
    BadBody,
    FinishBody,
    SelectAnswer,
    SelectBody,
    decode,
    encode,
)

log = logging.getLogger(__name__)

RESERVATION_GRACE: Final = 30.0
SWEEP_INTERVAL: Final = 5.0


@attrs.define(eq=False, kw_only=True)
class StateService:
    placement: LocalPlacement
    metrics: CoordinatorMetrics
    reservation_timeout: float
    _expiry: dict[tuple[ServerRole, int], float] = attrs.Factory(dict)

    async def select(self, body: SelectBody) -> SelectAnswer:
        selection = await self.placement.select(
            body.role, body.route_request(), exclude=body.exclude, pair_with=body.pair_with
        )
        router = self.placement.router_type(body.role).value
        self.metrics.router_decisions.labels(router=router, server=selection.server).inc()
        self._expiry[(body.role, body.key)] = trio.current_time() + self.reservation_timeout
        return SelectAnswer.of(selection)

    async def finish(self, body: FinishBody) -> None:
        self._expiry.pop((body.role, body.key), None)
        await self.placement.finish(body.role, body.key, success=body.success)

    async def expire_forever(self) -> None:
        while True:
            await trio.sleep(SWEEP_INTERVAL)
            now = trio.current_time()
            for (role, key), expiry in list(self._expiry.items()):
                if expiry <= now:
                    log.warning("Releasing stale coordinator reservation %s/%d", role.value, key)
                    await self.finish(FinishBody(role=role, key=key, success=False))


def create_state_app(service: StateService) -> QuartTrio:
    app = QuartTrio(__name__)
    placement = service.placement

    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError) -> Response:
        return error_response(exc)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        return error_response(ApiError(exc.code or 500, exc.description or exc.name))

    async def body_of(cls: type[SelectBody] | type[FinishBody]) -> SelectBody | FinishBody:
        data = await request.get_json(force=True, silent=True)
        try:
            return decode(data, cls)
        except BadBody as exc:
            raise ApiError(400, str(exc)) from None

    @app.post("/select")
    async def select() -> Response:
        body = await body_of(SelectBody)
        assert isinstance(body, SelectBody)
        try:
            answer = await service.select(body)
        except NoServerAvailable as exc:
            raise ApiError(503, str(exc)) from None
        return json_response(encode(answer))

    @app.post("/finish")
    async def finish() -> Response:
        body = await body_of(FinishBody)
        assert isinstance(body, FinishBody)
        await service.finish(body)
        return json_response({})

    @app.get("/cluster_info")
    async def cluster_info() -> Response:
        info = placement.cluster_info()
        info["routers"] = {
            role.value: encode(router.statistics()) for role, router in placement.routers.items()
        }
        return json_response(info)

    @app.get("/health")
    async def health() -> Response:
        status = 200 if placement.is_ready() else 503
        return json_response(
            {"status": "ok" if status == 200 else "not ready", "pid": os.getpid()}, status
        )

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": __version__})

    @app.get("/metrics")
    @app.get("/prometheus/metrics")
    async def prometheus() -> Response:
        return Response(service.metrics.render(), content_type=CONTENT_TYPE)

    return app
