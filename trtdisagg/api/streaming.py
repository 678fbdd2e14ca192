"""Streaming response bodies built from other streams: several choices interleaved, or a chat
stream re-told as Responses API events.

Both are quart `ResponseBody`s: quart enters them (`async with body as chunks`), iterates, and
exits them in the request's own task. `MergedBody` opens its nursery on entry, one task per source
reading into a channel, so the choices' outputs are taken in the order they come, and its exit
cancels what is left and closes every source; nothing yields from inside a nursery. `aclose()`
closes the sources of a body that was never entered (the client left before the answer started).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any, Final, Generic, Protocol, TypeVar

import attrs
import trio
from quart.wrappers.response import ResponseBody

from trtdisagg.api import responses_events
from trtdisagg.api.sse import DONE, SseSplitter, parse_event

log = logging.getLogger(__name__)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
T_contra = TypeVar("T_contra", contravariant=True)
CLOSE_TIMEOUT: Final = 2.0


class Source(Protocol[T_co]):  # an async iterator that can be closed
    def __aiter__(self) -> AsyncIterator[T_co]: ...

    async def aclose(self) -> None: ...


class Merger(Protocol[T_contra]):
    """What turns the sources' items into the body's bytes (pure)."""

    stopped: bool  # nothing more is sent (an error ended the answer); sources are dropped

    def opening(self) -> list[bytes]: ...

    def item(self, index: int, item: T_contra) -> list[bytes]: ...

    def failed(self, index: int, error: Exception) -> list[bytes]: ...

    def closing(self) -> list[bytes]: ...


@attrs.frozen
class _Failure:
    error: Exception


async def _ended() -> AsyncIterator[Any]:
    """An iterator with nothing left: what a failed source becomes."""
    return
    yield


async def _entered(stack: contextlib.AsyncExitStack, source: Any) -> Any:
    """What to iterate of `source`: a `ResponseBody` is entered first (its exit on `stack`)."""
    if isinstance(source, ResponseBody):
        body: Any = source  # (quart types its __aexit__'s arguments as never None)
        return await stack.enter_async_context(body)
    return source


async def _close(source: Any) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
        await source.aclose()


@attrs.define(eq=False)
class MergedBody(ResponseBody, Generic[T]):
    sources: list[Any]  # Source[T] each, the index being the position
    merger: Merger[T]
    finish: Callable[[str], None] | None = None
    """Called once, when the body is closed: ok (all sent), error (the merger stopped on an
    error) or aborted (closed before the end)."""
    _receive: trio.MemoryReceiveChannel[tuple[int, Any]] | None = None
    _direct: AsyncIterator[Any] | None = None  # one source: read it without a task
    _stack: contextlib.AsyncExitStack | None = None
    _cancel: trio.CancelScope | None = None
    _pending: list[bytes] = attrs.Factory(list)
    _started: bool = False
    _done: bool = False
    _closed: bool = False

    async def __aenter__(self) -> MergedBody[T]:
        self._started = True
        self._pending.extend(self.merger.opening())
        stack = contextlib.AsyncExitStack()
        self._stack = stack
        if len(self.sources) == 1:
            self._direct = (await _entered(stack, self.sources[0])).__aiter__()
            return self
        nursery = await stack.enter_async_context(trio.open_nursery())
        send, self._receive = trio.open_memory_channel[tuple[int, Any]](0)
        async with send:
            for index, source in enumerate(self.sources):
                nursery.start_soon(self._pump, index, source, send.clone())
        self._cancel = nursery.cancel_scope
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._cancel is not None and self._receive is not None:
                self._cancel.cancel()
                self._receive.close()
            if self._stack is not None:
                await self._stack.__aexit__(exc_type, exc, tb)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Close every source (idempotent; also for a body never entered)."""
        if self._closed:
            return
        self._closed = True
        for source in self.sources:
            await _close(source)
        if self.finish is not None:
            stopped = self.merger.stopped
            self.finish("error" if stopped else "ok" if self._done else "aborted")

    def __aiter__(self) -> MergedBody[T]:
        return self

    async def __anext__(self) -> bytes:
        while not self._pending:
            if self._done:
                raise StopAsyncIteration
            got = await self._next_item()
            if got is None:
                self._done = True
                self._pending.extend(self.merger.closing())
                continue
            index, item = got
            if isinstance(item, _Failure):
                self._pending.extend(self.merger.failed(index, item.error))
            else:
                self._pending.extend(self.merger.item(index, item))
            if self.merger.stopped:
                self._done = True
                self._pending.extend(self.merger.closing())
        # Everything ready goes out in one write (each write is a trip through h11 and a send).
        data = b"".join(self._pending)
        self._pending.clear()
        return data

    async def _next_item(self) -> tuple[int, Any] | None:
        if self._direct is not None:
            try:
                return 0, await self._direct.__anext__()
            except StopAsyncIteration:
                return None
            except Exception as exc:  # a source's failure is the merger's to report
                self._direct = _ended()
                return 0, _Failure(exc)
        assert self._receive is not None
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            return None

    async def _pump(
        self, index: int, source: Any, send: trio.MemorySendChannel[tuple[int, Any]]
    ) -> None:
        async with send, contextlib.AsyncExitStack() as stack:
            try:
                async for item in await _entered(stack, source):
                    await send.send((index, item))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the body stopped reading
            except Exception as exc:
                log.warning("stream source %d failed: %s", index, exc)
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await send.send((index, _Failure(exc)))
            finally:
                await _close(source)


@attrs.define(eq=False)
class ResponsesBody(ResponseBody):
    """A chat completion's SSE stream (one choice), told as Responses API events."""

    inner: Any  # a ResponseBody, or an async iterator of bytes with aclose()
    stream: responses_events.ResponsesStream
    _chunks: Any = None  # what iterating `inner` gives: an async iterator of bytes
    _splitter: SseSplitter = attrs.Factory(SseSplitter)
    _pending: list[bytes] = attrs.Factory(list)
    _done: bool = False
    _entered: bool = False

    async def __aenter__(self) -> ResponsesBody:
        if isinstance(self.inner, ResponseBody):
            self._entered = True
            self._chunks = await self.inner.__aenter__()
        else:
            self._chunks = self.inner
        self._pending.extend(map(responses_events.sse, self.stream.start()))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._entered:
            self._entered = False
            await self.inner.__aexit__(exc_type, exc, tb)
        else:
            await self.aclose()

    async def aclose(self) -> None:
        if self._entered:
            return  # __aexit__ closes what __aenter__ opened
        await _close(self.inner)

    def __aiter__(self) -> ResponsesBody:
        return self

    async def __anext__(self) -> bytes:
        while not self._pending:
            if self._done:
                raise StopAsyncIteration
            assert self._chunks is not None
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                self._done = True
                self._pending.extend(map(responses_events.sse, self.stream.finish()))
                continue
            for event in self._splitter.feed(chunk):
                data = parse_event(event)
                if data is DONE or not isinstance(data, dict):
                    continue
                if "error" in data:
                    self._done = True
                    self._pending.extend(map(responses_events.sse, self.stream.failed(data)))
                    break
                self._pending.extend(map(responses_events.sse, self.stream.feed(data)))
        return self._pending.pop(0)
