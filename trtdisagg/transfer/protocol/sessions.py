"""Transfer session state machines and their registry. Pure: no I/O, no clocks.

One session per (transfer key = disagg_request_id, local rank), owned by the ctx or gen protocol
(ctx.py, gen.py), which feed events in and read decisions out; `deadline` is a float in the
caller's time base, checked with `expired(now)`.

Sender (ctx rank), status derived from its facts, first match wins:

    CANCELLED | ERROR           terminal flags (cancel() / fail() / a failed write)
    TRANSFERRED                 every expected receiver rank's write finished OK
    TRANSFERRING                a write is in flight
    READY                       KV is ready (`set_source`) and a request waits to be written
    INIT                        otherwise

Receiver (gen rank):

    CANCELLED | ERROR           terminal flags (cancel() / fail() / an error or cancelled result)
    TRANSFERRED                 every expected sender rank's part landed: its write's
                                WRITE_NOTICE (which says what the write moved), or its OK
                                result with, if it moved bytes, the notice
    TRANSFERRING                after `mark_requested` (REQUEST_DATA sent)
    INIT                        otherwise

Late or duplicate events (a second result from one rank, anything after a terminal state, a
rank outside the expected set) are no-ops that return False. Cancellation is not quiescence:
`cancel()` is immediate, but a sender's blocks may be freed only when `is_quiescent` (no write in
flight), and a receiver's only when every expected rank has reported, a write's result or an
answer to CANCEL (or gen gives up on a silent ctx a second timeout after the deadline).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterator, Sequence
from typing import Generic, Protocol, TypeVar

import attrs

from trtdisagg.transfer.protocol.block_runs import BlockRun, run_of
from trtdisagg.transfer.protocol.wire import RequestData, ResultStatus


class SenderStatus(enum.Enum):
    INIT = "INIT"
    READY = "READY"
    TRANSFERRING = "TRANSFERRING"
    TRANSFERRED = "TRANSFERRED"
    ERROR = "ERROR"
    CANCELLED = "CANCELLED"


class ReceiverStatus(enum.Enum):
    INIT = "INIT"
    TRANSFERRING = "TRANSFERRING"
    TRANSFERRED = "TRANSFERRED"
    ERROR = "ERROR"
    CANCELLED = "CANCELLED"


@attrs.frozen(kw_only=True)
class SourceBlocks:
    """What ctx holds for the request: block ids per layer group and the prompt length."""

    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int

    @functools.cached_property
    def runs(self) -> tuple[BlockRun | None, ...]:
        """Each layer group's blocks as a run, where they form one (block_runs.py)."""
        return tuple(run_of(ids) for ids in self.block_ids)


