"""`RemoteEngine`: the `Engine` a front process has, reaching the engine process over the link.

Submitting and aborting send a message and return at once: what the engine could refuse
(a prompt too long, a stopped engine) is checked here first from `EngineFacts`, so the HTTP
answer is the same as in one process. Each choice's outputs arrive in the engine's batches and
go to the choice's trio channel; a record with no output closes it. Questions that need the
engine's state (`Call`) wait for their reply.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio
from prometheus_client import CollectorRegistry, generate_latest

from trtdisagg.errors import WorkerStopped
from trtdisagg.worker.engine.live import RequestHandle
from trtdisagg.worker.engine.outputs import RequestOutput
from trtdisagg.worker.front.link import Link
from trtdisagg.worker.front.wire import (
    Call,
    Kind,
    SubmitGroup,
    WireError,
    decode_outputs,
    encode_submit,
    pack,
    unpack,
)
from trtdisagg.worker.request import check_fits

if TYPE_CHECKING:
    from trtdisagg.worker.engine.live import GenerationSource
    from trtdisagg.worker.grammar import GrammarTemplate
    from trtdisagg.worker.request import Request

log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class EngineFacts:
    """What a front knows of the engine without asking: fixed once the engine is built."""

    vocab_size: int
    max_seq_len: int
    kv_capacity_tokens: int  # the KV pool's blocks × tokens per block
    kv_compat: dict[str, str | int] | None
    has_test_hooks: bool


@attrs.define(eq=False)
class _Reply:
    done: trio.Event = attrs.Factory(trio.Event)
    value: Any = None


@attrs.define(eq=False, kw_only=True)
class RemoteEngine:
    facts: EngineFacts
    registry: CollectorRegistry  # this front's own metrics, rendered after the engine's
    link: Link  # a connected DEALER, pumped with `on_message`
    stopped: str | None = None
    bad_frames: int = 0
    connected: trio.Event = attrs.Factory(trio.Event)  # the engine answered HELLO
    stopping: trio.Event = attrs.Factory(trio.Event)  # the engine said STOP
    _channels: dict[int, trio.MemorySendChannel[RequestOutput]] = attrs.field(
        factory=dict, alias="channels"
    )
    _replies: dict[int, _Reply] = attrs.field(factory=dict, alias="replies")
    _call_ids: itertools.count[int] = attrs.field(factory=itertools.count, alias="call_ids")

    @property
    def vocab_size(self) -> int:
        return self.facts.vocab_size

    @property
    def kv_compat(self) -> dict[str, str | int] | None:
        return self.facts.kv_compat

    @property
    def has_test_hooks(self) -> bool:
        return self.facts.has_test_hooks

    def _send(self, message: bytes) -> None:
        self.link.send_nowait([message])

    def hello(self, index: int) -> None:
        self._send(pack([Kind.HELLO, index]))

    def serving(self) -> None:
        self._send(pack([Kind.SERVING]))

    # ---- Engine ----

    def check_fits(self, request: Request) -> None:
        check_fits(
            request.num_prompt_tokens,
            max_seq_len=self.facts.max_seq_len,
            capacity=self.facts.kv_capacity_tokens,
        )

    def submit_group(
        self,
        choices: Sequence[Request],
        *,
        source: GenerationSource | None = None,
        transfer_key: int | None = None,
        grammar: GrammarTemplate | None = None,
    ) -> list[RequestHandle]:
        if self.stopped is not None:
            raise WorkerStopped(f"this worker stopped serving: {self.stopped}")
        leader = choices[0]
        self.check_fits(leader)
        if any(c.prompt_token_ids != leader.prompt_token_ids for c in choices[1:]):
            raise ValueError("the choices of one group share their prompt")
        group = SubmitGroup(
            request_ids=tuple(c.request_id for c in choices),
            prompt_token_ids=tuple(leader.prompt_token_ids),
            samplings=tuple(c.sampling for c in choices),
            request_type=leader.request_type,
            arrival_time=leader.arrival_time,
            root=leader.root,
            source=source,
            transfer_key=transfer_key,
            grammar=grammar.grammar if grammar is not None else None,
        )
        handles: list[RequestHandle] = []
        for request in choices:
            send, receive = trio.open_memory_channel[RequestOutput](math.inf)
            self._channels[request.request_id] = send
            handles.append(RequestHandle(request=request, outputs=receive))
        self._send(encode_submit(group))
        return handles

    def abort(self, request_id: int) -> None:
        # Its channel stays until the engine's closing record: outputs on their way are dropped.
        self._send(pack([Kind.ABORT, request_id]))

    async def _call(self, call: Call, argument: Any = None) -> Any:
        call_id = next(self._call_ids)
        reply = self._replies[call_id] = _Reply()
        self._send(pack([Kind.CALL, call_id, call, argument]))
        try:
            await reply.done.wait()
        finally:
            self._replies.pop(call_id, None)
        return reply.value

    async def release_send(self, key: int) -> bool:
        return bool(await self._call(Call.RELEASE_SEND, key))

    async def transfer_key_in_use(self, key: int, *, sending: bool) -> bool:
        call = Call.SENDING_KEY_IN_USE if sending else Call.RECEIVING_KEY_IN_USE
        return bool(await self._call(call, key))

    async def render_metrics(self) -> bytes:
        engine = await self._call(Call.METRICS)
        if not isinstance(engine, bytes):
            engine = b""
        return engine + generate_latest(self.registry)

    async def drain_kv_events(self, after: int | None = None) -> list[dict[str, Any]]:
        events = await self._call(Call.KV_EVENTS, after)
        return events if isinstance(events, list) else []

    async def kv_digests(self) -> dict[int, str]:
        digests = await self._call(Call.KV_DIGESTS)
        return dict(digests) if isinstance(digests, dict) else {}

    async def fail_steps(self, count: int) -> None:
        await self._call(Call.FAIL_STEPS, count)

    # ---- messages from the engine ----

    def on_message(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 1:
                raise WireError(f"a {len(frames)}-frame message")
            message = unpack(frames[0])
            kind = message[0]
            if kind == Kind.OUTPUTS:
                self._outputs(message)
            elif kind == Kind.REPLY and len(message) == 3:
                reply = self._replies.get(message[1])
                if reply is not None:
                    reply.value = message[2]
                    reply.done.set()
            elif kind == Kind.STOP:
                self.stopping.set()
            elif kind == Kind.STATE and len(message) == 2:
                stopped = message[1]
                self.stopped = stopped if isinstance(stopped, str) else None
                self.connected.set()
            else:
                raise WireError(f"an unexpected message of kind {kind}")
        except WireError as exc:
            self.bad_frames += 1
            log.warning("dropped a frame from the engine: %s", exc)

    def _outputs(self, message: list[Any]) -> None:
        for request_id, output in decode_outputs(message):
            channel = self._channels.get(request_id)
            if channel is None:
                continue
            if output is None:
                del self._channels[request_id]
                channel.close()
                continue
            # A reader that left already asked for the abort; what still comes is dropped.
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                channel.send_nowait(output)
