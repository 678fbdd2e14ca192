"""What every role's quart-trio app shares: JSON responses, OpenAI error bodies, API-key check,
and the closing of what a streamed answer holds when its HTTP exchange ends.

Errors map to HTTP statuses here and nowhere else: an `ApiError` carries its status, framework
errors (404 route, 405 method, 413 body too large) become OpenAI error bodies, and anything
unexpected is a 500 with the exception named (and logged with its traceback).
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any, Final, Protocol, cast

from quart import Response, request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from trtdisagg.api.codec import parse_json
from trtdisagg.api.errors import ApiError

log = logging.getLogger(__name__)

OPENAI_PREFIX = "/v1/"
# With an API key, these need it for any method: the OpenAI routes and the coordinator's calls to
# a worker (a `/disagg/release` from anyone else would drop another client's KV). Every other
# route needs it for anything but a read: a POST changes state (`/kv_cache_events` drains the
# routing events), so only the probes (`/health`, `/metrics`, ...) stay open.
KEYED_PREFIXES = (OPENAI_PREFIX, "/disagg/")
READ_METHODS = ("GET", "HEAD", "OPTIONS")
JSON_TYPES = ("application/json",)
_CLOSERS_KEY: Final = "trtdisagg.closers"


class Closable(Protocol):
    async def aclose(self) -> None: ...


def close_with_exchange(closable: Closable) -> None:
    """Close `closable` when this request's HTTP exchange ends, however it ends."""
    cast(dict[str, Any], request.scope).setdefault(_CLOSERS_KEY, []).append(closable)


class _ClosingConnection(TrioASGIHTTPConnection):
    """Closes what the handler registered (`close_with_exchange`) once the exchange ends.

    quart closes a streamed body only from inside its send loop; a client that leaves between
    the handler's return and that loop's start (the response head's send, the after-request
    handlers) would leave the body unclosed, and what it holds (a worker's requests, an
    upstream stream, a reservation) would run on for no one. Closing is idempotent.
    """

    async def handle_request(  # type: ignore[override]  # quart-trio's own signature
        self, nursery: Any, request: Any, send: Any
    ) -> None:
        try:
            await super().handle_request(nursery, request, send)
        finally:
            for closable in cast(dict[str, Any], self.scope).get(_CLOSERS_KEY, []):
                await closable.aclose()


class ClosingQuartTrio(QuartTrio):
    """A QuartTrio app whose exchanges close what their handlers registered."""

    asgi_http_class = _ClosingConnection


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def json_response(value: Any, status: int = 200) -> Response:
    return Response(dumps(value), status=status, content_type="application/json")


def error_response(exc: ApiError) -> Response:
    return json_response(exc.to_json(), exc.status)


def install_common_handlers(app: QuartTrio, *, max_body_bytes: int, api_key: str | None) -> None:
    """Error handlers and the Bearer-key check on `/v1/...` and `/disagg/...`."""
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes

    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError) -> Response:
        return error_response(exc)

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

    @app.after_request
    async def drain_body(response: Response) -> Response:
        # hypercorn 0.18 can leave a keep-alive connection hanging when a response completes
        # before the request body was read (a 401, a 404, a GET with a body): the client's next
        # request on that connection never gets an answer. Reading the rest of the body first
        # closes the race; a body too large to read ends the connection instead.
        try:
            await request.get_data(cache=False)
        except HTTPException:
            response.headers["Connection"] = "close"
        return response

    expected = f"Bearer {api_key}".encode("utf-8", "surrogatepass")

    @app.before_request
    async def authorize() -> Response | None:
        if api_key is None:
            return None
        if request.method in READ_METHODS and not request.path.startswith(KEYED_PREFIXES):
            return None
        # Constant-time comparison: a plain `!=` leaks how long the matching prefix is.
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogatepass")
        if not hmac.compare_digest(given, expected):
            return error_response(ApiError(401, "missing or invalid API key"))
        return None


async def json_body() -> object:
    """An OpenAI route's body as decoded JSON. A body declared as something other than JSON
    (curl's default form encoding, text/plain) is a 415 naming `Content-Type`; a body without
    the header is read as JSON."""
    declared = request.headers.get("Content-Type", "").strip()
    if declared and not is_json_type(declared):
        raise ApiError(
            415,
            f"Content-Type: expected application/json, got {declared[:80]!r}",
            param="Content-Type",
        )
    data = await request.get_data(cache=False, as_text=False)
    return parse_json(data if isinstance(data, bytes) else data.encode())


def is_json_type(content_type: str) -> bool:
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime in JSON_TYPES or mime.endswith("+json")


def model_object(model: str, *, created: int, max_len: int | None) -> dict[str, object]:
    """One entry of `/v1/models` (and `GET /v1/models/{id}`'s answer)."""
    card: dict[str, object] = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "trtdisagg",
    }
    if max_len is not None:
        card["max_model_len"] = max_len
    return card


def model_not_found(model_id: str, served: str) -> ApiError:
    return ApiError(
        404, f"model {model_id!r} not found; this server serves {served!r}", param="model"
    )
