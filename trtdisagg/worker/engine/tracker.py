"""The transfer tracker: which requests wait on a KV transfer, and what each outcome does (pure).

It owns the four transfer containers and nothing else holds them:

    waiting       gen requests that wait for blocks for their whole prompt (FIFO)
    receiving     gen requests whose KV is landing, by transfer key
    sending       ctx requests whose KV is pinned for gen, by transfer key
    quarantined   gen requests that ended while a ctx write may still land in their blocks

and turns transfer outcomes into scheduler calls: KV landed (`kv_received`, the first token
goes to the output processor), a receive failed (finish, or quarantine while a write may land),
a send is final (`release`). It also remembers, for `EARLY_RELEASE_S`, the transfer keys whose
release came before any request had them (the coordinator gave up on a request whose ctx leg
had not reached this worker yet): such a request ends as soon as it comes. Transfer work goes
to a `TransferPort` (the step driver), which does it on every rank; the tracker does no I/O
itself. docs/LIFECYCLE.md has the whole lifecycle.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from trtdisagg.worker.engine.ending import Blocks, Ending
from trtdisagg.worker.engine.forks import start_choices
from trtdisagg.worker.engine.outputs import Token
from trtdisagg.worker.request import FinishReason, Request
from trtdisagg.worker.scheduler import Scheduler

if TYPE_CHECKING:
    from trtdisagg.transfer.protocol.sessions import TransferOutcome
    from trtdisagg.worker.engine.live import GenerationSource, Live
    from trtdisagg.worker.engine.ports import TransferPort

log = logging.getLogger(__name__)

# How long, and how many, transfer keys released before their request came are remembered: the
# release and the request race over two HTTP connections, which takes milliseconds, not seconds.
EARLY_RELEASE_S = 10.0
MAX_EARLY_RELEASES = 4096


@attrs.frozen(kw_only=True)
class Polled:
    """What the transfers that finished since the last poll mean for their requests."""

    arrived: tuple[Token, ...] = ()  # gen: KV landed; the request runs, ctx's token is its first
    failed: tuple[tuple[Live, Ending], ...] = ()  # gen: the KV cannot come; blocks settled
    failures: int = 0  # failed transfers (and first tokens gen cannot use), both sides


_NOTHING = Polled()


@attrs.define(eq=False, kw_only=True)
class TransferTracker:
    scheduler: Scheduler
    port: TransferPort
    vocab_size: int
    _waiting: collections.deque[Live] = attrs.field(factory=collections.deque, alias="waiting")
    _receiving: dict[int, Live] = attrs.field(factory=dict, alias="receiving")
    _sending: dict[int, Request] = attrs.field(factory=dict, alias="sending")
    _quarantined: dict[int, Request] = attrs.field(factory=dict, alias="quarantined")
    # transfer key -> when its release came, before any request had that key (oldest first)
    _early_releases: collections.OrderedDict[int, float] = attrs.field(
        factory=collections.OrderedDict, alias="early_releases"
    )

    # ---- gen: receive ----

    def wait_for_blocks(self, live: Live) -> None:
        """A generation_only request arrived; it asks for its KV once it has blocks."""
        if live.source is None:
            raise ValueError(f"request {live.request_id} has no KV source: not generation_only")
        self._waiting.append(live)

    @property
    def awaiting_blocks(self) -> int:
        """gen requests queued until the pool has blocks for their KV."""
        return len(self._waiting)

    def start_receives(self) -> None:
        """Give waiting gen requests blocks, first come first served, and ask ctx for their KV."""
        while self._waiting:
            live = self._waiting[0]
            if not self.scheduler.add_generation_only(live.request):
                return
            self._waiting.popleft()
            source, table = live.source, live.request.block_table
            assert source is not None and table is not None
            self._receiving[source.key] = live
            self.port.receive(
                source.key,
                source.ctx_info_endpoint,
                table.block_ids,
                live.request.num_prompt_tokens,
                source.ctx_instance,
            )

    # ---- ctx: send ----

    def release_send(self, key: int) -> bool:
        """The coordinator gave up on `key`'s gen leg: stop holding its KV as a CANCEL from gen
        would. False when no request sends under `key` any more (its transfer ended)."""
        if key not in self._sending:
            return False
        log.info("KV send %d released: its gen leg never took it", key)
        self.port.cancel(key)
        return True

    def remember_release(self, key: int, now: float) -> None:
        """A release of `key` that found no request: the request may still come."""
        self._early_releases.pop(key, None)
        self._early_releases[key] = now
        oldest = next(iter(self._early_releases.values()))
        while len(self._early_releases) > MAX_EARLY_RELEASES or now - oldest >= EARLY_RELEASE_S:
            self._early_releases.popitem(last=False)
            oldest = next(iter(self._early_releases.values()), now)

    def take_early_release(self, key: int, now: float) -> bool:
        """Whether a context_only request of `key` that just came was released already."""
        at = self._early_releases.pop(key, None)
        return at is not None and now - at < EARLY_RELEASE_S

    # ---- endings ----

    def settle(self, live: Live, ending: Ending) -> None:
        """Carry out what `ending` says of an ending request's blocks and transfer."""
        if ending.blocks is Blocks.SEND:
            self._hand_over(live)
            return
        key = live.transfer_key
        if key is not None and key not in self._sending:
            # A context_only request that ends without sending: a gen that asked for its KV
            # first (generation_first) is refused now, not at its deadline.
            self.port.abandon(key, ending.why_not_sent)
        if ending.blocks is Blocks.FREE:
            self._free(live, ending.reason)

    def _hand_over(self, live: Live) -> None:
        """ctx: the first token is out; pin the blocks and send the KV when gen asks."""
        request, key, table = live.request, live.transfer_key, live.request.block_table
        if key is None or table is None:
            raise ValueError(f"request {live.request_id} has no KV to send")
        self.scheduler.hold_for_transfer(request)
        self._sending[key] = request
        # Every choice's first token (its forks ride this hand-over: forks.py), in order.
        first_tokens = (
            *request.output_token_ids[:1],
            *(fork.request.output_token_ids[0] for fork in live.forks),
        )
        self.port.send(key, table.block_ids, request.num_prompt_tokens, first_tokens)

    def _free(self, live: Live, reason: FinishReason) -> None:
        """End the request in the scheduler, wherever it is; blocks a write may still reach
        stay held (quarantined) until no write can."""
        request = live.request
        if live in self._waiting:
            self._waiting.remove(live)  # not in the scheduler yet: it holds nothing
            return
        source = live.source
        if source is not None and self._receiving.get(source.key) is live:
            del self._receiving[source.key]
            if not self.port.cancel(source.key):
                self._quarantined[source.key] = request
                return
        if not request.is_finished:
            self.scheduler.finish(request, reason)

    # ---- outcomes ----

    def poll(self, receives: Sequence[TransferOutcome], sends: Sequence[TransferOutcome]) -> Polled:
        """Apply the transfers that reached a final state (on every rank)."""
        if not (receives or sends or self._quarantined):
            return _NOTHING  # the common case, once per loop round
        arrived: list[Token] = []
        failed: list[tuple[Live, Ending]] = []
        failures = 0
        for outcome in receives:
            quarantined = self._quarantined.pop(outcome.key, None)
            if quarantined is not None:  # no write can land any more
                self.scheduler.abort(quarantined.request_id)
                continue
            live = self._receiving.pop(outcome.key, None)
            if live is None:
                continue
            live.state.transferred(outcome.num_bytes, outcome.seconds)
            if not outcome.ok:
                failures += 1
                if outcome.blocks_held:
                    # A ctx write may still land: the request fails now, its blocks stay
                    # quarantined until the port says no write can.
                    self._quarantined[outcome.key] = live.request
                else:
                    self.scheduler.finish(live.request, FinishReason.ERROR)
                error = outcome.error or "KV transfer failed"
                failed.append((live, Ending.transfer_failed(error)))
                continue
            tokens, error = _first_tokens(live, outcome, self.vocab_size)
            if not tokens:
                failures += 1
                self.scheduler.finish(live.request, FinishReason.ERROR)
                failed.append((live, Ending.transfer_failed(error)))
                continue
            self.scheduler.kv_received(live.request, tokens[0])
            live.state.add_prompt_logprobs(1, _source(live).prompt_logprobs)
            # ctx's logprobs of the first tokens came with its answer (context-first only:
            # under generation-first the tokens come with the KV, without them).
            carried = _source(live).first_logprobs or (None,) * len(tokens)
            arrived.append(Token(live=live, token_id=tokens[0], logprobs=carried[0]))
            firsts = [
                Token(live=fork, token_id=tokens[fork.choice], logprobs=carried[fork.choice])
                for fork in live.forks
            ]
            start_choices(self.scheduler, live, firsts)
            arrived += firsts
        for key in list(self._quarantined):
            if self.port.settled(key):
                self.scheduler.abort(self._quarantined.pop(key).request_id)
        for outcome in sends:
            request = self._sending.pop(outcome.key, None)
            if request is None:
                continue
            if not outcome.ok and not outcome.cancelled:
                failures += 1
                log.warning("KV send %d failed: %s", outcome.key, outcome.error)
            self.scheduler.release(request, FinishReason.STOP if outcome.ok else FinishReason.ABORT)
        return Polled(arrived=tuple(arrived), failed=tuple(failed), failures=failures)

    # ---- queries ----

    @property
    def in_flight(self) -> bool:
        """Whether some transfer is not final yet (or its blocks not free)."""
        return bool(self._receiving or self._sending or self._quarantined)

    def holds_send(self, key: int) -> bool:
        return key in self._sending

    def key_in_use(self, key: int, *, sending: bool) -> bool:
        """Whether a transfer of this worker already uses `key` on that side."""
        if sending:
            return key in self._sending
        busy = key in self._receiving or key in self._quarantined
        return busy or any(_source(live).key == key for live in self._waiting)


def _source(live: Live) -> GenerationSource:
    assert live.source is not None
    return live.source


def _first_tokens(
    live: Live, outcome: TransferOutcome, vocab_size: int
) -> tuple[tuple[int, ...], str]:
    """gen: ctx's first token of each choice (from its answer, or with the KV for
    generation_first), or none and why there are none this worker can use."""
    source = _source(live)
    tokens = source.first_tokens or outcome.first_tokens
    choices = source.num_choices
    if not tokens:
        return (), f"KV transfer {source.key}: ctx sent no first token"
    if len(tokens) != choices:
        return (), (
            f"KV transfer {source.key}: ctx sent {len(tokens)} first tokens for a request of "
            f"{choices} choices"
        )
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        return (), (
            f"KV transfer {source.key}: ctx's first token {bad} is outside the vocabulary "
            f"({vocab_size})"
        )
    return tuple(tokens), ""
