"""What the coordinator's service answers its routes with: a whole JSON body or a stream."""

from __future__ import annotations

from typing import Any, Final

import attrs

from trtdisagg.api.protocol import ChatCompletionRequest, CompletionRequest
from trtdisagg.coordinator.relay import ReplyBody

Json = dict[str, Any]

__all__ = ["CHAT_COMPLETIONS", "COMPLETIONS", "Endpoint", "JsonReply", "Reply", "StreamReply"]


@attrs.frozen(kw_only=True)
class Endpoint:
    path: str
    chat: bool

    @property
    def request_class(self) -> type[CompletionRequest] | type[ChatCompletionRequest]:
        return ChatCompletionRequest if self.chat else CompletionRequest


COMPLETIONS: Final = Endpoint(path="/v1/completions", chat=False)
CHAT_COMPLETIONS: Final = Endpoint(path="/v1/chat/completions", chat=True)


@attrs.frozen(kw_only=True)
class JsonReply:
    body: Json
    status: int = 200


@attrs.frozen(kw_only=True)
class StreamReply:
    body: ReplyBody


Reply = JsonReply | StreamReply
