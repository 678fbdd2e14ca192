"""OpenAI-style errors: one exception type that every route turns into `{"error": {...}}`."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class ErrorBody:
    message: str
    type: str
    code: int
    param: str | None = None


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    499: "client_closed_request",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error with the HTTP status it maps to; `param` names the offending field, if any."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> ErrorBody:
        kind = _TYPES.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        return ErrorBody(message=self.message, type=kind, code=self.status, param=self.param)

    def to_json(self) -> dict[str, Any]:
        body = self.body()
        error: dict[str, Any] = {"message": body.message, "type": body.type, "code": body.code}
        if body.param is not None:
            error["param"] = body.param
        return {"error": error}


def bad_request(message: str, *, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)
