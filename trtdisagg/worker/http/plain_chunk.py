"""A streamed choice's plain chunk, formatted from parts rendered once per choice. Pure.

Most chunks of a stream carry one token's text and nothing else. Rendering each through a dict
and the JSON encoder costs more than the token's share of the step; `PlainChunk` formats the same
bytes from pieces fixed at the choice's start.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from trtdisagg.worker.http.responses import ResponseMeta


@attrs.frozen(kw_only=True)
class PlainChunk:
    """A streamed choice's plain chunk as its SSE event: the choice already started, and no
    logprobs, tool calls, echo or per-chunk usage. Only its text, token ids and finish reason
    vary, so the rest is rendered once per choice; the bytes are those `sse_event` makes of
    `chunk_body`'s dict (the same keys in the same order, strings escaped as `json.dumps`
    escapes them), one format call instead of a dict walked by the JSON encoder per token."""

    head: str  # up to the finish reason's value
    text_key: str  # between the finish reason and the text
    text_end: str  # closes chat's delta
    with_ids: bool

    @classmethod
    def of(cls, meta: ResponseMeta, index: int) -> PlainChunk:
        # json.dumps escapes every non-ASCII character, so the whole event is ASCII.
        head = (
            f'data: {{"id":{json.dumps(meta.response_id)},'
            f'"object":{json.dumps("chat.completion.chunk" if meta.chat else "text_completion")},'
            f'"created":{json.dumps(meta.created)},"model":{json.dumps(meta.model)},'
            f'"choices":[{{"index":{json.dumps(index)},"logprobs":null,"finish_reason":'
        )
        return cls(
            head=head,
            text_key=',"delta":{"content":' if meta.chat else ',"text":',
            text_end="}" if meta.chat else "",
            with_ids=meta.return_token_ids,
        )

    def event(self, text: str, token_ids: Sequence[int], finish_reason: str | None) -> bytes:
        finish = "null" if finish_reason is None else encode_basestring_ascii(finish_reason)
        ids = f',"token_ids":[{",".join(map(str, token_ids))}]' if self.with_ids else ""
        return (
            self.head + finish + self.text_key + encode_basestring_ascii(text) + self.text_end
            + ids + "}]}\n\n"
        ).encode("ascii")  # fmt: skip
