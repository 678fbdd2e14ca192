"""A request's record inside the engine, and the inbox that brings new ones and aborts.

The HTTP handlers never touch the engine's state: they put commands in the `Inbox`, and the loop
takes them between steps. So requests and blocks change only while no forward is in flight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import attrs
import trio

from trtdisagg.worker.request import Request

if TYPE_CHECKING:
    from trtdisagg.worker.engine.outputs import OutputState, RequestOutput
    from trtdisagg.worker.grammar import Matcher
    from trtdisagg.worker.sampling import SampleSpec
    from trtdisagg.worker.token_logprobs import TokenLogprobs


class OutputSink(Protocol):
    """Where a request's outputs go: a trio channel to an in-process handler, or a front
    process's batch (`worker/front/`). Never blocks; a sink whose reader is gone raises
    trio.BrokenResourceError or trio.ClosedResourceError."""

    def send_nowait(self, output: RequestOutput, /) -> None: ...

    def close(self) -> None: ...


@attrs.frozen(kw_only=True)
class GenerationSource:
    """Where a generation_only request's KV and first tokens come from (ctx's answer)."""

    key: int  # disagg_request_id: the transfer key
    ctx_info_endpoint: str
    # ctx's first token of each choice, in choice order; empty under generation_first, where
    # they come with the KV
    first_tokens: tuple[int, ...] = ()
    ctx_instance: str | None = None  # the ctx instance that answered, if it said (http/handoff.py)
    # ctx's logprobs of each first token, when the request asks for logprobs (else empty)
    first_logprobs: tuple[TokenLogprobs | None, ...] = ()
    num_choices: int = 1  # the request's n: how many first tokens ctx must send
    # ctx's logprobs of prompt tokens 1, 2, ..., when the request asks (echo with logprobs)
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@attrs.define(eq=False, kw_only=True)
class Live:
    """One request the engine serves: its state, how it samples, where its outputs go."""

    request: Request
    outputs: OutputSink
    state: OutputState  # text, stop strings and timings (outputs.py)
    spec: SampleSpec
    source: GenerationSource | None = None  # generation_only: its KV comes from this ctx
    transfer_key: int | None = None  # context_only: its KV goes to gen under this key
    # A prompt's n choices (`forks.py`): choice 0 leads (its request is the one prefilled) and
    # holds the others in `forks` until their first tokens start them; each of those names
    # its `leader` while it has no request in the scheduler.
    choice: int = 0
    forks: list[Live] = attrs.Factory(list)
    leader: Live | None = None
    grammar: Matcher | None = None  # where its output stands in its grammar, if it has one

    @property
    def request_id(self) -> int:
        return self.request.request_id

    def deliver(self, output: RequestOutput) -> None:
        """Hand an output to the request's handler; never blocks (the channel is unbounded)."""
        # A gone handler is fine: its abort is already queued.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self.outputs.send_nowait(output)

    def close(self) -> None:
        self.outputs.close()


@attrs.frozen(kw_only=True, eq=False)
class RequestHandle:
    """What a handler gets for a request it submitted: the request and its outputs, in order."""

    request: Request
    outputs: trio.MemoryReceiveChannel[RequestOutput]


@attrs.frozen(kw_only=True)
class Commands:
    """What the handlers asked since the loop last looked."""

    new: tuple[Live, ...] = ()
    aborts: tuple[int, ...] = ()  # request ids
    releases: tuple[int, ...] = ()  # ctx: transfer keys the coordinator gave up on


_NO_COMMANDS = Commands()


@attrs.define(eq=False, kw_only=True)
class Inbox:
    """Commands from the handlers, taken by the loop between steps; each one wakes the loop."""

    wake: Callable[[], None]
    _new: list[Live] = attrs.field(factory=list, alias="new")
    _aborts: list[int] = attrs.field(factory=list, alias="aborts")
    _releases: list[int] = attrs.field(factory=list, alias="releases")

    def submit(self, live: Live) -> None:
        self._new.append(live)
        self.wake()

    def abort(self, request_id: int) -> None:
        self._aborts.append(request_id)
        self.wake()

    def release(self, key: int) -> None:
        self._releases.append(key)
        self.wake()

    @property
    def has_commands(self) -> bool:
        return bool(self._new or self._aborts or self._releases)

    @property
    def new(self) -> tuple[Live, ...]:
        """Requests submitted and not taken yet."""
        return tuple(self._new)

    def take(self) -> Commands:
        if not (self._new or self._aborts or self._releases):
            return _NO_COMMANDS  # the common case, once per loop round
        commands = Commands(
            new=tuple(self._new), aborts=tuple(self._aborts), releases=tuple(self._releases)
        )
        self._new.clear()
        self._aborts.clear()
        self._releases.clear()
        return commands
