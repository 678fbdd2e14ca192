"""Streaming bodies handed to the HTTP layer: gen's SSE relayed as it arrives, or fixed events.

A body owns what the stream holds: the open upstream response, the gen reservation and the
in-flight count. `aclose()` releases all of it, exactly once, shielded from cancellation; it runs
when the stream ends, when the client disconnects (Trio cancels the sending task), or when the
HTTP layer drops a body it never started (see `app._ClosingConnection`).

The request deadline is enforced per read (`CancelScope(deadline=...)` around each upstream
read, never across a ``yield``), and a timeout or an upstream failure mid-stream ends the stream
with an OpenAI error event and ``[DONE]``: the status line was sent long ago.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final, Protocol

import attrs
import httpx
import trio

from trtdisagg.api.codec import SSE_DONE
from trtdisagg.api.errors import ApiError
from trtdisagg.coordinator.split import SseRewriter, error_event

log = logging.getLogger(__name__)

CLOSE_TIMEOUT: Final = 2.0

Finish = Callable[[str], Awaitable[None]]
"""Called once when the body is done, with the outcome: ok | error | aborted."""


class ReplyBody(Protocol):
    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def __anext__(self) -> bytes: ...

    async def aclose(self) -> None: ...


@attrs.define(eq=False, kw_only=True)
class StaticBody:
    """Events known in advance (ctx finished a streaming request by itself)."""

    events: list[bytes]
    finish: Finish
    _index: int = 0
    _closed: bool = False

    def __aiter__(self) -> StaticBody:
        return self

    async def __anext__(self) -> bytes:
        await trio.lowlevel.checkpoint()
        if self._index >= len(self.events):
            await self.aclose()
            raise StopAsyncIteration
        self._index += 1
        return self.events[self._index - 1]

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        outcome = "ok" if self._index >= len(self.events) else "aborted"
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
            await self.finish(outcome)


@attrs.define(eq=False, kw_only=True)
class RelayBody:
    """gen's SSE, rewritten event by event (`SseRewriter`) and passed on chunk by chunk."""

    response: httpx.Response
    rewriter: SseRewriter
    deadline: float
    finish: Finish
    on_first_chunk: Callable[[], None]
    _iter: AsyncIterator[bytes] | None = None
    _first: bool = True
    _ended: str | None = None
    """Outcome once the upstream stream is over (ok | error); None while it runs."""
    _tail: list[bytes] = attrs.Factory(list)
    _closed: bool = False

    def __aiter__(self) -> RelayBody:
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._tail:
                return self._tail.pop(0)
            if self._ended is not None:
                await self.aclose()
                raise StopAsyncIteration
            out = await self._read()
            if out:
                return out

    async def _read(self) -> bytes:
        if self._iter is None:
            self._iter = self.response.aiter_raw()
        try:
            with trio.CancelScope(deadline=self.deadline) as scope:
                chunk = await self._iter.__anext__()
        except StopAsyncIteration:
            self._ended = "ok"
            return self.rewriter.flush()
        except httpx.HTTPError as exc:
            log.warning("gen stream from %s broke: %s", self.response.url, exc)
            self._end_with_error(ApiError(502, f"generation server stream failed: {exc}"))
            return b""
        if scope.cancelled_caught:
            self._end_with_error(ApiError(504, "request timed out while streaming"))
            return b""
        if self._first:
            self._first = False
            self.on_first_chunk()
        return self.rewriter.feed(chunk)

    def _end_with_error(self, error: ApiError) -> None:
        self._ended = "error"
        pending = self.rewriter.flush()
        if pending:
            self._tail.append(pending)
        self._tail += [error_event(error.to_json()), SSE_DONE]

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        outcome = self._ended or "aborted"
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
            if self._iter is not None:
                await self._iter.aclose()  # type: ignore[attr-defined]
            await self.response.aclose()
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
            await self.finish(outcome)
