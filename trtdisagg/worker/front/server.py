"""The engine side of the front link: fronts' messages become `Executor` calls, outputs go back
in one batch per front per loop round.

Each request a front submits gets a `FrontSink` as its outputs: the loop's `deliver` appends to
that front's batch, and the flusher sends every non-empty batch once the loop yields (the loop
hands out a step's outputs in one synchronous burst, so one message carries them all). A
grammar arrives as its source and is compiled here, in a worker thread unless it is cached.

Every frame is checked: a malformed one (or one naming a request id that is not its front's to
use) is dropped and counted in `bad_frames`, with a rate-limited warning; it never ends the
engine.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import attrs
import trio

from trtdisagg.errors import CapacityError, WorkerStopped
from trtdisagg.ratelimit import LogRateLimit, log_limited
from trtdisagg.worker.engine.executor import Executor
from trtdisagg.worker.engine.outputs import RequestOutput
from trtdisagg.worker.front.link import Link
from trtdisagg.worker.front.wire import (
    Call,
    Kind,
    SubmitGroup,
    WireError,
    decode_submit,
    encode_closed,
    encode_output,
    encode_outputs,
    pack,
    unpack,
)
from trtdisagg.worker.grammar import GrammarCompiler, GrammarError, GrammarTemplate
from trtdisagg.worker.http.engine import LocalEngine
from trtdisagg.worker.request import FinishReason, Request

log = logging.getLogger(__name__)


@attrs.define(eq=False, kw_only=True)
class FrontBatch:
    """The outputs owed to one front since the last flush."""

    identity: bytes
    index: int
    records: list[list[Any]] = attrs.Factory(list)


@attrs.define(eq=False, kw_only=True)
class FrontSink:
    """One request's outputs, into its front's batch (`live.OutputSink`)."""

    server: EngineServer
    batch: FrontBatch
    request_id: int

    def send_nowait(self, output: RequestOutput, /) -> None:
        self.server.owe(self.batch, encode_output(self.request_id, output))

    def close(self) -> None:
        self.server.owe(self.batch, encode_closed(self.request_id))


@attrs.define(eq=False, kw_only=True)
class EngineServer:
    """Serves `num_fronts` fronts over `link` (a bound ROUTER; `run` pumps it)."""

    executor: Executor
    num_fronts: int
    tokenizer_json: str  # for the engine's own grammar compiler
    link: Link
    fronts: dict[bytes, FrontBatch] = attrs.Factory(dict)
    bad_frames: int = 0
    all_serving: trio.Event = attrs.Factory(trio.Event)  # every front's port is open
    _serving: set[bytes] = attrs.field(factory=set, alias="serving")
    _dirty: list[FrontBatch] = attrs.field(factory=list, alias="dirty")
    _owed: trio.Event = attrs.field(factory=trio.Event, alias="owed")
    _told_stopped: str | None = attrs.field(default=None, alias="told_stopped")
    _compiler: GrammarCompiler | None = attrs.field(default=None, alias="compiler")
    _compiling: set[int] = attrs.field(factory=set, alias="compiling")  # leaders' ids
    _aborted_early: set[int] = attrs.field(factory=set, alias="aborted_early")
    _nursery: trio.Nursery | None = attrs.field(default=None, alias="nursery")
    _warnings: LogRateLimit = attrs.field(
        factory=lambda: LogRateLimit(lines=5, interval_s=60.0), alias="warnings"
    )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The link's pump and the flusher, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.link.run, self.on_message)
            nursery.start_soon(self._flush_forever)
            task_status.started()

    # ---- outputs ----

    def owe(self, batch: FrontBatch, record: list[Any]) -> None:
        if not batch.records:
            self._dirty.append(batch)
            self._owed.set()
        batch.records.append(record)

    async def _flush_forever(self) -> None:
        while True:
            await self._owed.wait()
            self._owed = trio.Event()
            self.flush()

    def flush(self) -> None:
        for batch in self._dirty:
            self.link.send_nowait([batch.identity, encode_outputs(batch.records)])
            batch.records = []
        self._dirty.clear()
        stopped = self.executor.stopped
        if stopped != self._told_stopped:  # the loop stops for good: every front answers 503
            self._told_stopped = stopped
            for front in self.fronts.values():
                self.link.send_nowait([front.identity, pack([Kind.STATE, stopped])])

    def stop_fronts(self) -> None:
        """Send what is owed, then tell every front to stop (`Kind.STOP`)."""
        self.flush()
        for front in self.fronts.values():
            self.link.send_nowait([front.identity, pack([Kind.STOP])])

    # ---- messages from fronts ----

    def on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._bad(b"?", f"a {len(frames)}-frame message")
            return
        identity, frame = frames
        try:
            self._handle(identity, unpack(frame))
        except WireError as exc:
            self._bad(identity, str(exc))

    def _bad(self, identity: bytes, what: str) -> None:
        self.bad_frames += 1
        who = identity.decode(errors="replace")
        log_limited(log, self._warnings, who, time.monotonic(), "dropped %s from front %s: %s",
                    "a frame", who, what)  # fmt: skip

    def _handle(self, identity: bytes, message: list[Any]) -> None:
        kind = message[0]
        if kind == Kind.HELLO:
            self._hello(identity, message)
            return
        front = self.fronts.get(identity)
        if front is None:
            raise WireError("a message before HELLO")
        if kind == Kind.SERVING:
            self._serving.add(identity)
            if len(self._serving) == self.num_fronts:
                self.all_serving.set()
        elif kind == Kind.SUBMIT and len(message) == 2:
            self._submit(front, decode_submit(message[1]))
        elif kind == Kind.ABORT and len(message) == 2 and isinstance(message[1], int):
            self._abort(front, message[1])
        elif kind == Kind.CALL and len(message) == 4 and isinstance(message[1], int):
            self._call(front, message[1], message[2], message[3])
        else:
            raise WireError(f"an unexpected or malformed message of kind {kind}")

    def _hello(self, identity: bytes, message: list[Any]) -> None:
        index = message[1] if len(message) == 2 else None
        if not isinstance(index, int) or not 0 <= index < self.num_fronts:
            raise WireError(f"HELLO names no front of {self.num_fronts}: {index!r}")
        self.fronts[identity] = FrontBatch(identity=identity, index=index)
        self.link.send_nowait([identity, pack([Kind.STATE, self.executor.stopped])])

    def _owns(self, front: FrontBatch, request_id: int) -> bool:
        """Front i mints ids i, i + N, i + 2N, ...: no two fronts' requests share an id."""
        return request_id >= 0 and request_id % self.num_fronts == front.index

    def _abort(self, front: FrontBatch, request_id: int) -> None:
        if not self._owns(front, request_id):
            raise WireError(f"ABORT of request {request_id}, not this front's")
        if request_id in self._compiling:
            self._aborted_early.add(request_id)
        self.executor.abort(request_id)

    def _submit(self, front: FrontBatch, group: SubmitGroup) -> None:
        ids = group.request_ids
        if not all(self._owns(front, i) and not self.executor.has_request(i) for i in ids):
            # Counted as a bad frame, and answered: the front waits for these ids' outputs.
            self._refuse(front, group, f"request ids {list(ids)}: not this front's, or in use")
            raise WireError(f"SUBMIT of requests {list(ids)}: not this front's, or in use")
        if group.grammar is None:
            self._queue(front, group, None)
            return
        compiler = self._grammar_compiler()
        if compiler.cached(group.grammar):
            self._queue(front, group, compiler.compile(group.grammar))
            return
        assert self._nursery is not None
        self._compiling.add(ids[0])
        self._nursery.start_soon(self._compile_then_queue, front, group, compiler)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(
                tokenizer_json=self.tokenizer_json,
                vocab_size=self.executor.vocab_size,
                eos_token_ids=sorted(self.executor.tokenizer.eos_token_ids),
            )
        return self._compiler

    async def _compile_then_queue(
        self, front: FrontBatch, group: SubmitGroup, compiler: GrammarCompiler
    ) -> None:
        leader = group.request_ids[0]
        assert group.grammar is not None
        try:
            template = await trio.to_thread.run_sync(compiler.compile, group.grammar)
        except GrammarError as exc:  # the front compiled it first: only a mismatch gets here
            self._refuse(front, group, f"{group.grammar.field}: {exc}")
            return
        finally:
            self._compiling.discard(leader)
        if leader in self._aborted_early:
            self._aborted_early.discard(leader)
            self._refuse(front, group, "aborted")
            return
        self._queue(front, group, template)

    def _queue(
        self, front: FrontBatch, group: SubmitGroup, grammar: GrammarTemplate | None
    ) -> None:
        choices = [
            Request(
                request_id=request_id,
                prompt_token_ids=list(group.prompt_token_ids),
                sampling=sampling,
                request_type=group.request_type,
                arrival_time=group.arrival_time,
                root=group.root,
            )
            for request_id, sampling in zip(group.request_ids, group.samplings, strict=True)
        ]
        sinks = [FrontSink(server=self, batch=front, request_id=i) for i in group.request_ids]
        try:
            self.executor.submit_group_into(
                choices,
                sinks,
                source=group.source,
                transfer_key=group.transfer_key,
                grammar=grammar,
            )
        except (CapacityError, WorkerStopped, ValueError) as exc:
            # The front checked what it could; this is a race (the engine just stopped).
            self._refuse(front, group, str(exc))

    def _refuse(self, front: FrontBatch, group: SubmitGroup, why: str) -> None:
        """End each choice of `group` with an error output, as the loop ends a failed one."""
        for request_id in group.request_ids:
            failed = RequestOutput(
                token_ids=(),
                text="",
                logprobs=(),
                finish_reason=FinishReason.ERROR,
                num_prompt_tokens=len(group.prompt_token_ids),
                num_cached_tokens=0,
                num_output_tokens=0,
                error=why,
                internal=True,
            )
            self.owe(front, encode_output(request_id, failed))
            self.owe(front, encode_closed(request_id))

    def _call(self, front: FrontBatch, call_id: int, call: Any, argument: Any) -> None:
        assert self._nursery is not None
        if call not in Call._value2member_map_:
            raise WireError(f"an unknown call {call!r}")
        self._nursery.start_soon(self._answer, front, call_id, Call(call), argument)

    async def _answer(self, front: FrontBatch, call_id: int, call: Call, argument: Any) -> None:
        engine = LocalEngine(executor=self.executor)
        result: Any = None
        if call in (Call.RELEASE_SEND, Call.SENDING_KEY_IN_USE, Call.RECEIVING_KEY_IN_USE):
            if not isinstance(argument, int) or not 0 <= argument < 2**64:
                self._bad(front.identity, f"call {call.name} with key {argument!r}")
            elif call is Call.RELEASE_SEND:
                result = await engine.release_send(argument)
            else:
                sending = call is Call.SENDING_KEY_IN_USE
                result = await engine.transfer_key_in_use(argument, sending=sending)
        elif call is Call.METRICS:
            result = await engine.render_metrics()
        elif call is Call.KV_EVENTS:
            if argument is not None and (type(argument) is not int or argument < -1):
                self._bad(front.identity, f"KV_EVENTS after {argument!r}")
            else:
                result = await engine.drain_kv_events(argument)
        elif call is Call.KV_DIGESTS:
            result = await engine.kv_digests()
        elif call is Call.FAIL_STEPS:
            if not isinstance(argument, int) or not 0 <= argument <= 1000:
                self._bad(front.identity, f"FAIL_STEPS with count {argument!r}")
            else:
                await engine.fail_steps(argument)
        # A malformed call is answered too (None), so that no front waits for ever.
        self.link.send_nowait([front.identity, pack([Kind.REPLY, call_id, result])])
