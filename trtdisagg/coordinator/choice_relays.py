"""The relays of one answer's choices, each read by a task of its own, as one source of events.

A streamed answer of several choices whose leg failed goes on choice by choice: each unfinished
choice in a relay of its own (`resume.GenRelay.choice`), resumed on a continuation of its own.
Each relay is read by a task in the stream's nursery, and their events go out in the order they
come; a task hands over its events only when they are taken (an unbuffered channel), so a slow
client holds every continuation back as it holds one leg back. The first relay that fails ends
the answer with its error; closing cancels the tasks before closing their relays, so that no
task takes a closed leg for a failed one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import trio

Json = dict[str, Any]


class EventSource(Protocol):
    async def next_events(self) -> list[Json] | None:
        """The next events ([] when what came shows nothing yet), None once complete."""
        ...

    async def aclose(self) -> None: ...


@attrs.define(eq=False)
class ChoiceRelays:
    relays: Sequence[EventSource]
    _receive: trio.MemoryReceiveChannel[list[Json] | Exception]
    _scopes: list[trio.CancelScope] = attrs.Factory(list)
    _closed: bool = False

    @classmethod
    def start(cls, relays: Sequence[EventSource], nursery: trio.Nursery) -> ChoiceRelays:
        send, receive = trio.open_memory_channel[list[Json] | Exception](0)
        out = cls(relays, receive)
        for relay in relays:
            nursery.start_soon(out._read, relay, send.clone())
        send.close()
        return out

    async def next_events(self) -> list[Json] | None:
        """The next events of any relay; None once every relay is complete.

        Raises:
            what a relay raised (`resume.AnswerFailed`): the answer ends with it.
        """
        try:
            item = await self._receive.receive()
        except trio.EndOfChannel:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    async def aclose(self) -> None:
        self._closed = True
        for scope in self._scopes:
            scope.cancel()
        for relay in self.relays:
            await relay.aclose()

    async def _read(
        self, relay: EventSource, send: trio.MemorySendChannel[list[Json] | Exception]
    ) -> None:
        scope = trio.CancelScope()
        self._scopes.append(scope)
        if self._closed:
            scope.cancel()
        with scope, send:
            try:
                while (events := await relay.next_events()) is not None:
                    if events:
                        await send.send(events)
            except trio.BrokenResourceError:
                return  # nothing reads the answer any more
            except Exception as exc:  # the relay's AnswerFailed: the answer ends with it
                try:
                    await send.send(exc)
                except trio.BrokenResourceError:
                    return
