"""The scheduler: which requests run in the next forward step, and with how many tokens.

Continuous batching with chunked prefill. Each step carries at most ``max_num_tokens`` tokens
(fewer while requests decode: ``StepBudget``) and ``max_batch_size`` sequences, in this order:

1. RUNNING requests that decode, one token each, in admission order. A decode that cannot get a
   block preempts the most recently admitted RUNNING request not yet scheduled this step
   (possibly itself): its blocks are released, it goes back to the head of the waiting queue and
   later recomputes prompt and outputs. A request that is the only holder of blocks and still
   cannot grow is finished with LENGTH: it needs more KV than the pool has. Never a deadlock.
2. RUNNING requests still in prefill, the next chunk each, within the remaining budget. A chunk
   is shrunk to the blocks available; if not even one token fits, it preempts as in 1.
3. WAITING requests, first come first served, while budget, batch slots and blocks allow. The
   prefix cache gives each its already computed leading blocks. A request whose chunk cannot get
   blocks stays at the head, and nothing behind it is admitted (no starvation). Nothing is
   admitted in a step that preempted: those blocks were freed for the running requests.

A chunk that reaches a request's last token samples: that step produces the request's next token
(``n`` of them for ``n`` choices, which ``fork`` starts: shared blocks, copied on write).
GEN_WAITING_KV and CTX_SENDING requests hold blocks that a peer writes or reads: never scheduled
nor preempted, they count against the pool (and GEN_WAITING_KV, to decode, against batch slots).

Calling protocol (the engine loop): ``plan = schedule()``, ``step_launched(plan)`` once its forward
is queued, ``step_finished(plan)`` once it ran (``step_done``: both), before the next ``schedule``;
then sampled tokens are appended, requests that are done ``finish``ed or ``hold_for_transfer``ed,
and ``plan.finished`` (LENGTH) answered. A token still in flight counts in ``pending_tokens``: the
next plan decodes from it, and a request that surely ends with it is not scheduled again. A
request ended while a launched step computes it keeps its blocks until that step finished
(``in_flight.py``); preemption frees at once (the step in flight writes them first: one stream).

Pure: no I/O. See ``request`` for the request lifecycle and ``kv.block_pool`` for blocks.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from trtdisagg.errors import CapacityError, InvalidTransition
from trtdisagg.kv.block_pool import BlockCopy, BlockPool, BlockTable
from trtdisagg.worker import step_plan
from trtdisagg.worker.in_flight import InFlight
from trtdisagg.worker.request import FinishReason, Request, RequestState, RequestType
from trtdisagg.worker.step_plan import ScheduledItem, SchedulerStatistics, StepBuilder, StepPlan

__all__ = ["ScheduledItem", "Scheduler", "SchedulerStatistics", "StepPlan"]


class Scheduler:
    """Queues, admission, chunking and preemption over one ``BlockPool``.

    Args:
        pool: the rank's block pool; the scheduler is its only user.
        max_batch_size: sequences per step (and RUNNING + GEN_WAITING_KV requests at once).
        max_num_tokens: tokens per step; longer prompts are prefilled in chunks.
        max_seq_len: most tokens (prompt + output) a sequence may reach.
        max_logit_rows: budget of prompt-logprobs positions (logits rows) a step; None: no cap.
        prefill_chunk_tokens: a step's tokens per prompt while requests decode (``StepBudget``).
    """

    def __init__(
        self,
        *,
        pool: BlockPool,
        max_batch_size: int,
        max_num_tokens: int,
        max_seq_len: int,
        max_logit_rows: int | None = None,
        prefill_chunk_tokens: int | None = None,
    ) -> None:
        self._budget = step_plan.StepBudget(
            max_num_tokens=max_num_tokens,
            prefill_chunk_tokens=prefill_chunk_tokens,
            max_batch_size=max_batch_size,
        )
        self._max_logit_rows = max_num_tokens if max_logit_rows is None else max_logit_rows
        for name, value in (("max_seq_len", max_seq_len), ("max_logit_rows", self._max_logit_rows)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self._pool = pool
        self._max_batch_size = max_batch_size
        self._max_seq_len = max_seq_len
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []  # admission order: the last is the first victim
        self._gen_waiting_kv: dict[int, Request] = {}
        self._ctx_sending: dict[int, Request] = {}
        self._requests: dict[int, Request] = {}  # every unfinished request, by id
        self._num_preemptions = 0
        self._plan_unlaunched = False  # a plan was scheduled and not launched (or done) yet
        self._in_flight = InFlight()  # launched plans' requests; blocks that wait for them

    @property
    def pool(self) -> BlockPool:
        return self._pool

    # ---- intake ----

    def add(self, request: Request) -> None:
        """Queue a new request (WAITING, FCFS).

        Raises:
            CapacityError: the prompt can never fit the pool or ``max_seq_len``.
            ValueError: the id is already known, or the request is not a fresh WAITING one.
        """
        self._check_new(request)
        self._waiting.append(request)
        self._requests[request.request_id] = request

    def add_generation_only(self, request: Request) -> bool:
        """Allocate blocks for a generation_only request's whole prompt; it waits for its KV.

        No prefix reuse: the ctx instance sends the whole prompt's KV. On success the request is
        GEN_WAITING_KV and its ``block_table`` is the transfer's destination. On False nothing
        changed; the caller keeps the request in its own FIFO and retries after the next step.
        False also while WAITING requests exist, which arrived first and must not be starved.

        Raises:
            CapacityError: the prompt can never fit the pool or ``max_seq_len``.
            ValueError: not a fresh generation_only request, or the id is already known.
        """
        if request.request_type is not RequestType.GENERATION_ONLY:
            raise ValueError(
                f"request {request.request_id} is {request.request_type.value}, not generation_only"
            )
        self._check_new(request)
        if self._waiting or self._num_slots_taken() >= self._max_batch_size:
            return False
        table = self._pool.open_table(request.prompt_token_ids, reuse=False, root=request.root)
        if not self._pool.grow(table, request.num_prompt_tokens):
            self._pool.release(table)
            return False
        request.to(RequestState.GEN_WAITING_KV)
        request.block_table = table
        request.num_cached_tokens = 0
        self._gen_waiting_kv[request.request_id] = request
        self._requests[request.request_id] = request
        return True

    def kv_received(self, request: Request, first_token: int) -> None:
        """The whole prompt's KV arrived: GEN_WAITING_KV → RUNNING, ``first_token`` as output 0.
        The received blocks join the prefix cache like locally computed ones."""
        self._expect(request, RequestState.GEN_WAITING_KV, RequestState.RUNNING)
        table = request.block_table
        if table is None or len(table.block_ids) < self._pool.blocks_for(request.num_prompt_tokens):
            raise AssertionError(f"request {request.request_id}: blocks do not cover the prompt")
        if request.output_token_ids:
            raise AssertionError(f"request {request.request_id} has outputs before its KV")
        del self._gen_waiting_kv[request.request_id]
        request.to(RequestState.RUNNING)
        request.num_computed_tokens = request.num_prompt_tokens
        request.output_token_ids.append(first_token)
        self._running.append(request)
        self._pool.commit(table, request.prompt_token_ids, request.num_computed_tokens)

    def fork(self, request: Request, forks: Sequence[Request]) -> None:
        """``request`` sampled the first token of each choice of its prompt (``n``): each of
        ``forks`` (the other choices: new requests with the same prompt, each holding its own
        first token as output 0) goes on from the prompt's KV, RUNNING, its blocks shared with
        ``request`` until written (``BlockPool.fork``; the copy is ``StepPlan.copies``).

        Raises:
            InvalidTransition: ``request`` is not RUNNING.
            ValueError: a fork is not a fresh WAITING request of the same prompt with one output.
        """
        if request.state is not RequestState.RUNNING:
            raise InvalidTransition(request.request_id, request.state, RequestState.RUNNING)
        table = _table(request)
        for fork in forks:
            self._check_new(fork)
            if fork.prompt_token_ids != request.prompt_token_ids or fork.num_output_tokens != 1:
                raise ValueError(
                    f"request {fork.request_id} is no fork of {request.request_id}: it needs the "
                    "same prompt and its own first token"
                )
        for fork in forks:
            fork.to(RequestState.RUNNING)
            fork.block_table = self._pool.fork(table)
            # The prompt: the leader may have a step in flight past it already.
            fork.num_computed_tokens = request.num_prompt_tokens
            fork.num_cached_tokens = request.num_cached_tokens
            self._running.append(fork)
            self._requests[fork.request_id] = fork

    # ---- the step ----

    def schedule(self) -> StepPlan:
        """Pick the next step's work (module docstring, policy 1-3)."""
        if self._plan_unlaunched:
            raise AssertionError(
                "schedule() called before step_done() (or step_launched()) of the previous plan"
            )
        budget = self._budget.tokens(self._running, num_waiting=len(self._waiting))
        step = StepBuilder(budget=budget, logit_rows=self._max_logit_rows)
        self._schedule_decodes(step)
        self._schedule_prefills(step)
        if not step.preempted:
            self._admit_waiting(step)
        self._plan_unlaunched = bool(step.items)
        return step.plan(budget)

    def step_done(self, plan: StepPlan) -> None:
        """The plan's forward ran (a synchronous step): ``step_launched``, ``step_finished``."""
        self.step_launched(plan)
        self.step_finished(plan)

    def step_launched(self, plan: StepPlan) -> None:
        """The plan's forward is queued: advance each item's computed tokens, and cache the full
        blocks whose tokens are known (a pending token's block is cached a step later).

        Items whose request left RUNNING meanwhile (aborted during the forward) are skipped.
        Until `step_finished(plan)`, a request of the plan that ends keeps its blocks.
        """
        self._plan_unlaunched = False
        self._in_flight.launched(item.request.request_id for item in plan.items)
        for item in plan.items:
            request = item.request
            if request.state is not RequestState.RUNNING:
                continue
            request.num_computed_tokens += item.num_new_tokens
            table = _table(request)
            # Commit only when a block filled up, so most steps skip building the token list.
            known = min(request.num_computed_tokens, request.num_known_tokens)
            num_full = known // self._pool.tokens_per_block
            if self._pool.enable_block_reuse and num_full > table.num_committed_blocks:
                self._pool.commit(table, request.all_token_ids, known)

    def step_finished(self, plan: StepPlan) -> None:
        """The plan's forward ran on the device: blocks of its requests that ended meanwhile,
        held for it, are released now (unless another launched plan still holds them)."""
        for table in self._in_flight.finished(item.request.request_id for item in plan.items):
            self._pool.release(table)

    def _schedule_decodes(self, step: StepBuilder) -> None:
        for request in list(self._running):
            if request.state is not RequestState.RUNNING or request.is_prefilling:
                continue  # preempted earlier in this loop, or a prefill (step 2)
            self._check_runnable(request)
            if len(step.items) >= self._max_batch_size or step.budget < 1:
                return
            if request.pending_tokens and self._ends_with_pending(request):
                continue  # its last token is in flight: it ends when that token arrives
            if request.num_tokens >= self._max_seq_len:
                self._finish_in_step(step, request)
                continue
            if self._grow_or_preempt(step, request, request.num_computed_tokens + 1):
                step.add(request, 1)

    def _schedule_prefills(self, step: StepBuilder) -> None:
        for request in list(self._running):
            if request.state is not RequestState.RUNNING or not request.is_prefilling:
                continue
            if request.request_id in step.scheduled:
                continue
            if len(step.items) >= self._max_batch_size or step.budget < 1:
                return
            room = step.room(request, request.num_tokens - request.num_computed_tokens)
            if room < 1:
                continue  # its logits rows are spent this step (prompt logprobs)
            chunk = self._fit_chunk(request, room)
            if chunk < 1:
                if not self._grow_or_preempt(step, request, request.num_computed_tokens + 1):
                    continue
                chunk = self._fit_chunk(request, room)
            if not self._pool.grow(_table(request), request.num_computed_tokens + chunk):
                raise AssertionError(f"request {request.request_id}: fitted chunk {chunk} failed")
            step.add(request, chunk)

    def _admit_waiting(self, step: StepBuilder) -> None:
        while self._waiting and step.budget > 0 and len(step.items) < self._max_batch_size:
            if self._num_slots_taken() >= self._max_batch_size:
                return
            request = self._waiting[0]
            if request.pending_tokens:
                return  # preempted with a token in flight: it recomputes once the token is here
            # Prompt logprobs come from computing every prompt token: no prefix-cache hits.
            reuse = request.sampling.prompt_logprobs is None
            table = self._pool.open_table(request.all_token_ids, reuse=reuse, root=request.root)
            num_computed = table.num_cached_tokens
            chunk = step.room(request, request.num_tokens - num_computed)
            if chunk < 1 or not self._pool.grow(table, num_computed + chunk):
                self._pool.release(table)
                return  # FCFS: nothing jumps the head
            self._waiting.popleft()
            request.to(RequestState.RUNNING)
            request.block_table = table
            request.num_computed_tokens = num_computed
            request.num_cached_tokens = min(num_computed, request.num_prompt_tokens)
            self._running.append(request)
            step.add(request, chunk)

    def _grow_or_preempt(self, step: StepBuilder, request: Request, num_tokens: int) -> bool:
        """Grow ``request`` to ``num_tokens``, with blocks of its own where it writes (a fork's
        shared block is copied: ``step.copies``), preempting newer requests while needed.

        Returns False when ``request`` itself was preempted or finished instead.
        """
        table = _table(request)
        copies: list[BlockCopy] = []
        while True:
            unshared = self._pool.unshare(table, request.num_computed_tokens)
            if unshared is not None:
                copies += unshared  # kept even if growing fails: the blocks are its own now
                if self._pool.grow(table, num_tokens):
                    step.copies += copies
                    return True
            victim = next(
                (r for r in reversed(self._running) if r.request_id not in step.scheduled),
                request,
            )
            if victim is request and self._holds_all_blocks(request):
                # Nobody else will ever free a block: the request needs more KV than the pool.
                self._finish_in_step(step, request)
                return False
            self._preempt(step, victim)
            if victim is request:
                return False

    def _fit_chunk(self, request: Request, chunk: int) -> int:
        """``chunk`` cut down to the tokens the table can cover with the blocks available now."""
        blocks = len(_table(request).block_ids) + self._pool.num_available_blocks
        capacity = blocks * self._pool.tokens_per_block
        return max(0, min(chunk, capacity - request.num_computed_tokens))

    def _preempt(self, step: StepBuilder, request: Request) -> None:
        self._running.remove(request)
        self._pool.release(_table(request))
        request.block_table = None
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.to(RequestState.WAITING)
        # Victims go newest first, so pushing each to the front keeps admission order.
        self._waiting.appendleft(request)
        self._num_preemptions += 1
        step.preempted.append(request)

    def _finish_in_step(self, step: StepBuilder, request: Request) -> None:
        self.finish(request, FinishReason.LENGTH)
        step.finished.append(request)

    # ---- endings ----

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request from any state and release its blocks. A no-op if already FINISHED.

        A context_only request whose KV is still to be sent goes through ``hold_for_transfer``
        instead, and ``release`` ends it.
        """
        if request.state is RequestState.FINISHED:
            return
        if self._requests.get(request.request_id) is not request:
            raise ValueError(f"request {request.request_id} is not in this scheduler")
        request.to(RequestState.FINISHED)
        self._forget(request)
        if request.block_table is not None:
            if self._in_flight.computing(request.request_id):
                self._in_flight.park(request.request_id, request.block_table)
            else:
                self._pool.release(request.block_table)
            request.block_table = None
        request.finish_reason = reason

    def hold_for_transfer(self, request: Request) -> None:
        """A context_only request sampled its first token: RUNNING → CTX_SENDING, blocks pinned.

        Raises:
            InvalidTransition: the request is not a RUNNING context_only request.
        """
        self._expect(request, RequestState.RUNNING, RequestState.CTX_SENDING)
        request.check_transition(RequestState.CTX_SENDING)
        # The gen side will ask for the whole prompt's KV: it must be computed, in these blocks.
        num_blocks = len(_table(request).block_ids)
        prompt_blocks = self._pool.blocks_for(request.num_prompt_tokens)
        if request.num_computed_tokens < request.num_prompt_tokens or num_blocks < prompt_blocks:
            raise AssertionError(
                f"request {request.request_id}: {request.num_computed_tokens} of "
                f"{request.num_prompt_tokens} prompt tokens computed in {num_blocks} "
                "blocks; hold_for_transfer() comes after the prefill's step_done()"
            )
        request.to(RequestState.CTX_SENDING)
        self._running.remove(request)
        self._ctx_sending[request.request_id] = request

    def release(self, request: Request, reason: FinishReason = FinishReason.LENGTH) -> None:
        """The transfer of a CTX_SENDING request is final: finish it and free its blocks.

        ``reason`` defaults to LENGTH, as a context_only leg ends by producing its one token;
        pass ERROR or ABORT for a failed or cancelled transfer. A no-op if already FINISHED.
        """
        if request.state is RequestState.FINISHED:
            return
        self._expect(request, RequestState.CTX_SENDING, RequestState.FINISHED)
        self.finish(request, reason)

    def abort(self, request_id: int) -> Request | None:
        """Abort a request in any state; None if unknown (or already finished).

        A CTX_SENDING request is returned untouched: a peer may be reading its blocks, so the
        caller cancels the transfer and calls ``release`` once the transport says it is final.
        """
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.state is not RequestState.CTX_SENDING:
            self.finish(request, FinishReason.ABORT)
        return request

    # ---- queries ----

    def get(self, request_id: int) -> Request | None:
        """An unfinished request by id."""
        return self._requests.get(request_id)

    def has_work(self) -> bool:
        """Whether any request is schedulable (WAITING or RUNNING). ``schedule`` may still
        return an empty plan while transfers pin every block: the loop then waits, not spins."""
        return bool(self._waiting or self._running)

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_gen_waiting_kv=len(self._gen_waiting_kv),
            num_ctx_sending=len(self._ctx_sending),
            num_preemptions=self._num_preemptions,
            pool=self._pool.statistics(),
        )

    # ---- internals ----

    def _check_new(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id} is already in the scheduler")
        if request.state is not RequestState.WAITING or request.block_table is not None:
            raise ValueError(
                f"request {request.request_id} is {request.state.name}, not a new WAITING request"
            )
        num_prompt = request.num_prompt_tokens
        if num_prompt >= self._max_seq_len:
            raise CapacityError(
                f"prompt has {num_prompt} tokens; the maximum sequence length is "
                f"{self._max_seq_len}, which leaves no room to generate",
                request_id=request.request_id,
            )
        capacity = self._pool.num_blocks * self._pool.tokens_per_block
        if num_prompt + 1 > capacity:
            raise CapacityError(
                f"prompt has {num_prompt} tokens; the KV cache holds {capacity}",
                request_id=request.request_id,
            )

    def _check_runnable(self, request: Request) -> None:
        if request.num_computed_tokens > request.num_tokens - 1:
            raise AssertionError(
                f"request {request.request_id}: {request.num_computed_tokens} tokens computed of "
                f"{request.num_tokens}; a sampled token was not appended after step_done()"
            )

    def _expect(self, request: Request, state: RequestState, to: RequestState) -> None:
        if request.state is not state:
            raise InvalidTransition(request.request_id, request.state, to)
        if self._requests.get(request.request_id) is not request:
            raise ValueError(f"request {request.request_id} is not in this scheduler")

    def _forget(self, request: Request) -> None:
        del self._requests[request.request_id]
        self._gen_waiting_kv.pop(request.request_id, None)
        self._ctx_sending.pop(request.request_id, None)
        if request in self._running:
            self._running.remove(request)
        if request in self._waiting:
            self._waiting.remove(request)

    def _ends_with_pending(self, request: Request) -> bool:
        """Whether the token in flight surely ends the request, whatever its value: the first
        token of a context_only request, the `max_tokens`-th, or the context's last."""
        return (
            request.request_type is RequestType.CONTEXT_ONLY
            or request.num_output_tokens + request.pending_tokens >= request.sampling.max_tokens
            or request.num_tokens >= self._max_seq_len
        )

    def _holds_all_blocks(self, request: Request) -> bool:
        """No other request holds blocks that it could free later."""
        return (
            self._running == [request]
            and not self._gen_waiting_kv
            and not self._ctx_sending
            and not self._in_flight.num_parked
        )

    def _num_slots_taken(self) -> int:
        return len(self._running) + len(self._gen_waiting_kv)


def _table(request: Request) -> BlockTable:
    table = request.block_table
    if table is None:
        raise AssertionError(f"request {request.request_id} is RUNNING without blocks")
    return table
