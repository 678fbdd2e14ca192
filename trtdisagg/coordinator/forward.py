"""Requests every worker answers alike (`/tokenize`, `/detokenize`): passed to one ctx server.

The coordinator may not hold the model's tokenizer (its host need not have the model), and a
worker's answer is by definition the tokenization the workers use, so it asks one: the ctx
router picks it, as for a request's ctx leg, and its answer or its 4xx is the client's.
"""

from __future__ import annotations

from typing import Any

import trio

from trtdisagg.api.errors import bad_request
from trtdisagg.coordinator.cluster import ServerRole
from trtdisagg.coordinator.placement import Lease
from trtdisagg.coordinator.resume import RequestTimeout
from trtdisagg.coordinator.routers import RouteRequest
from trtdisagg.coordinator.service import DisaggService, NotReady
from trtdisagg.coordinator.upstream import UpstreamUnreachable

Json = dict[str, Any]
CTX = ServerRole.CONTEXT


async def forward(service: DisaggService, path: str, raw: object, headers: dict[str, str]) -> Json:
    """The answer of a ctx server to `raw` at `path`, within ``request_timeout``.

    Raises:
        ApiError (400: not a JSON object), NotReady / NoServerAvailable / CoordinatorUnavailable
        (503), UpstreamRejected (the worker's 4xx), UpstreamError (502), RequestTimeout (504).
    """
    if not isinstance(raw, dict):
        raise bad_request("request body must be a JSON object")
    if not service.placement.is_ready():
        raise NotReady(service.placement.not_ready_reason())
    limit = service.config.request_timeout
    with trio.move_on_after(limit):
        key = service.ids.next_id()
        selection = await service.placement.select(CTX, RouteRequest(key=key), exclude=None)
        lease = Lease(placement=service.placement, role=CTX, key=key, selection=selection)
        success = False
        try:
            answer = await service.client.post_json(
                lease.server, path, raw, role=CTX.value, headers=headers
            )
            success = True
            return answer
        except UpstreamUnreachable as exc:
            service.placement.report_unreachable(CTX, exc.server, str(exc))
            raise
        finally:
            await lease.release(success=success)  # shielded
    raise RequestTimeout(f"{path} did not finish within request_timeout={limit:g}s")