@attrs.define(eq=False, kw_only=True)
class SenderSession:
    """ctx side of one transfer key: which gen ranks asked, what is in flight, what is done."""

    key: int
    deadline: float
    peer_instance: str | None = None  # bound (`bind`) by the first REQUEST_DATA
    expected: frozenset[int] | None = None  # gen ranks that will ask (registrar overlap)
    source: SourceBlocks | None = None
    error: str | None = None
    cancelled: bool = False
    first_tokens: tuple[int, ...] = ()  # what ctx sampled, sent along with every OK result
    _requests: dict[int, RequestData] = attrs.field(factory=dict)
    _in_flight: set[int] = attrs.field(factory=set)
    _finished: dict[int, ResultStatus] = attrs.field(factory=dict)
    # gen ranks whose REQUEST_DATA reached this session, taken or not (a CANCEL from a rank
    # not among them overtook its request, which is then dropped when it comes)
    heard: set[int] = attrs.field(factory=set)

    @property
    def status(self) -> SenderStatus:
        if self.cancelled:
            return SenderStatus.CANCELLED
        if self.error is not None:
            return SenderStatus.ERROR
        if self.expected is not None and self.expected <= self._finished.keys():
            return SenderStatus.TRANSFERRED  # every finished write was OK (else flags above)
        if self._in_flight:
            return SenderStatus.TRANSFERRING
        if self.source is not None and self._requests.keys() - self._finished.keys():
            return SenderStatus.READY
        return SenderStatus.INIT

    @property
    def is_terminal(self) -> bool:
        """`status` is TRANSFERRED, ERROR or CANCELLED (asked of every session at every step)."""
        if self.cancelled or self.error is not None:
            return True
        return self.expected is not None and self.expected <= self._finished.keys()

    @property
    def is_quiescent(self) -> bool:
        """No write is in flight: the source blocks may be freed once the session is terminal."""
        return not self._in_flight

    @property
    def requesters(self) -> tuple[int, ...]:
        """Gen ranks that sent REQUEST_DATA (whom to notify on cancel)."""
        return tuple(sorted(self._requests))

    def is_writing(self, rank: int) -> bool:
        """A write to gen rank `rank` is in flight (its TRANSFER_RESULT is still to come)."""
        return rank in self._in_flight

    def bind(self, peer_instance: str, expected: frozenset[int]) -> None:
        """Attach the session to the gen instance that requested it first."""
        if self.peer_instance is not None and self.peer_instance != peer_instance:
            raise ValueError(f"session {self.key} already bound to {self.peer_instance}")
        self.peer_instance = peer_instance
        self.expected = expected

    def set_source(self, block_ids: Sequence[Sequence[int]], num_tokens: int) -> None:
        """Prefill finished: the KV is in these blocks (once)."""
        if self.source is not None:
            raise ValueError(f"session {self.key}: source set twice")
        self.source = SourceBlocks(block_ids=tuple(map(tuple, block_ids)), num_tokens=num_tokens)
        self.source.runs  # noqa: B018 -- found now, while gen has yet to ask (context_first)

    def add_request(self, request: RequestData) -> bool:
        """Record a gen rank's REQUEST_DATA; False if terminal, unexpected or a duplicate."""
        rank = request.instance_rank
        self.heard.add(rank)
        if self.is_terminal or rank in self._requests:
            return False
        if self.expected is not None and rank not in self.expected:
            return False
        self._requests[rank] = request
        return True

    def take_writes(self) -> list[RequestData]:
        """Requests that can be written now (KV ready, not yet started); marks them in flight."""
        if self.source is None or self.cancelled or self.error is not None:
            return []
        ready = [
            request
            for rank, request in sorted(self._requests.items())
            if rank not in self._in_flight and rank not in self._finished
        ]
        self._in_flight.update(request.instance_rank for request in ready)
        return ready

    def adopt_write(self, rank: int) -> None:
        """A write to `rank` runs that this session did not start: in flight until
        `write_finished`, so that its source blocks stay pinned."""
        self._in_flight.add(rank)

    def write_finished(self, rank: int, status: ResultStatus, error: str = "") -> bool:
        """A write to `rank` ended (or was never needed); False if it was not in flight."""
        if rank not in self._in_flight:
            return False
        self._in_flight.discard(rank)
        self._finished[rank] = status
        if self.cancelled or self.error is not None:
            return True
        if status is ResultStatus.ERROR:
            self.error = error or f"write to gen rank {rank} failed"
        elif status is ResultStatus.CANCELLED:
            self.cancelled = True
        return True

    def fail(self, reason: str) -> None:
        if not self.is_terminal:
            self.error = reason

    def cancel(self) -> bool:
        """Stop issuing writes; returns `is_quiescent` (False: a write is still in flight)."""
        if self.status not in (SenderStatus.TRANSFERRED, SenderStatus.ERROR):
            self.cancelled = True
        return self.is_quiescent

    def expired(self, now: float) -> bool:
        return now >= self.deadline and not self.is_terminal


@attrs.frozen(kw_only=True)
class RankResult:
    status: ResultStatus
    num_bytes: int
    num_descriptors: int
    error: str
    first_tokens: tuple[int, ...] = ()


