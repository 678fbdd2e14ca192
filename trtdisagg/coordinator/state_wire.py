"""Bodies of the coordinator state process's internal API (fleet mode). JSON over HTTP.

POST /select  SelectBody → SelectAnswer (200) | 503 no server | 400 bad body
POST /finish  FinishBody → {} (200)
GET  /cluster_info       → the cluster's `cluster_info()` (plus "routers")
GET  /health             → 200 ready | 503, with {"pid"}

A field added later has a default, so a body from an older front end still decodes (a missing
``pair_with`` means None: no other leg placed yet).
"""

from __future__ import annotations

from typing import Any, TypeVar

import attrs
import cattrs

from trtdisagg.coordinator.cluster import ServerRole
from trtdisagg.coordinator.routers import RouteRequest, Selection

T = TypeVar("T")


class BadBody(ValueError):
    pass


@attrs.frozen(kw_only=True)
class SelectBody:
    role: ServerRole
    key: int
    exclude: str | None = None
    pair_with: str | None = None
    """The server of the request's other leg: only servers that can exchange KV with it."""
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    conversation_id: str | None = None

    @classmethod
    def of(
        cls,
        role: ServerRole,
        request: RouteRequest,
        *,
        exclude: str | None,
        pair_with: str | None = None,
    ) -> SelectBody:
        ids = request.prompt_token_ids
        return cls(
            role=role,
            key=request.key,
            exclude=exclude,
            pair_with=pair_with,
            prompt_token_ids=list(ids) if ids is not None else None,
            prompt_text=request.prompt_text,
            conversation_id=request.conversation_id,
        )

    def route_request(self) -> RouteRequest:
        ids = self.prompt_token_ids
        return RouteRequest(
            key=self.key,
            prompt_token_ids=tuple(ids) if ids is not None else None,
            prompt_text=self.prompt_text,
            conversation_id=self.conversation_id,
        )


@attrs.frozen(kw_only=True)
class SelectAnswer:
    server: str
    matched_tokens: int = 0

    @classmethod
    def of(cls, selection: Selection) -> SelectAnswer:
        return cls(server=selection.server, matched_tokens=selection.matched_tokens)

    def selection(self) -> Selection:
        return Selection(server=self.server, matched_tokens=self.matched_tokens)


@attrs.frozen(kw_only=True)
class FinishBody:
    role: ServerRole
    key: int
    success: bool = True


_converter = cattrs.Converter(forbid_extra_keys=True)


def decode(data: object, cls: type[T]) -> T:
    """Raises BadBody naming the problem."""
    try:
        return _converter.structure(data, cls)
    except (cattrs.BaseValidationError, TypeError, ValueError, KeyError) as exc:
        messages = (
            cattrs.transform_error(exc) if isinstance(exc, cattrs.BaseValidationError) else []
        )
        raise BadBody("; ".join(messages) or str(exc)) from None


def encode(value: object) -> Any:
    return _converter.unstructure(value)
