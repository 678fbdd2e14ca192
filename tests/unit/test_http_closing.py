"""`api.http.ClosingQuartTrio`: what a handler registers is closed when its exchange ends, also
when the client leaves before quart started to send the streamed body (which quart then never
closes), so a worker's requests and a coordinator's upstream stream never outlive their client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import attrs
import trio
from quart import Response

from trtdisagg.api.http import ClosingQuartTrio, close_with_exchange


@attrs.define
class Held:
    """Stands for what a streamed answer holds (a worker's job, a coordinator's relay)."""

    closed: int = 0

    async def aclose(self) -> None:
        self.closed += 1


def _app(held: Held, iterated: list[bool]) -> ClosingQuartTrio:
    app = ClosingQuartTrio(__name__)

    async def body() -> AsyncIterator[bytes]:
        iterated.append(True)
        yield b"data: x\n\n"

    @app.post("/stream")
    async def stream() -> Response:
        close_with_exchange(held)
        return Response(body(), content_type="text/event-stream")

    return app


def _scope() -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/stream", "raw_path": b"/stream", "query_string": b"",
        "root_path": "", "headers": [(b"host", b"test")], "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2), "extensions": {},
    }  # fmt: skip


async def test_a_client_gone_before_the_body_was_started_still_closes_what_it_held() -> None:
    held, iterated = Held(), []
    app = _app(held, iterated)
    head_sent = trio.Event()
    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await head_sent.wait()  # the client leaves while the head is on its way
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            head_sent.set()
            await trio.sleep_forever()  # the head's write never completes: the body never starts

    with trio.fail_after(10):
        await app(_scope(), receive, send)  # type: ignore[arg-type]
    assert held.closed == 1 and not iterated


async def test_an_answered_exchange_closes_what_it_held_once() -> None:
    held, iterated = Held(), []
    app = _app(held, iterated)
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": b"", "more_body": False}]
    done = trio.Event()

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            done.set()

    with trio.fail_after(10):
        await app(_scope(), receive, send)  # type: ignore[arg-type]
    assert held.closed == 1 and iterated
    assert any(m.get("body") == b"data: x\n\n" for m in sent)
