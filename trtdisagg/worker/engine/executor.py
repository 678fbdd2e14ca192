"""The Executor: what the HTTP side calls (submit, abort, release, queries); the loop does the work.

Its commands are sync and never block: they go to the inbox, which the loop takes between steps
(`loop.py`). The handlers' requests and blocks are thus only ever changed by the loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch
import trio

from trtdisagg.errors import WorkerStopped
from trtdisagg.metrics import WorkerMetrics
from trtdisagg.transfer.runtime.driver import KvTransceiver
from trtdisagg.worker.engine.live import (
    GenerationSource,
    Inbox,
    Live,
    OutputSink,
    RequestHandle,
)
from trtdisagg.worker.engine.loop import StepLoop
from trtdisagg.worker.engine.outputs import OutputState, RequestOutput
from trtdisagg.worker.engine.tracker import TransferTracker
from trtdisagg.worker.request import Request, check_fits
from trtdisagg.worker.sampling import new_spec
from trtdisagg.worker.scheduler import Scheduler
from trtdisagg.worker.stopping import StopStrings
from trtdisagg.worker.tokenization import Tokenizer

if TYPE_CHECKING:
    from trtdisagg.worker.engine.test_hooks import TestHooks
    from trtdisagg.worker.grammar import GrammarTemplate

__all__ = ["Executor", "GenerationSource", "OutputSink", "RequestHandle", "RequestOutput"]


@attrs.define(eq=False, kw_only=True)
class Executor:
    loop: StepLoop
    inbox: Inbox
    tracker: TransferTracker
    tokenizer: Tokenizer
    device: torch.device  # where each request's sampling generator lives
    vocab_size: int  # the width of the model's logits (what one sample draws over)
    max_seq_len: int
    metrics: WorkerMetrics
    # For the HTTP side (endpoint, instance name, KV compatibility); the engine's own transfer
    # work goes through its driver.
    transceiver: KvTransceiver | None = None
    test_hooks: TestHooks | None = None  # read and armed by the /debug routes (test_hooks.py)

    # ---- commands from handlers (sync, never block) ----

    def submit(
        self,
        request: Request,
        *,
        source: GenerationSource | None = None,
        transfer_key: int | None = None,
    ) -> RequestHandle:
        """Queue a request. Raises CapacityError if it could never fit, so the caller can 400.

        `source` is required for generation_only requests, `transfer_key` for context_only.
        Raises WorkerStopped once the worker stopped serving, so the caller can 503.
        """
        [handle] = self.submit_group([request], source=source, transfer_key=transfer_key)
        return handle

    def submit_group(
        self,
        choices: Sequence[Request],
        *,
        source: GenerationSource | None = None,
        transfer_key: int | None = None,
        grammar: GrammarTemplate | None = None,
    ) -> list[RequestHandle]:
        """Queue one prompt's `n` choices: one request each, with its own id and seed, the same
        prompt and type. The first is prefilled (or receives the KV) once for all; the others
        fork from it at their first tokens (`forks.py`). One handle per choice, in order.
        With `grammar`, each choice's output follows it (its own matcher: `worker/grammar.py`).

        Raises CapacityError (400) or WorkerStopped (503) as `submit` does.
        """
        handles: list[RequestHandle] = []
        sinks: list[OutputSink] = []
        for request in choices:
            send, receive = trio.open_memory_channel[RequestOutput](math.inf)
            sinks.append(send)
            handles.append(RequestHandle(request=request, outputs=receive))
        self.submit_group_into(
            choices, sinks, source=source, transfer_key=transfer_key, grammar=grammar
        )
        return handles

    def submit_group_into(
        self,
        choices: Sequence[Request],
        sinks: Sequence[OutputSink],
        *,
        source: GenerationSource | None = None,
        transfer_key: int | None = None,
        grammar: GrammarTemplate | None = None,
    ) -> None:
        """`submit_group` with each choice's outputs going to its own sink (a front process's
        batch: `worker/front/`) instead of a new channel. Raises as `submit_group` does."""
        if self.stopped is not None:
            raise WorkerStopped(f"this worker stopped serving: {self.stopped}")
        if len(sinks) != len(choices):
            raise ValueError("one sink per choice")
        leader = choices[0]
        self.check_fits(leader)
        if any(c.prompt_token_ids != leader.prompt_token_ids for c in choices[1:]):
            raise ValueError("the choices of one group share their prompt")
        lives: list[Live] = []
        for i, (request, sink) in enumerate(zip(choices, sinks, strict=True)):
            key = transfer_key if i == 0 else None  # the leader sends the KV for all
            live = self._live(request, sink, choice=i, source=source, transfer_key=key)
            live.grammar = grammar.matcher() if grammar is not None else None
            lives.append(live)
        head, *forks = lives
        head.forks = forks
        for fork in forks:
            fork.leader = head
        self.inbox.submit(head)

    def _live(
        self,
        request: Request,
        outputs: OutputSink,
        *,
        choice: int,
        source: GenerationSource | None,
        transfer_key: int | None,
    ) -> Live:
        params = request.sampling
        # A generation_only request's first token was ctx's: a seeded one continues the random
        # stream ctx drew it from, so it samples the same tokens split or not.
        spec = new_spec(
            request,
            device=self.device,
            width=self.vocab_size,
            eos_token_ids=self.tokenizer.eos_token_ids,
            after_first_token=source is not None,
        )
        state = OutputState(
            detokenizer=self.tokenizer.incremental_detokenizer(
                skip_special_tokens=params.skip_special_tokens
            ),
            stops=StopStrings(stops=params.stop, include=params.include_stop_str_in_output),
        )
        return Live(
            request=request,
            outputs=outputs,
            state=state,
            spec=spec,
            source=source if choice == 0 else None,
            transfer_key=transfer_key,
            choice=choice,
        )

    def abort(self, request_id: int) -> None:
        self.inbox.abort(request_id)

    def release_send(self, key: int) -> bool:
        """ctx: the coordinator gave up on the gen leg of transfer `key` before any gen took
        its KV (no gen, refused, unreachable, or its client left): stop holding the KV now, as
        a gen's CANCEL would, not at `kv_transfer_timeout_ms`. A write already in flight runs
        to its end first. A request still prefilling for `key` (or queued) ends at the next
        step, and one not here yet ends when it comes (the loop's `_release`). False when no
        request of this worker holds KV under `key`, or is making it."""
        self.inbox.release(key)
        if self.tracker.holds_send(key):
            return True
        lives = (*self.inbox.new, *self.loop.lives.values())
        return any(live.transfer_key == key for live in lives)

    # ---- queries ----

    @property
    def scheduler(self) -> Scheduler:
        return self.loop.scheduler

    @property
    def stopped(self) -> str | None:
        """Why this worker stopped serving (its model steps kept failing); None while it serves."""
        return self.loop.stopped

    def has_request(self, request_id: int) -> bool:
        """Whether a request with this id is queued or served here."""
        return request_id in self.loop.lives or any(
            live.request_id == request_id or any(f.request_id == request_id for f in live.forks)
            for live in self.inbox.new
        )

    def num_active(self) -> int:
        return len(self.loop.lives) + len(self.inbox.new)

    def transfer_key_in_use(self, key: int, *, sending: bool) -> bool:
        """Whether a request of this worker already sends (ctx) or receives (gen) under `key`.

        A second one would share the first one's transfer session and mix two requests' KV
        (DESIGN.md §6), so the HTTP layer refuses it. One worker may send and receive the same
        key (it is then its own ctx and gen), hence the side.
        """
        if self.tracker.key_in_use(key, sending=sending):
            return True
        lives = [*self.inbox.new, *self.loop.lives.values()]
        if sending:
            return any(live.transfer_key == key for live in lives)
        return any(live.source is not None and live.source.key == key for live in lives)

    def refresh_gauges(self) -> None:
        """Bring the gauges up to date (before `/metrics` renders them)."""
        stats = self.scheduler.statistics()
        self.metrics.requests_running.set(stats.num_running)
        # Queued: for a prefill (or a recompute), or, on gen, for blocks to receive KV into.
        self.metrics.requests_waiting.set(stats.num_waiting + self.tracker.awaiting_blocks)
        pool = stats.pool
        self.metrics.kv_total_blocks.set(pool.total_blocks)
        self.metrics.kv_free_blocks.set(pool.free_blocks)
        self.metrics.kv_reusable_blocks.set(pool.reusable_blocks)

    def check_fits(self, request: Request) -> None:
        """Raise CapacityError when the request's prompt could never be served here."""
        pool = self.scheduler.pool
        check_fits(
            request.num_prompt_tokens,
            max_seq_len=self.max_seq_len,
            capacity=pool.num_blocks * pool.tokens_per_block,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The loop, until cancelled (or until a step on a multi-rank instance raises)."""
        await self.loop.run(task_status=task_status)
