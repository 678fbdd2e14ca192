"""Reading SSE: bytes as they arrive → whole events → their JSON. Pure.

Streams are read back where an answer is re-shaped as it flows: the coordinator merging several
choices' streams, and `/v1/responses` turning chat chunks into Response events.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

DONE = object()
"""What `parse_event` returns for `data: [DONE]`."""


@attrs.define(eq=False)
class SseSplitter:
    """Feeds bytes, returns the whole events (each ending with a blank line) seen so far."""

    _buffer: bytes = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        events: list[bytes] = []
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                return events
            events.append(self._buffer[: end + 2])
            self._buffer = self._buffer[end + 2 :]

    def rest(self) -> bytes:
        """What is left when the stream ends (an unterminated event, normally nothing)."""
        rest, self._buffer = self._buffer, b""
        return rest


def parse_event(event: bytes) -> Any:
    """An event's `data:` as JSON, `DONE` for `[DONE]`, or None for an event without usable data
    (a comment, an `event:`-only frame, data that is not JSON)."""
    data = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
    if not data:
        return None
    payload = b"\n".join(data).strip()
    if payload == b"[DONE]":
        return DONE
    try:
        return json.loads(payload)
    except ValueError:
        return None
