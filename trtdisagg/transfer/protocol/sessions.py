"""Transfer session state machines, and the messages held for sessions to come. Pure.

One session per (transfer key, local rank), owned by the ctx or gen side (ctx.py, gen.py).
Status, derived from a session's facts, first match wins:

    sender (ctx)   CANCELLED | ERROR   terminal flags (cancel, fail, a failed write)
                   TRANSFERRED         every expected gen rank's write finished OK
                   TRANSFERRING        a write is in flight
                   INIT                otherwise (`take_writes` says whether one can start)
    receiver (gen) CANCELLED | ERROR   terminal flags (cancel, fail, an error result)
                   TRANSFERRED         every expected ctx rank's part landed: its write's notice
                                       (which says what it moved), or its OK result with, if it
                                       moved bytes, the notice
                   TRANSFERRING        otherwise (made when its REQUEST_DATA goes out)

Late or duplicate events (a second result from one rank, anything after a terminal state, a rank
outside the expected set) are no-ops. Cancellation is not quiescence: a sender's blocks may be
freed only when no write is in flight (`is_quiescent`), a receiver's only when every expected rank
has reported (or gen gives up on a silent ctx, gen.py).
"""

from __future__ import annotations

import enum
import functools
from typing import TypeVar

import attrs

from trtdisagg.transfer.protocol.fragments import BlockRun, run_of
from trtdisagg.transfer.protocol.wire import RequestData, ResultStatus, TransferResult, WriteNotice

Status = enum.Enum("Status", "INIT TRANSFERRING TRANSFERRED ERROR CANCELLED")


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
    # gen: ctx's first generated token(s), which come with its write (a generation_first
    # request has no other source)
    first_tokens: tuple[int, ...] = ()
    # gen: the transfer failed, but a ctx write may still land in its blocks. The request ends
    # now; its blocks are freed once `cancel_request(key)` returns True.
    blocks_held: bool = False


@attrs.frozen(kw_only=True)
class SourceBlocks:
    """What ctx holds for the request: block ids per layer group and the prompt length."""

    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int

    @functools.cached_property
    def runs(self) -> tuple[BlockRun | None, ...]:
        """Each layer group's blocks as a run, where they form one (fragments.py)."""
        return tuple(run_of(ids) for ids in self.block_ids)


@attrs.define(eq=False, kw_only=True)
class _Session:
    key: int
    deadline: float
    error: str | None = None
    cancelled: bool = False

    @property
    def status(self) -> Status:
        if self.cancelled:
            return Status.CANCELLED
        return Status.ERROR if self.error is not None else self._progress()

    def _progress(self) -> Status:
        raise NotImplementedError

    @property
    def is_terminal(self) -> bool:
        return self.status in (Status.TRANSFERRED, Status.ERROR, Status.CANCELLED)

    def fail(self, reason: str) -> None:
        if not self.is_terminal:
            self.error = reason

    def expire(self, now: float, timeout_s: float) -> bool:
        """Fail the session if its deadline passed; whether this did it."""
        if expired := now >= self.deadline and not self.is_terminal:
            self.error = f"KV transfer {self.key} timed out after {timeout_s:g}s"
        return expired


