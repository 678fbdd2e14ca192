"""MergedBody interleaves its sources in arrival order and always closes them; ResponsesBody
re-tells a chat stream as Responses events. In one trio run, with channels as sources."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import attrs
import trio

from trtdisagg.api.codec import SSE_DONE, sse_event
from trtdisagg.api.responses_api import ResponsesRequest
from trtdisagg.api.responses_events import ResponseHead, ResponsesStream
from trtdisagg.api.streaming import MergedBody, ResponsesBody


@attrs.define(eq=False)
class Channel:
    """A source the test feeds by hand; records whether it was closed."""

    send: trio.MemorySendChannel[str]
    receive: trio.MemoryReceiveChannel[str]
    closed: bool = False
    fail_with: Exception | None = None

    @classmethod
    def new(cls) -> Channel:
        send, receive = trio.open_memory_channel[str](10)
        return cls(send, receive)

    def __aiter__(self) -> Channel:
        return self

    async def __anext__(self) -> str:
        try:
            item = await self.receive.receive()
        except trio.EndOfChannel:
            if self.fail_with is not None:
                raise self.fail_with from None
            raise StopAsyncIteration from None
        return item

    async def aclose(self) -> None:
        self.closed = True
        self.receive.close()


@attrs.define(eq=False)
class Recorder:
    stopped: bool = False
    failures: list[int] = attrs.Factory(list)

    def opening(self) -> list[bytes]:
        return [b"open;"]

    def item(self, index: int, item: str) -> list[bytes]:
        if item == "stop":
            self.stopped = True
        return [f"{index}:{item};".encode()]

    def failed(self, index: int, error: Exception) -> list[bytes]:
        self.failures.append(index)
        return [f"{index}!{error};".encode()]

    def closing(self) -> list[bytes]:
        return [b"close;"]


async def _read(body: AsyncIterator[bytes], count: int) -> list[bytes]:
    return [await body.__anext__() for _ in range(count)]


async def test_sources_interleave_in_arrival_order_and_close() -> None:
    sources = [Channel.new() for _ in range(3)]
    outcomes: list[str] = []
    body = MergedBody(list(sources), Recorder(), finish=outcomes.append)
    async with body as chunks:
        assert await chunks.__anext__() == b"open;"
        for index, item in ((2, "a"), (0, "b"), (2, "c"), (1, "d")):
            await sources[index].send.send(item)
            assert await chunks.__anext__() == f"{index}:{item};".encode()
        for source in sources:
            await source.send.aclose()
        assert [chunk async for chunk in chunks] == [b"close;"]
    assert all(s.closed for s in sources) and outcomes == ["ok"]


async def test_leaving_early_cancels_the_readers_and_closes_every_source() -> None:
    sources = [Channel.new() for _ in range(2)]
    outcomes: list[str] = []
    body = MergedBody(list(sources), Recorder(), finish=outcomes.append)
    with trio.fail_after(5):
        async with body as chunks:
            await sources[1].send.send("x")
            assert await _read(chunks, 2) == [b"open;", b"1:x;"]
    assert all(s.closed for s in sources) and outcomes == ["aborted"]
    await body.aclose()  # idempotent
    assert outcomes == ["aborted"]


async def test_a_body_never_entered_still_closes_its_sources() -> None:
    sources = [Channel.new() for _ in range(2)]
    outcomes: list[str] = []
    await MergedBody(list(sources), Recorder(), finish=outcomes.append).aclose()
    assert all(s.closed for s in sources) and outcomes == ["aborted"]


async def test_a_merger_that_stops_ends_the_body() -> None:
    sources = [Channel.new() for _ in range(2)]
    outcomes: list[str] = []
    async with MergedBody(list(sources), Recorder(), finish=outcomes.append) as chunks:
        await sources[0].send.send("stop")
        # What is ready at once goes out in one write: the stopping item and the closing.
        assert [c async for c in chunks] == [b"open;", b"0:stop;close;"]
    assert outcomes == ["error"] and all(s.closed for s in sources)


async def test_a_failing_source_is_reported_and_the_others_go_on() -> None:
    for count in (1, 2):  # one source is read without a task of its own
        sources = [Channel.new() for _ in range(count)]
        sources[0].fail_with = RuntimeError("gone")
        merger = Recorder()
        async with MergedBody(list(sources), merger) as chunks:
            await sources[0].send.aclose()
            if count == 2:
                await sources[1].send.send("y")
                await sources[1].send.aclose()
            got = [c async for c in chunks]
        assert b"0!gone;" in got and merger.failures == [0]
        assert got[-1] == b"close;" and (count == 1 or b"1:y;" in got)


async def test_responses_body_tells_a_chat_stream_as_events() -> None:
    head = ResponseHead.of(ResponsesRequest(input="hi"), created_at=1, model="tiny")
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}},
    ]
    closed: list[bool] = []

    async def chat() -> AsyncIterator[bytes]:
        try:
            data = b"".join(sse_event(c) for c in chunks) + SSE_DONE
            for i in range(0, len(data), 7):  # events cut anywhere
                yield data[i : i + 7]
        finally:
            closed.append(True)

    body = ResponsesBody(inner=chat(), stream=ResponsesStream(head=head))
    async with body as events:
        frames = [frame async for frame in events]
    kinds = [frame.split(b"\n")[0].removeprefix(b"event: ").decode() for frame in frames]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 1
    done: dict[str, Any] = json.loads(frames[-1].split(b"\n")[1].removeprefix(b"data: "))
    assert done["response"]["usage"]["output_tokens"] == 1
    assert done["response"]["output"][0]["content"][0]["text"] == "Hi"
    assert closed == [True]
