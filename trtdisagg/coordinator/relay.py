"""Streaming bodies handed to the HTTP layer: gen's SSE relayed as it arrives, or fixed events.

A body owns what the stream holds: the open upstream response, the gen reservation and the
in-flight count. `aclose()` releases all of it, exactly once, shielded from cancellation; it runs
when the stream ends, when the client disconnects (Trio cancels the sending task), or when the
HTTP layer drops a body it never started (see `api/http.py: ClosingQuartTrio`).

Deadlines are enforced per read (`resume.GenRelay`: a cancel scope around each upstream read,
never across a ``yield``). A relayed stream is a quart `ResponseBody`: entering it opens the
nursery where its choices' own relays are read once a leg of several choices failed
(`choice_relays.py`); exiting cancels them and closes it. An answer that cannot be completed
(no continuation left, the request deadline) ends the stream with an OpenAI error event and
``[DONE]``: the status line was sent long ago.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Final, Protocol

import attrs
import trio
from quart.wrappers.response import ResponseBody

from trtdisagg.api.codec import SSE_DONE, sse_event
from trtdisagg.coordinator.resume import AnswerFailed, GenRelay

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
class RelayBody(ResponseBody):
    """An answer's gen stream as the client's events (`GenRelay`: its legs, deadlines and
    continuations), passed on as they come."""

    relay: GenRelay
    finish: Finish
    _ended: str | None = None
    """Outcome once the answer is over (ok | error); None while it runs."""
    _tail: list[bytes] = attrs.Factory(list)
    _stack: contextlib.AsyncExitStack | None = None
    _closed: bool = False

    async def __aenter__(self) -> RelayBody:
        stack = contextlib.AsyncExitStack()
        self.relay.nursery = await stack.enter_async_context(trio.open_nursery())
        self._stack = stack
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.aclose()
        finally:
            if self._stack is not None:
                stack, self._stack = self._stack, None
                await stack.__aexit__(exc_type, exc, tb)

    def __aiter__(self) -> RelayBody:
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._tail:
                return self._tail.pop(0)
            if self._ended is not None:
                await self.aclose()
                raise StopAsyncIteration
            try:
                events = await self.relay.next_events()
            except AnswerFailed as failed:
                log.warning("gen stream ended short: %s", failed)
                self._ended = "error"
                self._tail += [sse_event(failed.event), SSE_DONE]
                continue
            if events is None:
                self._ended = "ok"
                self._tail.append(SSE_DONE)
                continue
            if events:
                return b"".join(sse_event(event) for event in events)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        outcome = self._ended or "aborted"
        await self.relay.aclose()
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
            await self.finish(outcome)