@attrs.define(eq=False, kw_only=True)
class SenderSession(_Session):
    """ctx side of one transfer key: which gen ranks asked, what is in flight, what is done."""

    peer_instance: str | None = None  # bound (`bind`) by the first REQUEST_DATA
    expected: frozenset[int] | None = None  # gen ranks that will ask (registrar overlap)
    source: SourceBlocks | None = None
    first_tokens: tuple[int, ...] = ()  # what ctx sampled, sent along with every OK write
    requests: dict[int, RequestData] = attrs.Factory(dict)  # by gen rank
    in_flight: set[int] = attrs.Factory(set)  # gen ranks written to now
    _finished: set[int] = attrs.Factory(set)  # gen ranks whose write ended
    # gen ranks whose REQUEST_DATA reached this session, taken or not (a CANCEL from a rank not
    # among them overtook its request, which is then dropped when it comes)
    heard: set[int] = attrs.Factory(set)

    def _progress(self) -> Status:
        if self.expected is not None and self.expected <= self._finished:
            return Status.TRANSFERRED  # every finished write was OK (else cancelled or failed)
        return Status.TRANSFERRING if self.in_flight else Status.INIT

    @property
    def is_quiescent(self) -> bool:
        """No write is in flight: the blocks may be freed once the session is terminal."""
        return not self.in_flight

    def bind(self, peer_instance: str, expected: frozenset[int]) -> None:
        if self.peer_instance not in (None, peer_instance):
            raise ValueError(f"session {self.key} already bound to {self.peer_instance}")
        self.peer_instance, self.expected = peer_instance, expected

    def set_source(self, source: SourceBlocks) -> None:
        if self.source is not None:
            raise ValueError(f"session {self.key}: source set twice")
        self.source = source
        source.runs  # noqa: B018 -- found now, while gen has yet to ask (context_first)

    def add_request(self, request: RequestData) -> None:
        rank = request.instance_rank
        self.heard.add(rank)
        unexpected = self.expected is not None and rank not in self.expected
        if not (self.is_terminal or rank in self.requests or unexpected):
            self.requests[rank] = request

    def take_writes(self) -> list[RequestData]:
        """Requests that can be written now (KV ready, not yet started); marks them in flight."""
        if self.source is None or self.cancelled or self.error is not None:
            return []
        started = self.in_flight | self._finished
        ready = [r for rank, r in sorted(self.requests.items()) if rank not in started]
        self.in_flight.update(request.instance_rank for request in ready)
        return ready

    def write_finished(self, rank: int, status: ResultStatus, error: str = "") -> None:
        """A write to `rank` ended (or was never needed); ignored if it was not in flight."""
        if rank not in self.in_flight:
            return
        self.in_flight.discard(rank)
        self._finished.add(rank)
        if not (self.cancelled or self.error is not None):
            if status is ResultStatus.ERROR:
                self.error = error or f"write to gen rank {rank} failed"
            self.cancelled = status is ResultStatus.CANCELLED

    def cancel(self) -> bool:
        """Stop issuing writes; returns `is_quiescent` (False: a write is still in flight)."""
        if self.status not in (Status.TRANSFERRED, Status.ERROR):
            self.cancelled = True
        return self.is_quiescent


@attrs.define(eq=False, kw_only=True)
class ReceiverSession(_Session):
    """gen side of one transfer key: one part expected from each overlapping ctx rank."""

    peer_instance: str  # the ctx instance
    expected: frozenset[int]  # ctx ranks sent REQUEST_DATA (registrar overlap)
    # gen's bookkeeping for a session that ended while a ctx write may still land:
    cancel_sent: bool = False  # CANCEL went to the expected ctx ranks (once)
    failure_reported: bool = False  # the failure went to the executor; the blocks stay pinned
    peer_dead: bool = False  # the ctx instance ended (`peer_died`): none of its writes can land
    _results: dict[int, TransferResult] = attrs.Factory(dict)
    # ctx ranks whose write's notice came, which says what the write moved (None: a notice that
    # says nothing, which counts only with the rank's OK result)
    _noticed: dict[int, WriteNotice | None] = attrs.Factory(dict)

    def _progress(self) -> Status:
        landed = all(self._landed(rank) for rank in self.expected)
        return Status.TRANSFERRED if landed else Status.TRANSFERRING

    @property
    def unreported(self) -> frozenset[int]:
        return self.expected - self._results.keys()

    @property
    def is_quiescent(self) -> bool:
        """Every expected ctx rank reported, or had its write land, or the ctx instance ended:
        nobody writes into our blocks any more."""
        landed = (r in self._results or self._noticed.get(r) is not None for r in self.expected)
        return self.peer_dead or all(landed)

    def moved(self) -> tuple[int, int, tuple[int, ...]]:
        """(bytes, descriptors, the first generated tokens from the lowest ctx rank that sent
        them) of what each expected rank's write moved: its result, else its notice."""
        num_bytes = num_descriptors = 0
        tokens: tuple[int, ...] = ()
        for rank in sorted(self.expected):
            if (part := self._results.get(rank) or self._noticed.get(rank)) is None:
                continue
            num_bytes += part.num_bytes
            num_descriptors += part.num_descriptors
            tokens = tokens or part.first_tokens
        return num_bytes, num_descriptors, tokens

    def on_result(self, result: TransferResult) -> None:
        rank = result.instance_rank
        if rank not in self.expected or rank in self._results:
            return
        # Judged before filing: with this result every rank may have reported, which must not
        # read as TRANSFERRED when it is an error.
        if result.status is not ResultStatus.OK and not self.is_terminal:
            self.error = f"ctx rank {rank}: {result.status.value}: {result.error}"
        self._results[rank] = result

    def on_notice(self, notice: WriteNotice) -> None:
        """A ctx rank's write notification: its bytes have landed. What it says the write moved
        counts unless it says nothing (no descriptors) or the rank's result came first."""
        rank = notice.instance_rank
        if rank not in self.expected or rank in self._noticed:
            return
        said = notice.num_descriptors > 0 and rank not in self._results
        self._noticed[rank] = notice if said else None

    def _landed(self, rank: int) -> bool:
        if self._noticed.get(rank) is not None:
            return True  # whatever its result says later, the bytes are here
        result = self._results.get(rank)
        if result is None or result.status is not ResultStatus.OK:
            return False
        return result.num_bytes == 0 or rank in self._noticed

    def peer_died(self, reason: str) -> None:
        """The ctx instance's process ended (liveness.py): nothing of it can land any more."""
        self.fail(reason)
        self.peer_dead = True

    def cancel(self) -> None:
        if not self.is_terminal:
            self.cancelled = True