@attrs.define(eq=False, kw_only=True)
class ReceiverSession:
    """gen side of one transfer key: one result expected from each overlapping ctx rank."""

    key: int
    peer_instance: str  # the ctx instance
    expected: frozenset[int]  # ctx ranks sent REQUEST_DATA (registrar overlap)
    deadline: float
    requested: bool = False
    error: str | None = None
    cancelled: bool = False
    # The core's bookkeeping for a session that ended while a ctx write may still land:
    cancel_sent: bool = False  # CANCEL went to the expected ctx ranks (once)
    failure_reported: bool = False  # the failure went to the executor; the blocks stay pinned
    peer_dead: bool = False  # the ctx instance ended (`peer_died`): none of its writes can land
    _results: dict[int, RankResult] = attrs.field(factory=dict)
    # ctx ranks whose write's notification came, with what it says the write moved (None: a
    # notice that says nothing, which counts only with the rank's OK result)
    _noticed: dict[int, RankResult | None] = attrs.field(factory=dict)
    # Expected ranks whose part has not landed (`_landed`), kept as events come: every
    # session's status is read after every event.
    _unlanded: set[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._unlanded = set(self.expected)

    @property
    def status(self) -> ReceiverStatus:
        if self.cancelled:
            return ReceiverStatus.CANCELLED
        if self.error is not None:
            return ReceiverStatus.ERROR
        if not self._unlanded:
            return ReceiverStatus.TRANSFERRED
        return ReceiverStatus.TRANSFERRING if self.requested else ReceiverStatus.INIT

    def _settle(self, rank: int) -> None:
        if self._landed(rank):
            self._unlanded.discard(rank)

    def _landed(self, rank: int) -> bool:
        """Rank `rank`'s part is here: its write's notice, which says what it moved (NIXL
        delivers a notification only after the write's bytes); or its OK result, with the
        notice if it moved bytes."""
        if self._noticed.get(rank) is not None:
            return True  # whatever its result says later, the bytes are here
        result = self._results.get(rank)
        return (
            result is not None
            and result.status is ResultStatus.OK
            and (result.num_bytes == 0 or rank in self._noticed)
        )

    @property
    def unreported(self) -> frozenset[int]:
        """Expected ctx ranks whose TRANSFER_RESULT has not come (it may still)."""
        return self.expected - self._results.keys()

    def _part(self, rank: int) -> RankResult | None:
        return self._results.get(rank) or self._noticed.get(rank)

    @property
    def is_terminal(self) -> bool:
        return self.cancelled or self.error is not None or not self._unlanded

    @property
    def is_quiescent(self) -> bool:
        """Every expected ctx rank reported, or had its write land, or the ctx instance ended:
        nobody writes into our blocks any more."""
        return self.peer_dead or all(
            rank in self._results or self._noticed.get(rank) is not None for rank in self.expected
        )

    @property
    def num_bytes(self) -> int:
        return sum(part.num_bytes for part in map(self._part, self.expected) if part)

    @property
    def num_descriptors(self) -> int:
        return sum(part.num_descriptors for part in map(self._part, self.expected) if part)

    @property
    def first_tokens(self) -> tuple[int, ...]:
        """The first generated tokens, from the lowest ctx rank that sent them (rank 0)."""
        for rank in sorted(self.expected):
            part = self._part(rank)
            if part is not None and part.first_tokens:
                return part.first_tokens
        return ()

    def mark_requested(self) -> None:
        self.requested = True

    def on_result(
        self,
        rank: int,
        status: ResultStatus,
        *,
        num_bytes: int,
        num_descriptors: int,
        error: str,
        first_tokens: tuple[int, ...] = (),
    ) -> bool:
        """A TRANSFER_RESULT from ctx rank `rank`; False if unexpected, duplicate or late."""
        if rank not in self.expected or rank in self._results:
            return False
        # Judged before filing: with this result every rank may have reported, which must
        # not read as TRANSFERRED when it is an error.
        was_terminal = self.is_terminal
        self._results[rank] = RankResult(
            status=status,
            num_bytes=num_bytes,
            num_descriptors=num_descriptors,
            error=error,
            first_tokens=first_tokens,
        )
        if status is not ResultStatus.OK and not was_terminal:
            self.error = f"ctx rank {rank}: {status.value}: {error}"
        self._settle(rank)
        return True

    def on_notice(
        self,
        rank: int,
        *,
        num_bytes: int = 0,
        num_descriptors: int = 0,
        first_tokens: tuple[int, ...] = (),
    ) -> bool:
        """The agent notification of ctx rank `rank`'s write (its bytes have landed), with
        what the write moved (`num_descriptors` 0: it does not say); False if unexpected or
        a duplicate. A notice after the rank's error result changes nothing."""
        if rank not in self.expected or rank in self._noticed:
            return False
        said = None
        if num_descriptors and rank not in self._results:
            said = RankResult(
                status=ResultStatus.OK,
                num_bytes=num_bytes,
                num_descriptors=num_descriptors,
                error="",
                first_tokens=first_tokens,
            )
        self._noticed[rank] = said
        self._settle(rank)
        return True

    def awaits_notice(self) -> bool:
        """Requested, not over: a notification may come for it any moment."""
        return self.requested and not self.is_terminal

    def fail(self, reason: str) -> None:
        if not self.is_terminal:
            self.error = reason

    def peer_died(self, reason: str) -> None:
        """The ctx instance's process ended (liveness.py): fail unless done, and nothing of
        that instance can land in our blocks any more."""
        self.fail(reason)
        self.peer_dead = True

    def cancel(self) -> None:
        if not self.is_terminal:
            self.cancelled = True

    def expired(self, now: float) -> bool:
        return now >= self.deadline and not self.is_terminal


class _Session(Protocol):
    key: int
    deadline: float

    @property
    def peer_instance(self) -> str | None: ...

    def expired(self, now: float) -> bool: ...


S = TypeVar("S", bound=_Session)


class SessionRegistry(Generic[S]):
    """Sessions of one side by transfer key; a peer's message reaches only its own sessions."""

    def __init__(self) -> None:
        self._sessions: dict[int, S] = {}

    def add(self, session: S) -> None:
        if session.key in self._sessions:
            raise ValueError(f"a session for key {session.key} already exists")
        self._sessions[session.key] = session

    def get(self, key: int) -> S | None:
        """Local lookup (the executor's own request)."""
        return self._sessions.get(key)

    def lookup(self, peer_instance: str, key: int) -> S | None:
        """The session `key` if `peer_instance` owns it, else None (or not bound yet, see
        `SenderSession.bind`)."""
        session = self._sessions.get(key)
        if session is None or session.peer_instance not in (None, peer_instance):
            return None
        return session

    def pop(self, key: int) -> S | None:
        return self._sessions.pop(key, None)

    def expired(self, now: float) -> list[S]:
        return [s for s in self._sessions.values() if s.expired(now)]

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[S]:
        return iter(list(self._sessions.values()))


@attrs.define(eq=False, kw_only=True)
class EarlyMessages:
    """REQUEST_DATA / CANCEL that arrived before their sender session exists (gen-first, races).

    `take(key)` hands them to the new session; `sweep(now)` drops those older than `ttl`.
    """

    ttl: float = 120.0
    _requests: dict[int, list[tuple[float, RequestData]]] = attrs.field(factory=dict)
    _cancelled: dict[int, float] = attrs.field(factory=dict)
    # (gen instance, gen rank, key) -> when: that gen rank's CANCEL came before its
    # REQUEST_DATA (overtaken), which is dropped when it comes rather than held for a later
    # session of the key, whose gen blocks it does not name.
    _overtaken: dict[tuple[str, int, int], float] = attrs.field(factory=dict)

    def add_overtaken(self, now: float, instance: str, rank: int, key: int) -> None:
        self._overtaken[(instance, rank, key)] = now

    def take_overtaken(self, request: RequestData) -> bool:
        """Whether `request` is one its own CANCEL overtook (forgotten now)."""
        entry = (request.instance_name, request.instance_rank, request.key)
        return self._overtaken.pop(entry, None) is not None

    def drop_requests_of(self, instance: str, rank: int, key: int) -> int:
        """Drop the requests held for `key` from that gen rank (its CANCEL answered them);
        how many there were."""
        held = self._requests.get(key, [])
        kept = [e for e in held if (e[1].instance_name, e[1].instance_rank) != (instance, rank)]
        if kept:
            self._requests[key] = kept
        else:
            self._requests.pop(key, None)
        return len(held) - len(kept)

    def add_request(self, now: float, request: RequestData) -> None:
        self._requests.setdefault(request.key, []).append((now, request))

    def add_cancel(self, now: float, key: int) -> None:
        self._cancelled[key] = now

    def __len__(self) -> int:
        """Transfer keys with something held (requests or a cancel)."""
        return len(self._requests.keys() | self._cancelled.keys())

    def cancelled(self, key: int) -> bool:
        """Whether a CANCEL for `key` is held (left in place)."""
        return key in self._cancelled

    def peek(self, key: int) -> list[RequestData]:
        """The requests held for `key`, left in place."""
        return [request for _, request in self._requests.get(key, [])]

    def take(self, key: int) -> tuple[list[RequestData], bool]:
        """(early requests, whether the key was cancelled early)."""
        requests = [request for _, request in self._requests.pop(key, [])]
        return requests, self._cancelled.pop(key, None) is not None

    def sweep(self, now: float) -> list[RequestData]:
        """Drop and return requests older than `ttl` (the shell answers them with an error)."""
        stale: list[RequestData] = []
        for key in list(self._requests):
            fresh = [e for e in self._requests[key] if now - e[0] < self.ttl]
            stale.extend(e[1] for e in self._requests[key] if now - e[0] >= self.ttl)
            if fresh:
                self._requests[key] = fresh
            else:
                del self._requests[key]
        for key in [k for k, t in self._cancelled.items() if now - t >= self.ttl]:
            del self._cancelled[key]
        for entry in [e for e, t in self._overtaken.items() if now - t >= self.ttl]:
            del self._overtaken[entry]
        return stale


@attrs.frozen(kw_only=True)
class TransferOutcome:
    """The final state of one transfer on one rank, as the transceiver reports it."""

    key: int
    ok: bool
    cancelled: bool = False
    error: str | None = None
    num_bytes: int = 0
    num_descriptors: int = 0
    seconds: float = 0.0
    first_tokens: tuple[int, ...] = ()
    """gen: ctx's first generated token(s), when ctx sent them with its result (every OK result
    from ctx rank 0 carries them; a generation_first request has no other source)."""
    blocks_held: bool = False
    """gen: the transfer failed, but a ctx write may still land in its blocks. The request
    ends now; its blocks are freed once `cancel_request(key)` returns True."""