S = TypeVar("S", SenderSession, ReceiverSession)


class Sessions(dict[int, S]):
    """One side's sessions by transfer key; a peer's message reaches only its own sessions."""

    def lookup(self, peer_instance: str, key: int) -> S | None:
        """Session `key` if `peer_instance` owns it (or it is bound to no instance yet)."""
        session = self.get(key)
        owned = session is not None and session.peer_instance in (None, peer_instance)
        return session if owned else None


@attrs.define(eq=False, kw_only=True)
class EarlyMessages:
    """REQUEST_DATA and CANCEL that came before their sender session exists (generation-first,
    races): `take(key)` hands them to the new session; `sweep(now)` drops those older than
    `ttl`."""

    ttl: float = 120.0
    requests: dict[int, list[tuple[float, RequestData]]] = attrs.Factory(dict)  # key -> (when, _)
    cancelled: dict[int, tuple[str, float]] = attrs.Factory(dict)  # key -> (gen instance, when)
    # (gen instance, gen rank, key) -> when: that rank's CANCEL came before its REQUEST_DATA
    # (overtaken), which is dropped when it comes rather than held for a later session of the
    # key, whose gen blocks it does not name.
    _overtaken: dict[tuple[str, int, int], float] = attrs.Factory(dict)

    def __len__(self) -> int:
        """Transfer keys with something held (requests or a cancel)."""
        return len(self.requests.keys() | self.cancelled.keys())

    def add_request(self, now: float, request: RequestData) -> None:
        self.requests.setdefault(request.key, []).append((now, request))

    def add_cancel(self, now: float, key: int, instance: str) -> None:
        self.cancelled[key] = (instance, now)

    def add_overtaken(self, now: float, instance: str, rank: int, key: int) -> None:
        self._overtaken[(instance, rank, key)] = now

    def take_overtaken(self, request: RequestData) -> bool:
        """Whether `request` is one its own CANCEL overtook (forgotten now)."""
        entry = (request.instance_name, request.instance_rank, request.key)
        return self._overtaken.pop(entry, None) is not None

    def drop_requests_of(self, instance: str, rank: int, key: int) -> int:
        """Drop the requests held for `key` from that gen rank; how many there were."""
        held = self.requests.pop(key, [])
        kept = [e for e in held if e[1].sender != (instance, rank)]
        if kept:
            self.requests[key] = kept
        return len(held) - len(kept)

    def held_by(self, instance: str) -> int:
        requests = sum(r.instance_name == instance for held in self.requests.values()
                       for _, r in held)  # fmt: skip
        cancels = sum(name == instance for name, _ in self.cancelled.values())
        return requests + cancels + sum(entry[0] == instance for entry in self._overtaken)

    @property
    def size(self) -> int:
        """Entries held of every gen instance (`held_by`: one instance's)."""
        requests = sum(len(held) for held in self.requests.values())
        return requests + len(self.cancelled) + len(self._overtaken)

    def take(self, key: int) -> tuple[list[RequestData], str | None]:
        """(the requests held for `key`, the gen instance that cancelled it early, if one did);
        forgotten now."""
        requests = [request for _, request in self.requests.pop(key, [])]
        cancel = self.cancelled.pop(key, None)
        return requests, cancel[0] if cancel is not None else None

    def sweep(self, now: float) -> list[RequestData]:
        """Drop and return the requests older than `ttl` (ctx refuses them)."""
        stale: list[RequestData] = []
        for key, held in list(self.requests.items()):
            stale += [request for at, request in held if now - at >= self.ttl]
            if fresh := [(at, request) for at, request in held if now - at < self.ttl]:
                self.requests[key] = fresh
            else:
                del self.requests[key]
        self.cancelled = {k: c for k, c in self.cancelled.items() if now - c[1] < self.ttl}
        self._overtaken = {e: at for e, at in self._overtaken.items() if now - at < self.ttl}
        return stale
