"""KvTransceiver: the executor-facing KV transfer service of one rank (the I/O shell).

It joins the messenger (ZMQ), the session state machines, the peer registrar and the transfer
agent (NIXL). The executor calls four sync methods between steps and never waits on the network:

    ctx  prepare_send(key, blocks, num_tokens)             last prefill chunk runs (optional)
         respond_and_send_async(key, blocks, num_tokens)   prefill done: push KV when gen asks
         check_context_transfer_status() -> outcomes       sessions that ended; free their blocks
    gen  request_and_receive_async(key, endpoint, blocks)  blocks allocated: ask ctx for the KV
         check_gen_transfer_status() -> outcomes           KV landed (or failed): decode or fail
    both cancel_request(key) -> bool                       False while a write may still land

Lifecycle of a transfer key (= disagg_request_id):
1. gen: first contact with a `ctx_info_endpoint` runs the rendezvous (REQUEST_INSTANCE_INFO,
   then REGISTER_PEER to every ctx rank); the result, or the refusal, is cached per endpoint.
2. gen: a ReceiverSession expects one TRANSFER_RESULT per overlapping ctx rank; REQUEST_DATA
   goes to each of them.
3. ctx: REQUEST_DATA joins the SenderSession (or waits in EarlyMessages until prefill ends).
   A write task maps blocks to fragments, submits one agent WRITE whose notification names the
   key, announces it (WRITE_POSTED: bytes, descriptors, first tokens), polls it, and reports
   TRANSFER_RESULT, also when it moved 0 bytes. When REQUEST_DATA came before the KV and the
   executor said where the KV will be (`prepare_send`), the write is mapped and prepared by the
   agent while the prefill runs, and only posted when the KV is ready (transfer/prepared.py).
4. gen: the session completes when every expected rank reported OK and every rank that moved
   bytes delivered its WRITE_NOTICE notification (the data has landed). A rank whose write was
   announced counts once its notice is in: gen need not wait for the TRANSFER_RESULT hop.
5. Both: a session past its deadline fails; a sender with a write in flight stays quarantined
   (its blocks pinned) until the agent reports a final state. A receiver that ends before every
   ctx rank reported sends CANCEL once and stays quarantined until each answers (a ctx rank
   with no write in flight answers a CANCEL at once) or, if ctx is silent, a second timeout
   past the deadline; its failure is reported at once, with `blocks_held`.

Listener tasks only update sessions and wake the executor; they never wait on a transfer.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
import trio

from trtdisagg.transfer.agents.base import (
    TransferAgent,
    XferHandle,
    XferStatus,
    posts_quickly,
    write_preparer,
)
from trtdisagg.transfer.bounce import bounces, canonical_bytes, staged_fragments, staged_runs
from trtdisagg.transfer.errors import PeerIncompatible, TransferLayerError
from trtdisagg.transfer.faults import FaultInjector
from trtdisagg.transfer.fragments import Fragments
from trtdisagg.transfer.messenger import Dealer, Router, open_dealer
from trtdisagg.transfer.peers import PeerRegistrar, SendPlan
from trtdisagg.transfer.prepared import PreparedWrite, PreparedWrites
from trtdisagg.transfer.rank_info import RankInfo
from trtdisagg.transfer.sessions import (
    EarlyMessages,
    ReceiverSession,
    ReceiverStatus,
    SenderSession,
    SenderStatus,
    SessionRegistry,
    TransferOutcome,
)
from trtdisagg.transfer.staging_area import StagingArea
from trtdisagg.transfer.wire import (
    PROTOCOL_VERSION,
    Cancel,
    InstanceInfo,
    Message,
    RegisterAck,
    RegisterPeer,
    RequestData,
    RequestInstanceInfo,
    ResultStatus,
    TransferResult,
    WriteNotice,
    WritePosted,
    decode,
    encode,
    pack_block_ids,
    unpack_block_ids,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

RENDEZVOUS_TIMEOUT_S = 5.0
SPIN_POLL_S = 0.002
# gen, after WRITE_POSTED: drain notifications at every round for this long past twice ctx's
# estimate of the write (or the maximum when ctx has no estimate yet).
NOTICE_SPIN_S = 0.002
NOTICE_SPIN_MAX_S = 0.05
# ctx: a quick write expected to take at least this long is announced (WRITE_POSTED) after its
# post, a shorter one before it. About a ZMQ hop between two local processes (0.25-0.45 ms on the
# device); on 2 x H200, announcing 256 MiB on one GPU (0.25 ms) after the post cost 0.2 ms.
ANNOUNCE_AFTER_S = 0.0005
# A 1 ms Trio sleep returns up to ~1.2 ms later (epoll's millisecond timeout, rounded up): a long
# write is polled at every round from this long before its expected end.
TIMER_SLACK_S = 0.0015
# The steps `KvTransceiver.stages` records, in the order a transfer normally takes them.
STAGES = (
    "request",  # gen: request_and_receive_async called
    "sent",  # gen: REQUEST_DATA handed to zmq (every expected ctx rank)
    "received",  # ctx: REQUEST_DATA dispatched
    "write",  # ctx: the write task runs
    "mapped",  # ctx: the write's fragments are computed
    "posted",  # ctx: the agent write is posted (WRITE_POSTED goes to zmq around it)
    "posted_seen",  # gen: WRITE_POSTED dispatched
    "done",  # ctx: the agent reports DONE
    "result_sent",  # ctx: TRANSFER_RESULT handed to zmq
    "result",  # gen: TRANSFER_RESULT dispatched
    "notice",  # gen: the write's notification drained
    "outcome",  # both: the outcome handed to the executor
)


def polls_every_round(now: float, posted: float, expected: float) -> bool:
    """Whether a write posted at `posted`, expected to end at `expected`, is polled at every
    scheduling round now (else after a 1 ms sleep): during its first SPIN_POLL_S, when a short
    write usually ends, and around its expected end. Trio's timers are millisecond-grained, so
    only this catches the end promptly; the sleeps in between keep a long write from spinning a
    core throughout."""
    near_end = expected - TIMER_SLACK_S <= now < expected + SPIN_POLL_S
    return now < posted + SPIN_POLL_S or near_end


@attrs.frozen(kw_only=True)
class TransceiverStatistics:
    rendezvous: int
    senders: int
    receivers: int
    bad_frames: int
    quarantined: int = 0  # sessions over (failed, cancelled) whose blocks a write may still reach
    quarantine_expired: int = 0  # gen quarantines ended by the second timeout, not by ctx
    early: int = 0  # transfer keys with REQUEST_DATA or CANCEL waiting for their session
    bounced: int = 0  # transfers that went through the staging buffers (sends and receives)
    connections: int = 0  # open DEALERs to peers' control endpoints
    prepared: int = 0  # writes prepared before their KV was ready and not yet posted
    prepared_posts: int = 0  # writes posted from such a preparation (since start)


@attrs.define(eq=False, kw_only=True)
class _CtxPeer:
    """What gen knows about one ctx instance, reached at its info endpoint."""

    ranks: tuple[RankInfo, ...] = ()
    refusal: str | None = None
    ready: trio.Event = attrs.Factory(trio.Event)
    instance_name: str | None = None  # the instance that answered, refused or not


@attrs.frozen(kw_only=True)
class _Slot:
    """Where a rendezvous reply is awaited: the dealer's endpoint and what it answers."""

    endpoint: str
    kind: str
    instance_name: str = ""
    instance_rank: int = 0


@attrs.define(eq=False, kw_only=True)
class _Timing:
    started: float
    finished: float | None = None


@attrs.frozen(kw_only=True)
class _Posted:
    """ctx: one write handed to the agent, to be polled to its end (`_await_write`)."""

    handle: XferHandle
    remote: str
    num_bytes: int
    num_descriptors: int
    posted: float
    expected: float  # when it should be done, from the peer's learned rate (= posted: unknown)


@attrs.frozen(kw_only=True)
class _Staged:
    """gen: where a bouncing receive's canonical region is, and where it goes afterwards."""

    offset: int
    num_bytes: int
    block_ids: tuple[int, ...]
    first_token: int
    num_tokens: int


@attrs.define(eq=False, kw_only=True)
class KvTransceiver:
    local: RankInfo
    instance: tuple[RankInfo, ...]  # every rank of this instance; rank 0 answers INSTANCE_INFO
    agent: TransferAgent
    router: Router
    timeout_s: float
    wake: Callable[[], None]
    on_write: Callable[[int, int, float], None] = lambda num_bytes, descriptors, seconds: None
    clock: Callable[[], float] = time.monotonic
    faults: FaultInjector | None = None  # tests only: applied to every dealer's sends
    # The bounce path (transfer/bounce.py), when kv_cache_bounce_size_mb > 0.
    staging: StagingArea | None = None
    bounced: int = 0  # transfers (sends and receives) that went through staging
    # Report a failed receive at once while its blocks stay quarantined (`blocks_held`). A
    # multi-rank instance turns it off: its ranks' outcomes are merged, and a rank reports a
    # failure only once its blocks are free, so the merged outcome can free them.
    early_failures: bool = True
    quarantine_expired: int = 0
    registrar: PeerRegistrar = attrs.field(init=False)
    senders: SessionRegistry[SenderSession] = attrs.Factory(SessionRegistry)
    receivers: SessionRegistry[ReceiverSession] = attrs.Factory(SessionRegistry)
    early: EarlyMessages = attrs.Factory(EarlyMessages)
    prepared: PreparedWrites = attrs.Factory(PreparedWrites)
    prepared_posts: int = 0
    rendezvous_count: int = 0
    _nursery: trio.Nursery | None = None
    _agent_lock: trio.Lock = attrs.Factory(trio.Lock)
    _dealers: dict[str, Dealer] = attrs.Factory(dict)
    _dealer_scopes: dict[str, trio.CancelScope] = attrs.Factory(dict)
    _closed_bad_frames: int = 0  # bad frames counted by dealers since closed
    _dealer_locks: dict[str, trio.Lock] = attrs.Factory(dict)
    _ctx_peers: dict[str, _CtxPeer] = attrs.Factory(dict)
    _remote_names: dict[tuple[str, int], str] = attrs.Factory(dict)
    _replies: dict[_Slot, trio.MemorySendChannel[Message]] = attrs.Factory(dict)
    _timing: dict[int, _Timing] = attrs.Factory(dict)
    _failed_early: dict[int, str] = attrs.Factory(dict)
    # Receives still in rendezvous (no session yet) -> cancelled meanwhile. A cancelled one
    # never asks ctx for data, and reports a cancelled outcome once the rendezvous returns.
    _starting: dict[int, bool] = attrs.Factory(dict)
    _cancelled_early: set[int] = attrs.Factory(set)
    _staged: dict[int, _Staged] = attrs.Factory(dict)  # gen: receives that bounce
    _scattering: set[int] = attrs.Factory(set)  # gen: staged KV being copied into the blocks
    _scattered: list[TransferOutcome] = attrs.Factory(list)  # ... and copied: to report
    _receiving: trio.Event = attrs.Factory(trio.Event)  # set when a receive session starts
    _spin_notices_until: float = 0.0  # gen: drain notifications every round until then
    _write_rates: dict[str, float] = attrs.Factory(dict)  # ctx: bytes/s of writes, per remote
    # Benchmarks only: when a list, every transfer appends (key, stage, clock()) at each step
    # of its way (see `STAGES`), so a bench can tell where the time goes. None: nothing kept.
    stages: list[tuple[int, str, float]] | None = None

    def __attrs_post_init__(self) -> None:
        self.registrar = PeerRegistrar(self.local)
        # A REQUEST_DATA whose ctx session never appears is refused after the transfer timeout.
        self.early = EarlyMessages(ttl=self.timeout_s)

    @property
    def info_endpoint(self) -> str:
        return self.instance[0].control_endpoint

    # ---- service ----

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._listen_router)
            nursery.start_soon(self._poll_notifications)
            nursery.start_soon(self._sweep)
            task_status.started()

    def statistics(self) -> TransceiverStatistics:
        bad = (
            self.router.statistics().bad_frames
            + self._closed_bad_frames
            + sum(d.statistics().bad_frames for d in self._dealers.values())
        )
        now = self.clock()
        quarantined = sum(s.is_terminal and not s.is_quiescent for s in self.senders) + sum(
            s.is_terminal and not self._released(s, now) for s in self.receivers
        )
        return TransceiverStatistics(
            rendezvous=self.rendezvous_count,
            senders=len(self.senders),
            receivers=len(self.receivers),
            bad_frames=bad,
            quarantined=quarantined,
            quarantine_expired=self.quarantine_expired,
            early=len(self.early),
            bounced=self.bounced,
            connections=len(self._dealers),
            prepared=len(self.prepared),
            prepared_posts=self.prepared_posts,
        )

    def _stamp(self, key: int, stage: str) -> None:
        if self.stages is not None:
            self.stages.append((key, stage, self.clock()))

    def _spawn(self, fn: Callable[..., object], *args: object) -> None:
        assert self._nursery is not None, "the transceiver is not running"
        self._nursery.start_soon(fn, *args)  # type: ignore[arg-type]

    # ---- ctx (sender) side ----

    def respond_and_send_async(
        self,
        key: int,
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        first_tokens: Sequence[int] = (),
    ) -> None:
        """ctx: the KV of `key` is ready in `block_ids`; write it to whoever asks (or asked).
        `first_tokens` (what prefill sampled) go to gen with the result."""
        session = SenderSession(
            key=key, deadline=self.clock() + self.timeout_s, first_tokens=tuple(first_tokens)
        )
        session.set_source(block_ids, num_tokens)
        self.senders.add(session)
        self._timing[key] = _Timing(started=self.clock())
        requests, cancelled = self.early.take(key)
        if cancelled:
            session.cancel()
        for request in requests:
            self._accept_request(session, request)
        self._start_writes(session)
        self._forget_prepared(key)  # what `_start_writes` did not post is of no use now

    def prepare_send(self, key: int, block_ids: Sequence[Sequence[int]], num_tokens: int) -> None:
        """ctx, optional: the KV of `key` will be in `block_ids` once the step now starting
        ends. A gen rank that already asked (generation_first) gets its write made ready during
        that step, so that `respond_and_send_async` only has to post it."""
        if write_preparer(self.agent) is None or self.senders.get(key) is not None:
            return
        stale = self.prepared.expect(key, block_ids, num_tokens, self.clock() + self.timeout_s)
        self._release_handles(stale)
        for request in self.early.peek(key):
            self._prepare(key, request)

    def _prepare(self, key: int, request: RequestData) -> None:
        """Map and prepare the direct write of `key`'s expected source into `request`'s blocks,
        when the agent can do it quickly on the loop; else leave it all to the write path."""
        preparer = write_preparer(self.agent)
        source = self.prepared.source(key)
        peer_key = (request.instance_name, request.instance_rank)
        if (
            preparer is None
            or source is None
            or request.staging_bytes
            or self._agent_lock.locked()
            or self.registrar.get(peer_key) is None
        ):
            return
        plan = self.registrar.send_plan(peer_key)
        remote = self._remote_names[peer_key]
        try:
            fragments = plan.fragments(
                src_blocks=source.block_ids,
                dst_blocks=[list(unpack_block_ids(ids)) for ids in request.block_ids],
                num_tokens=min(request.num_tokens, source.num_tokens),
            )
            if not len(fragments) or not posts_quickly(self.agent, fragments, remote):
                return
            memory_type, device_id = self._destination(plan)
            handle = preparer.prepare_write(
                fragments,
                remote,
                self._notice(key),
                dst_memory_type=memory_type,
                dst_device_id=device_id,
            )
        except (TransferLayerError, ValueError) as exc:
            log.debug("KV write %d to %s not prepared: %s", key, peer_key, exc)
            return  # the write path maps it again and reports what is wrong
        write = PreparedWrite(
            request=request, source=source, fragments=fragments, remote=remote, handle=handle
        )
        self._release_handles([self.prepared.add(key, write)])

    def _forget_prepared(self, key: int) -> None:
        self._release_handles(self.prepared.drop(key))

    def _release_handles(self, handles: Sequence[XferHandle | None]) -> None:
        """Hand prepared writes that will never be posted back to the agent (in a task: the
        agent may be busy in a worker thread)."""
        for handle in handles:
            if handle is not None:
                self._spawn(self._release_handle, handle)

    async def _release_handle(self, handle: XferHandle) -> None:
        await self._call_agent(lambda: self.agent.release(handle), quick=True)

    def check_context_transfer_status(self) -> list[TransferOutcome]:
        now = self.clock()
        for session in self.senders.expired(now):
            session.fail(f"KV transfer {session.key} timed out after {self.timeout_s:g}s")
        done = []
        for session in self.senders:
            if session.is_terminal and session.is_quiescent:
                self.senders.pop(session.key)
                status = session.status
                done.append(
                    self._outcome(
                        session.key,
                        ok=status is SenderStatus.TRANSFERRED,
                        cancelled=status is SenderStatus.CANCELLED,
                        error=session.error,
                    )
                )
        return done

    def _accept_request(self, session: SenderSession, request: RequestData) -> None:
        peer_key = (request.instance_name, request.instance_rank)
        peer = self.registrar.get(peer_key)
        if peer is None:
            return
        if session.expected is None:
            overlap = self.registrar.overlap(peer, peer_dp_rank=peer.dp_rank)
            session.bind(request.instance_name, frozenset(overlap.ranks))
        session.add_request(request)

    def _start_writes(self, session: SenderSession) -> None:
        for request in session.take_writes():
            start = self.clock()
            early: _Posted | Fragments | Exception | None
            try:
                early = self._post_at_once(session, request)
            except (TransferLayerError, ValueError) as exc:
                early = exc
            self._spawn(self._write, session, request, start, early)

    def _post_at_once(
        self, session: SenderSession, request: RequestData
    ) -> _Posted | Fragments | None:
        """Map a direct write right here, and post it too when the post is quick: the write
        then starts the moment the KV is ready (or gen's request arrives), not at the write
        task's first turn on the loop. Fragments: mapped, for the task to post. None: the task
        does it all (the bounce path)."""
        if request.staging_bytes or session.source is None:
            return None
        self._stamp(session.key, "write")
        prepared, stale = self.prepared.take(session.key, request, session.source)
        self._release_handles([stale])
        if prepared is not None:
            if session.cancelled or self._agent_lock.locked():
                self._release_handles([prepared.handle])
            else:
                return self._post_prepared(session, request, prepared)
        plan = self.registrar.send_plan((request.instance_name, request.instance_rank))
        fragments = self._fragments(session, request, plan)
        remote = self._remote_names[(request.instance_name, request.instance_rank)]
        if (
            session.cancelled
            or not len(fragments)
            or self._agent_lock.locked()  # a threaded agent call runs: never overlap it
            or not posts_quickly(self.agent, fragments, remote)
        ):
            return fragments
        submit = self._submitter(session.key, fragments, request, plan)
        return self._post_now(session, request, fragments, remote, submit)

    def _post_prepared(
        self, session: SenderSession, request: RequestData, prepared: PreparedWrite
    ) -> _Posted:
        preparer = write_preparer(self.agent)
        assert preparer is not None

        def post() -> XferHandle:
            preparer.post_prepared(prepared.handle)
            self._stamp(session.key, "posted")
            return prepared.handle

        posted = self._post_now(session, request, prepared.fragments, prepared.remote, post)
        self.prepared_posts += 1
        return posted

    def _post_now(
        self,
        session: SenderSession,
        request: RequestData,
        fragments: Fragments,
        remote: str,
        submit: Callable[[], XferHandle],
    ) -> _Posted:
        """Post a quick write right here, announced before or after (`_announce_first`)."""
        first = self._announce_first(fragments, remote, quick=True)
        if first:
            self._announce(session, request, fragments, remote)
        posted = self._posted(submit(), remote, fragments)
        if not first:
            self._announce(session, request, fragments, remote)
        return posted

    async def _write(
        self,
        session: SenderSession,
        request: RequestData,
        start: float,
        early: _Posted | Fragments | Exception | None = None,
    ) -> None:
        """One write's task: post it (unless `_post_at_once` did), poll it to its end, report
        TRANSFER_RESULT."""
        peer_key = (request.instance_name, request.instance_rank)
        status, error, num_bytes, descriptors = ResultStatus.OK, "", 0, 0
        try:
            if isinstance(early, Exception):
                raise early
            if isinstance(early, _Posted):
                await self._await_write(session.key, early)
                num_bytes, descriptors = early.num_bytes, early.num_descriptors
            else:
                num_bytes, descriptors = await self._do_write(session, request, early)
        except (TransferLayerError, ValueError) as exc:
            status, error = ResultStatus.ERROR, f"{type(exc).__name__}: {exc}"
            log.warning("KV write %d to %s failed: %s", session.key, peer_key, error)
        if session.cancelled and status is ResultStatus.OK and num_bytes == 0:
            status = ResultStatus.CANCELLED
        session.write_finished(request.instance_rank, status, error)
        if status is ResultStatus.OK:
            self.on_write(num_bytes, descriptors, self.clock() - start)
        await self._send_result(
            peer_key,
            session.key,
            status,
            error=error,
            num_bytes=num_bytes,
            num_descriptors=descriptors,
            first_tokens=session.first_tokens if status is ResultStatus.OK else (),
        )
        self._stamp(session.key, "result_sent")
        self.wake()

    async def _send_result(
        self,
        peer_key: tuple[str, int],
        key: int,
        status: ResultStatus,
        *,
        error: str = "",
        num_bytes: int = 0,
        num_descriptors: int = 0,
        first_tokens: tuple[int, ...] = (),
    ) -> None:
        """TRANSFER_RESULT for `key` to the gen rank `peer_key`, if it is registered."""
        peer = self.registrar.get(peer_key)
        if peer is None:
            return
        result = TransferResult(
            key=key,
            instance_name=self.local.instance_name,
            instance_rank=self.local.instance_rank,
            status=status,
            num_bytes=num_bytes,
            num_descriptors=num_descriptors,
            error=error,
            first_tokens=first_tokens,
        )
        await self._send(peer.control_endpoint, result)

    async def _do_write(
        self, session: SenderSession, request: RequestData, fragments: Fragments | None
    ) -> tuple[int, int]:
        assert session.source is not None
        plan = self.registrar.send_plan((request.instance_name, request.instance_rank))
        if request.staging_bytes:
            self._stamp(session.key, "write")
            num_tokens = min(request.num_tokens, session.source.num_tokens)
            return await self._write_staged(session, request, plan, num_tokens)
        if fragments is None:
            fragments = self._fragments(session, request, plan)
        if session.cancelled or len(fragments) == 0:
            return 0, 0
        await self._submit_and_wait(session.key, fragments, request, plan, announce=session)
        return fragments.num_bytes, len(fragments)

    def _fragments(self, session: SenderSession, request: RequestData, plan: SendPlan) -> Fragments:
        """The merged fragments of a direct write of `session`'s KV into `request`'s blocks."""
        assert session.source is not None
        fragments = plan.fragments(
            src_blocks=session.source.block_ids,
            dst_blocks=[list(unpack_block_ids(ids)) for ids in request.block_ids],
            num_tokens=min(request.num_tokens, session.source.num_tokens),
        )
        self._stamp(session.key, "mapped")
        return fragments

    async def _write_staged(
        self, session: SenderSession, request: RequestData, plan: SendPlan, num_tokens: int
    ) -> tuple[int, int]:
        """Bounce: pack the runs this rank owns into staging, then write them in one go."""
        assert session.source is not None
        if self.staging is None:
            raise TransferLayerError("gen asked for the bounce path; this rank has no staging")
        if not plan.elected or session.cancelled:
            return 0, 0
        if len(request.block_ids) != 1 or len(session.source.block_ids) != 1:
            raise TransferLayerError("the bounce path moves one layer group")
        tpb = self.local.tokens_per_block
        dst_blocks = unpack_block_ids(request.block_ids[0])
        first = (-(-num_tokens // tpb) - len(dst_blocks)) * tpb
        runs = staged_runs(self.local, plan.peer, num_tokens=num_tokens - first)
        if not runs:
            return 0, 0
        needed = max(run.dst_offset + run.num_bytes for run in runs)
        if needed > request.staging_bytes:
            raise TransferLayerError(
                f"gen's staging region of {request.staging_bytes} bytes cannot hold {needed}"
            )
        num_bytes = sum(run.num_bytes for run in runs)
        staging = self.staging
        offset = await staging.reserve(num_bytes, session.deadline)
        try:
            src_blocks = list(session.source.block_ids[0])
            await trio.to_thread.run_sync(
                lambda: staging.stager.pack(
                    offset, runs, src_blocks, first_token=first, num_tokens=num_tokens
                )
            )
            fragments = staged_fragments(
                runs,
                src_address=staging.stager.address + offset,
                dst_address=request.staging_address,
            )
            await self._submit_and_wait(session.key, fragments, request, plan)
        finally:
            staging.release(offset)
        self.bounced += 1
        return num_bytes, len(fragments)

    async def _submit_and_wait(
        self,
        key: int,
        fragments: Fragments,
        request: RequestData,
        plan: SendPlan,
        *,
        announce: SenderSession | None = None,
    ) -> None:
        """Post one write of `fragments` to the requesting rank and poll it to the end.
        `announce`: this is the rank's only write for the session; tell gen (WRITE_POSTED)."""
        remote = self._remote_names[(request.instance_name, request.instance_rank)]
        submit = self._submitter(key, fragments, request, plan)
        # On the loop only when the agent says this post is quick (NIXL: a few descriptors to a
        # connected peer, from VRAM or a small DRAM region: ~0.1-0.2 ms, less than the thread
        # hop). A long descriptor list, a first write (connection set-up) or a large host-memory
        # write (which UCX may copy inside the post) goes to a worker thread.
        quick = posts_quickly(self.agent, fragments, remote)
        first = self._announce_first(fragments, remote, quick=quick)
        if announce is not None and first:
            self._announce(announce, request, fragments, remote)
        handle = await self._call_agent(submit, quick=quick)
        if announce is not None and not first:
            self._announce(announce, request, fragments, remote)
        await self._await_write(key, self._posted(handle, remote, fragments))

    def _submitter(
        self, key: int, fragments: Fragments, request: RequestData, plan: SendPlan
    ) -> Callable[[], XferHandle]:
        """The agent call that posts the write (on the loop or in a worker thread)."""
        remote = self._remote_names[(request.instance_name, request.instance_rank)]
        notice = self._notice(key)
        memory_type, device_id = self._destination(plan)

        def submit() -> XferHandle:
            handle = self.agent.submit_write(
                fragments, remote, notice, dst_memory_type=memory_type, dst_device_id=device_id
            )
            self._stamp(key, "posted")
            return handle

        return submit

    def _notice(self, key: int) -> bytes:
        """The notification payload of a write of `key` from this rank (WRITE_NOTICE)."""
        return encode(
            WriteNotice(
                key=key,
                instance_name=self.local.instance_name,
                instance_rank=self.local.instance_rank,
            )
        )

    @staticmethod
    def _destination(plan: SendPlan) -> tuple[str, int]:
        """The agent's `dst_memory_type` and `dst_device_id` for writes to `plan`'s peer."""
        pool = plan.peer.page_table.layer_groups[0].pool
        return pool.memory_type, pool.device_id

    def _posted(self, handle: XferHandle, remote: str, fragments: Fragments) -> _Posted:
        posted = self.clock()
        rate = self._write_rates.get(remote)
        return _Posted(
            handle=handle,
            remote=remote,
            num_bytes=fragments.num_bytes,
            num_descriptors=len(fragments),
            posted=posted,
            expected=posted + (fragments.num_bytes / rate if rate else 0.0),
        )

    async def _await_write(self, key: int, write: _Posted) -> None:
        """Poll a posted write to its end, then hand its handle back (also when cancelled)."""
        handle = write.handle
        try:
            while True:
                state = await self._call_agent(lambda: self.agent.poll(handle), quick=True)
                if state is XferStatus.DONE:
                    self._stamp(key, "done")
                    break
                if state is XferStatus.ERROR:
                    raise TransferLayerError(f"agent reported an error writing {key}")
                every_round = polls_every_round(self.clock(), write.posted, write.expected)
                await trio.sleep(0 if every_round else 0.001)
            self._learn_rate(write.remote, write.num_bytes, self.clock() - write.posted)
        finally:
            # Shielded: a cancelled write task must still hand its handle back.
            with trio.CancelScope(shield=True):
                await self._call_agent(lambda: self.agent.release(handle), quick=True)

    def _announce_first(self, fragments: Fragments, remote: str, *, quick: bool) -> bool:
        """Whether WRITE_POSTED goes before the post rather than after it. Before a slow post,
        which may copy a host pool's bytes inside the call; before a quick one when the write
        is expected to end within a message hop (or its time is unknown yet), else the message
        would land after the notification and hold gen up. A longer write is better off with
        its bytes moving first."""
        if not quick:
            return True
        rate = self._write_rates.get(remote)
        return rate is None or fragments.num_bytes / rate < ANNOUNCE_AFTER_S

    def _announce(
        self, session: SenderSession, request: RequestData, fragments: Fragments, remote: str
    ) -> None:
        """WRITE_POSTED to the requesting rank, sent with the post so that it travels while the
        bytes do: gen can then end the transfer on the write's notification instead of waiting
        for TRANSFER_RESULT, which needs this side's poll to see the write done and another
        message hop. Just before a slow post, which may copy a host pool's bytes inside the
        call, and before a quick one whose write is short (`_announce_first`); just after a
        quick post otherwise. Safe before the post: gen counts the write only on its
        notification, which a write that failed to post never sends. On the loop (it may spawn
        a send)."""
        peer = self.registrar.get((request.instance_name, request.instance_rank))
        if peer is None:
            return
        rate = self._write_rates.get(remote)
        expected_s = fragments.num_bytes / rate if rate else 0.0
        message = WritePosted(
            key=session.key,
            instance_name=self.local.instance_name,
            instance_rank=self.local.instance_rank,
            num_bytes=fragments.num_bytes,
            num_descriptors=len(fragments),
            expected_us=round(expected_s * 1e6),
            first_tokens=session.first_tokens,
        )
        dealer = self._dealers.get(peer.control_endpoint)
        if dealer is not None:
            try:
                dealer.send_message_nowait(message)
                return
            except trio.WouldBlock:
                pass
        self._spawn(self._send, peer.control_endpoint, message)

    def _learn_rate(self, remote: str, num_bytes: int, seconds: float) -> None:
        """Track how fast writes to `remote` go (bytes/s, a moving average), so that the next
        one is polled at every round only near its expected end. The measured time is at most
        one slow poll late, which the next estimate then corrects (TIMER_SLACK_S covers it)."""
        if seconds <= 0 or num_bytes <= 0:
            return
        rate = num_bytes / seconds
        old = self._write_rates.get(remote)
        self._write_rates[remote] = rate if old is None else 0.75 * old + 0.25 * rate

    async def _call_agent(self, call: Callable[[], T], *, quick: bool) -> T:
        """One synchronous agent call: on the loop when `quick` (the agent's contract says it
        returns quickly), else on a worker thread. Agent calls never overlap: a threaded call
        holds `_agent_lock` throughout, and a loop call waits for it (only then yielding)."""
        if not quick:
            async with self._agent_lock:
                return await trio.to_thread.run_sync(call)
        if self._agent_lock.locked():
            async with self._agent_lock:
                return call()
        return call()

    # ---- gen (receiver) side ----

    def request_and_receive_async(
        self,
        key: int,
        ctx_info_endpoint: str,
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        *,
        ctx_instance: str | None = None,
    ) -> None:
        """Ask the ctx instance at `ctx_info_endpoint` for `key`'s KV. `ctx_instance`, when
        known (ctx's answer names it), is the instance expected there: a different cached one
        is forgotten and the endpoint met again (a ctx restarted on a reused port)."""
        self._timing[key] = _Timing(started=self.clock())
        self._stamp(key, "request")
        if ctx_instance is not None:
            self._forget_replaced(ctx_info_endpoint, ctx_instance)
        if self._request_at_once(key, ctx_info_endpoint, block_ids, num_tokens):
            return
        self._starting[key] = False
        self._spawn(self._receive, key, ctx_info_endpoint, block_ids, num_tokens)

    def _request_at_once(
        self, key: int, endpoint: str, block_ids: Sequence[Sequence[int]], num_tokens: int
    ) -> bool:
        """The usual case, done in the caller's turn: a ctx instance met before, direct writes
        (no staging room to wait for), dealers open. REQUEST_DATA leaves before this returns,
        with no task to start and no scheduling round to wait for (each costs 0.1-0.2 ms of a
        transfer). False: nothing done; `_receive` takes the request."""
        peer = self._ctx_peers.get(endpoint)
        if peer is None or not peer.ready.is_set() or peer.refusal is not None or not peer.ranks:
            return False
        ranks = peer.ranks
        overlap = self.registrar.overlap(ranks[0], peer_dp_rank=ranks[0].dp_rank)
        if self._bounces_with(ranks, overlap.ranks):
            return False
        by_rank = {info.instance_rank: info for info in ranks}
        endpoints = [by_rank[rank].control_endpoint for rank in sorted(overlap.ranks)]
        dealers = [self._dealers.get(endpoint) for endpoint in endpoints]
        if any(dealer is None for dealer in dealers):
            return False
        request = self._open_receive(
            key, ranks, overlap.ranks, block_ids, num_tokens, self.clock() + self.timeout_s
        )
        if request is None:
            return True
        for endpoint, dealer in zip(endpoints, dealers):
            assert dealer is not None
            try:
                dealer.send_message_nowait(request)
            except trio.WouldBlock:
                self._spawn(self._send, endpoint, request)  # a full outbox: wait for room
        self._requested(key)
        return True

    def _open_receive(
        self,
        key: int,
        ranks: Sequence[RankInfo],
        expected: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        deadline: float,
        staged: _Staged | None = None,
    ) -> RequestData | None:
        """Start the receive session of `key`; the REQUEST_DATA to send to each expected ctx
        rank, or None (the failure is reported) if `key` is already being received."""
        session = ReceiverSession(
            key=key,
            peer_instance=ranks[0].instance_name,
            expected=frozenset(expected),
            deadline=deadline,
        )
        try:
            self.receivers.add(session)
            self._receiving.set()
        except ValueError:
            if staged is not None and self.staging is not None:
                self.staging.release(staged.offset)
            self._fail_receive(key, f"transfer key {key} is already being received")
            return None
        request = RequestData(
            key=key,
            instance_name=self.local.instance_name,
            instance_rank=self.local.instance_rank,
            block_ids=tuple(pack_block_ids(ids) for ids in block_ids),
            num_tokens=num_tokens,
            staging_address=(
                self.staging.stager.address + staged.offset
                if staged is not None and self.staging is not None
                else 0
            ),
            staging_bytes=staged.num_bytes if staged is not None else 0,
        )
        if staged is not None:
            self._staged[key] = staged
        session.mark_requested()
        return request

    def _requested(self, key: int) -> None:
        """REQUEST_DATA for `key` went out: watch for its notification at every round a while."""
        self._stamp(key, "sent")
        self._spin_notices_until = max(self._spin_notices_until, self.clock() + SPIN_POLL_S)

    async def _receive(
        self, key: int, endpoint: str, block_ids: Sequence[Sequence[int]], num_tokens: int
    ) -> None:
        deadline = self.clock() + self.timeout_s
        try:
            ranks = await self._ensure_ctx_peer(endpoint)
        except PeerIncompatible as exc:
            self._starting.pop(key, None)
            self._fail_receive(key, str(exc))
            return
        except (TransferLayerError, OSError, trio.TooSlowError) as exc:
            self._starting.pop(key, None)
            self._fail_receive(key, f"cannot reach ctx at {endpoint}: {exc}")
            return
        overlap = self.registrar.overlap(ranks[0], peer_dp_rank=ranks[0].dp_rank)
        staged = None
        if self._bounces_with(ranks, overlap.ranks) and len(block_ids) == 1:
            try:
                staged = await self._reserve_receive(block_ids[0], num_tokens, deadline)
            except TransferLayerError as exc:
                self._starting.pop(key, None)
                self._fail_receive(key, str(exc))
                return
        if self._starting.pop(key, False):
            if staged is not None:
                self.staging.release(staged.offset)  # type: ignore[union-attr]
            self._cancelled_early.add(key)  # cancelled before asking: ask for nothing
            self.wake()
            return
        request = self._open_receive(
            key, ranks, overlap.ranks, block_ids, num_tokens, deadline, staged
        )
        if request is None:
            return
        by_rank = {info.instance_rank: info for info in ranks}
        for rank in sorted(overlap.ranks):
            await self._send(by_rank[rank].control_endpoint, request)
        self._requested(key)

    def _bounces_with(self, ranks: Sequence[RankInfo], expected: Sequence[int]) -> bool:
        """Whether receiving from these ctx ranks goes through staging (bounce.bounces); ctx
        decides the same from the same mapper, and both ends agreed on the settings."""
        if self.staging is None:
            return False
        bounce = self.local.bounce
        by_rank = {info.instance_rank: info for info in ranks}
        return any(
            bounces(
                self.registrar.send_plan(by_rank[rank].key).piece_bytes,
                threshold_bytes=bounce.threshold_bytes,
                enabled=bounce.enabled,
            )
            for rank in expected
        )

    async def _reserve_receive(
        self, block_ids: Sequence[int], num_tokens: int, deadline: float
    ) -> _Staged | None:
        """Room for this rank's canonical region; None when it can never fit (direct path)."""
        assert self.staging is not None
        tpb = self.local.tokens_per_block
        first = (-(-num_tokens // tpb) - len(block_ids)) * tpb
        num_bytes = canonical_bytes(self.local, num_tokens - first)
        if num_bytes > self.staging.capacity:
            log.info(
                "KV of %d tokens (%d bytes) exceeds the staging buffer: direct writes",
                num_tokens,
                num_bytes,
            )
            return None
        offset = await self.staging.reserve(num_bytes, deadline)
        return _Staged(
            offset=offset,
            num_bytes=num_bytes,
            block_ids=tuple(block_ids),
            first_token=first,
            num_tokens=num_tokens,
        )

    def _settle_staging(self, session: ReceiverSession, outcome: TransferOutcome | None) -> bool:
        """gen: a receive session is gone; scatter its staged KV if it landed, free the room.
        False: the scatter runs in a worker thread, and `outcome` is reported when it is done
        (`_scatter`), not now."""
        staged = self._staged.pop(session.key, None)
        if staged is None or self.staging is None:
            return True
        staging = self.staging
        if session.status is not ReceiverStatus.TRANSFERRED or outcome is None:
            staging.release(staged.offset)
            return True
        if staging.stager.memory_type == "VRAM":
            # Queued on the device's stream, ahead of any step that reads these blocks: the
            # call returns at once, so it may run here.
            try:
                self._unpack(staged)
            finally:
                staging.release(staged.offset)
            return True
        # Host memory: the copy is real work (a large prompt's KV), so off the loop; the blocks
        # stay the request's until the outcome is reported, and cancel_request says False.
        self._scattering.add(session.key)
        self._spawn(self._scatter, staged, outcome)
        return False

    def _unpack(self, staged: _Staged) -> None:
        assert self.staging is not None
        self.staging.stager.unpack(
            staged.offset,
            staged.block_ids,
            first_token=staged.first_token,
            num_tokens=staged.num_tokens,
        )
        self.bounced += 1

    async def _scatter(self, staged: _Staged, outcome: TransferOutcome) -> None:
        assert self.staging is not None
        try:
            await trio.to_thread.run_sync(self._unpack, staged)
        except Exception as exc:  # a failed copy fails the request, never the service
            log.warning("KV transfer %d: scattering the staged KV failed: %s", outcome.key, exc)
            outcome = attrs.evolve(outcome, ok=False, error=f"scattering the staged KV: {exc}")
        finally:
            self.staging.release(staged.offset)
            self._scattering.discard(outcome.key)
        self._scattered.append(outcome)
        self.wake()

    def _fail_receive(self, key: int, reason: str) -> None:
        self._failed_early[key] = reason
        self.wake()

    def check_gen_transfer_status(self) -> list[TransferOutcome]:
        now = self.clock()
        done = [self._outcome(key, ok=False, error=err) for key, err in self._failed_early.items()]
        self._failed_early.clear()
        done += [self._outcome(key, ok=False, cancelled=True) for key in self._cancelled_early]
        self._cancelled_early.clear()
        for session in self.receivers.expired(now):
            session.fail(f"KV transfer {session.key} timed out after {self.timeout_s:g}s")
            self._stop_receiver(session)
        for session in self.receivers:
            if not session.is_terminal:
                continue
            if not self._released(session, now):
                # Quarantined. A failure is told now (the request fails on time); the blocks
                # stay pinned until `cancel_request(key)` says no write can land any more.
                if (
                    self.early_failures
                    and session.status is ReceiverStatus.ERROR
                    and not session.failure_reported
                ):
                    session.failure_reported = True
                    failed = self._outcome(session.key, ok=False, error=session.error)
                    done.append(attrs.evolve(failed, blocks_held=True))
                continue
            self.receivers.pop(session.key)
            status = session.status
            outcome = None
            if not session.failure_reported:  # else it was told, and the executor frees
                outcome = self._outcome(
                    session.key,
                    ok=status is ReceiverStatus.TRANSFERRED,
                    cancelled=status is ReceiverStatus.CANCELLED,
                    error=session.error,
                    num_bytes=session.num_bytes,
                    num_descriptors=session.num_descriptors,
                    first_tokens=session.first_tokens,
                )
            if not self._settle_staging(session, outcome):
                continue  # reported once the staged KV is in the blocks
            if not session.is_quiescent and session.status is not ReceiverStatus.TRANSFERRED:
                self.quarantine_expired += 1
                log.warning(
                    "KV transfer %d: no answer from ctx %s %gs past the deadline; blocks freed",
                    session.key,
                    session.peer_instance,
                    self.timeout_s,
                )
            if outcome is not None:
                done.append(outcome)
        done += self._scattered
        self._scattered.clear()
        return done

    def _forget_replaced(self, endpoint: str, instance: str) -> None:
        """Drop what is cached for `endpoint` when it belongs to another ctx instance than
        `instance`; the next request meets the endpoint again. Receives already under way keep
        their sessions (they are keyed by instance) and end as they would have."""
        peer = self._ctx_peers.get(endpoint)
        if peer is None or not peer.ready.is_set() or peer.instance_name in (None, instance):
            return
        log.info(
            "ctx at %s is now instance %s (was %s): meeting it again",
            endpoint,
            instance,
            peer.instance_name,
        )
        del self._ctx_peers[endpoint]

    async def _ensure_ctx_peer(self, endpoint: str) -> tuple[RankInfo, ...]:
        """Rendezvous with the ctx instance at `endpoint` once; cached, refusal included."""
        peer = self._ctx_peers.get(endpoint)
        if peer is not None and peer.ready.is_set() and peer.refusal is None and peer.ranks:
            return peer.ranks  # the usual case: no scheduling round on a request's way out
        if peer is None:
            peer = self._ctx_peers[endpoint] = _CtxPeer()
            try:
                with trio.fail_after(RENDEZVOUS_TIMEOUT_S):
                    peer.ranks = await self._rendezvous(endpoint)
            except PeerIncompatible as exc:
                peer.refusal = str(exc)
                # Once per endpoint; every later request to it fails fast with this message.
                log.warning("refused ctx instance at %s: %s", endpoint, exc)
            except BaseException:
                del self._ctx_peers[endpoint]  # transient: the next request tries again
                # A dead or forged endpoint must not keep a reconnecting socket (and its file
                # descriptor) forever; the next attempt opens a fresh one.
                self._drop_dealer(endpoint)
                peer.ready.set()
                raise
            finally:
                peer.ready.set()
        await peer.ready.wait()
        if peer.refusal is not None:
            raise PeerIncompatible(endpoint, peer.refusal)
        if not peer.ranks:
            raise TransferLayerError(f"rendezvous with {endpoint} failed")
        return peer.ranks

    async def _rendezvous(self, endpoint: str) -> tuple[RankInfo, ...]:
        self.rendezvous_count += 1
        reply = await self._request(
            endpoint,
            RequestInstanceInfo(protocol_version=PROTOCOL_VERSION),
            _Slot(endpoint=endpoint, kind="INFO"),
        )
        if not isinstance(reply, InstanceInfo) or not reply.ranks:
            raise TransferLayerError(f"{endpoint} answered {type(reply).__name__}, no RankInfo")
        peer = self._ctx_peers.get(endpoint)
        if peer is not None:
            peer.instance_name = reply.ranks[0].instance_name
        for info in reply.ranks:
            self.registrar.register(info)  # compatibility gate on our side
        for info in reply.ranks:
            ack = await self._request(
                info.control_endpoint,
                RegisterPeer(info=self.local),
                _Slot(
                    endpoint=info.control_endpoint,
                    kind="ACK",
                    instance_name=info.instance_name,
                    instance_rank=info.instance_rank,
                ),
            )
            if not isinstance(ack, RegisterAck) or not ack.accepted:
                reason = ack.reason if isinstance(ack, RegisterAck) else "no acknowledgement"
                raise PeerIncompatible(info.label, reason)
        log.info(
            "registered with ctx instance %s at %s (%d ranks)",
            reply.ranks[0].instance_name,
            endpoint,
            len(reply.ranks),
        )
        return reply.ranks

    async def _request(self, endpoint: str, message: Message, slot: _Slot) -> Message:
        """Send `message` on the dealer to `endpoint`; wait for the reply filed under `slot`."""
        send, receive = trio.open_memory_channel[Message](1)
        self._replies[slot] = send
        try:
            await self._send(endpoint, message)
            return await receive.receive()
        finally:
            self._replies.pop(slot, None)

    # ---- both sides ----

    def cancel_request(self, key: int) -> bool:
        """Stop transfer `key`. True when no write can still land in (or read from) its blocks."""
        sender = self.senders.get(key)
        if sender is not None:
            quiescent = sender.cancel()
            for rank in sender.requesters:
                self._spawn(self._notify_cancel, sender, rank)
            return quiescent
        receiver = self.receivers.get(key)
        if receiver is not None:
            receiver.cancel()
            if receiver.status is not ReceiverStatus.TRANSFERRED:
                self._stop_receiver(receiver)
            return self._released(receiver, self.clock())
        self._forget_prepared(key)  # ctx: the request ended before its KV was ready
        if key in self._starting:
            self._starting[key] = True  # no REQUEST_DATA will go out, so nothing can land
        return key not in self._scattering  # a worker thread still copies into the blocks

    async def _notify_cancel(self, session: SenderSession, rank: int) -> None:
        if session.peer_instance is None:
            return
        peer = self.registrar.get((session.peer_instance, rank))
        if peer is not None:
            await self._send(peer.control_endpoint, self._cancel_message(session.key))

    # ---- gen quarantine: blocks that a ctx write may still reach ----

    def _released(self, session: ReceiverSession, now: float) -> bool:
        """Whether no ctx write can land in `session`'s blocks any more.

        True once the KV landed, or every expected ctx rank reported: a result, or its answer
        to our CANCEL (a ctx rank answers a CANCEL at once when it has no write in flight to us,
        else with the write's result when it ends). A ctx that stays silent for a second
        `timeout_s` past the deadline is taken for dead; that is counted and logged, since a
        ctx that is alive but that slow could still write.
        """
        settled = session.status is ReceiverStatus.TRANSFERRED or session.is_quiescent
        return settled or now >= session.deadline + self.timeout_s

    def _stop_receiver(self, session: ReceiverSession) -> None:
        """Tell every expected ctx rank, once, that we gave up on `session`."""
        if not session.cancel_sent:
            session.cancel_sent = True
            self._spawn(self._send_cancel, session)

    async def _ack_cancel(self, cancel: Cancel) -> None:
        """Answer a CANCEL for which no write of ours is in flight to its sender, so that it can
        free the blocks it keeps quarantined without waiting for a second timeout."""
        await self._send_result(
            (cancel.instance_name, cancel.instance_rank),
            cancel.key,
            ResultStatus.CANCELLED,
            error="cancelled; no write in flight",
        )

    async def _send_cancel(self, session: ReceiverSession) -> None:
        for rank in session.expected:
            peer = self.registrar.get((session.peer_instance, rank))
            if peer is not None:
                await self._send(peer.control_endpoint, self._cancel_message(session.key))

    def _cancel_message(self, key: int) -> Cancel:
        return Cancel(
            key=key, instance_name=self.local.instance_name, instance_rank=self.local.instance_rank
        )

    def _outcome(
        self,
        key: int,
        *,
        ok: bool,
        cancelled: bool = False,
        error: str | None = None,
        num_bytes: int = 0,
        num_descriptors: int = 0,
        first_tokens: tuple[int, ...] = (),
    ) -> TransferOutcome:
        timing = self._timing.pop(key, None)
        seconds = self.clock() - timing.started if timing is not None else 0.0
        self._stamp(key, "outcome")
        return TransferOutcome(
            key=key,
            ok=ok,
            cancelled=cancelled,
            error=error,
            num_bytes=num_bytes,
            num_descriptors=num_descriptors,
            seconds=seconds,
            first_tokens=first_tokens,
        )

    # ---- messaging ----

    async def _send(self, endpoint: str, message: Message) -> None:
        dealer = await self._dealer(endpoint)
        await dealer.send_message(message)

    async def _dealer(self, endpoint: str) -> Dealer:
        dealer = self._dealers.get(endpoint)
        if dealer is not None:
            return dealer
        lock = self._dealer_locks.setdefault(endpoint, trio.Lock())
        async with lock:
            dealer = self._dealers.get(endpoint)
            if dealer is None:
                assert self._nursery is not None
                dealer = await self._nursery.start(self._hold_dealer, endpoint)
            return dealer

    async def _hold_dealer(
        self, endpoint: str, *, task_status: trio.TaskStatus[Dealer] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Own one DEALER until the service ends or `_drop_dealer`; what it receives goes to
        dispatch."""
        with trio.CancelScope() as scope:
            self._dealer_scopes[endpoint] = scope
            try:
                async with open_dealer(endpoint, faults=self.faults) as dealer:
                    self._dealers[endpoint] = dealer
                    task_status.started(dealer)
                    while True:
                        message = await dealer.receive_message()
                        await self._dispatch(message, reply=None, source=endpoint)
            finally:
                gone = self._dealers.pop(endpoint, None)
                if gone is not None:
                    self._closed_bad_frames += gone.statistics().bad_frames
                self._dealer_scopes.pop(endpoint, None)

    def _drop_dealer(self, endpoint: str) -> None:
        scope = self._dealer_scopes.get(endpoint)
        if scope is not None:
            scope.cancel()

    async def _listen_router(self) -> None:
        while True:
            identity, message = await self.router.receive_message()
            await self._dispatch(message, reply=identity, source="")

    async def _dispatch(self, message: Message, *, reply: bytes | None, source: str) -> None:
        """Route one inbound message. Never blocks on a transfer; never raises on peer input."""
        try:
            await self._handle(message, reply, source)
        except TransferLayerError as exc:
            log.warning("dropped %s: %s", type(message).__name__, exc)

    async def _handle(self, message: Message, reply: bytes | None, source: str) -> None:
        match message:
            case RequestInstanceInfo():
                if reply is not None and self.local.instance_rank == 0:
                    info = InstanceInfo(protocol_version=PROTOCOL_VERSION, ranks=self.instance)
                    await self.router.send_message(reply, info)
            case RegisterPeer(info=info):
                if reply is not None:
                    await self._register_peer(info, reply)
            case InstanceInfo():
                self._deliver(_Slot(endpoint=source, kind="INFO"), message)
            case RegisterAck():
                slot = _Slot(
                    endpoint=source,
                    kind="ACK",
                    instance_name=message.instance_name,
                    instance_rank=message.instance_rank,
                )
                self._deliver(slot, message)
            case RequestData():
                self._on_request_data(message)
            case TransferResult():
                self._stamp(message.key, "result")
                session = self.receivers.lookup(message.instance_name, message.key)
                if session is not None and session.on_result(
                    message.instance_rank,
                    message.status,
                    num_bytes=message.num_bytes,
                    num_descriptors=message.num_descriptors,
                    error=message.error,
                    first_tokens=message.first_tokens,
                ):
                    # The write's notification has usually landed already: finish without
                    # waiting for the notification poller's next round.
                    self._drain_notifications()
                    self.wake()
            case WritePosted():
                self._on_write_posted(message)
            case Cancel():
                self._on_cancel(message)
            case WriteNotice():
                pass  # only valid as an agent notification payload

    def _deliver(self, slot: _Slot, message: Message) -> None:
        channel = self._replies.get(slot)
        if channel is not None:
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
                channel.send_nowait(message)

    async def _register_peer(self, info: RankInfo, identity: bytes) -> None:
        accepted, reason = True, ""
        try:
            self.registrar.register(info)
            if info.key not in self._remote_names:
                async with self._agent_lock:
                    name = await trio.to_thread.run_sync(self.agent.add_remote, info.agent_metadata)
                self._remote_names[info.key] = name
        except (PeerIncompatible, TransferLayerError) as exc:
            accepted, reason = False, str(exc)
            log.warning("refused gen rank %s: %s", info.label, reason)
        ack = RegisterAck(
            instance_name=self.local.instance_name,
            instance_rank=self.local.instance_rank,
            accepted=accepted,
            reason=reason,
        )
        await self.router.send_message(identity, ack)

    def _on_request_data(self, request: RequestData) -> None:
        self._stamp(request.key, "received")
        if self.registrar.get((request.instance_name, request.instance_rank)) is None:
            log.warning(
                "REQUEST_DATA %d from unregistered rank %s#%d dropped",
                request.key,
                request.instance_name,
                request.instance_rank,
            )
            return
        session = self.senders.lookup(request.instance_name, request.key)
        if session is None:
            if self.senders.get(request.key) is None:
                self.early.add_request(self.clock(), request)
                self._prepare(request.key, request)
            return
        self._accept_request(session, request)
        self._start_writes(session)

    def _on_write_posted(self, posted: WritePosted) -> None:
        self._stamp(posted.key, "posted_seen")
        session = self.receivers.lookup(posted.instance_name, posted.key)
        if session is None or not session.on_posted(
            posted.instance_rank,
            num_bytes=posted.num_bytes,
            num_descriptors=posted.num_descriptors,
            first_tokens=posted.first_tokens,
        ):
            return
        # Drain at every scheduling round until the notice is in: a little past ctx's estimate
        # of the write, bounded so that a write that never lands does not spin a core for long.
        spin = min(NOTICE_SPIN_MAX_S, NOTICE_SPIN_S + 2 * posted.expected_us * 1e-6)
        if not posted.expected_us:
            spin = NOTICE_SPIN_MAX_S
        self._spin_notices_until = max(self._spin_notices_until, self.clock() + spin)
        self._drain_notifications()
        if session.is_terminal:
            self.wake()

    def _on_cancel(self, cancel: Cancel) -> None:
        sender = self.senders.lookup(cancel.instance_name, cancel.key)
        if sender is not None:
            sender.cancel()
            if not sender.is_writing(cancel.instance_rank):
                self._spawn(self._ack_cancel, cancel)  # else the write's result answers it
            self.wake()
            return
        receiver = self.receivers.lookup(cancel.instance_name, cancel.key)
        if receiver is not None:
            receiver.cancel()
            if receiver.status is ReceiverStatus.CANCELLED:
                self._stop_receiver(receiver)  # ctx ranks' answers end the quarantine
            self.wake()
            return
        if self.senders.get(cancel.key) is None:
            self.early.add_cancel(self.clock(), cancel.key)  # a session made later starts cancelled
            self._forget_prepared(cancel.key)
            self._spawn(self._ack_cancel, cancel)

    async def _poll_notifications(self) -> None:
        """Agent notifications (WRITE_NOTICE) mark the bytes of a write as landed."""
        while True:
            if not len(self.receivers):
                # Idle: sleep until a receive starts rather than waking 200 times a second.
                await self._receiving.wait()
                self._receiving = trio.Event()
            # Just after a REQUEST_DATA went out, drain at every scheduling round, like the
            # ctx's write poll: the notice then waits for no 1 ms timer (which Trio rounds up to
            # ~1.2 ms), and without NIXL's progress thread the draining is what progresses
            # the write on this side. Bounded, so that a long write does not spin a core.
            spinning = self.clock() < self._spin_notices_until
            await trio.sleep(0 if spinning else 0.001)
            if len(self.receivers):  # (a notification for no session would be dropped)
                self._drain_notifications()

    def _drain_notifications(self) -> None:
        if self._agent_lock.locked():
            return  # a threaded agent call is running; the poller comes back within 1 ms
        for _remote, payload in self.agent.get_notifications():
            try:
                notice = decode(payload)
            except TransferLayerError:
                continue
            if not isinstance(notice, WriteNotice):
                continue
            self._stamp(notice.key, "notice")
            session = self.receivers.lookup(notice.instance_name, notice.key)
            if session is not None and session.on_notice(notice.instance_rank):
                self.wake()

    async def _sweep(self) -> None:
        """Wake the executor at deadlines, and drop stale early messages."""
        while True:
            deadlines = [s.deadline for s in self.senders] + [s.deadline for s in self.receivers]
            wait = min(deadlines, default=math.inf) - self.clock()
            await trio.sleep(min(max(wait, 0.01), 1.0))
            if any(s.expired(self.clock()) for s in self.senders) or any(
                s.expired(self.clock()) for s in self.receivers
            ):
                self.wake()
            # A quarantine that ends by time (no answer from ctx) needs the executor too.
            if any(s.is_terminal and self._released(s, self.clock()) for s in self.receivers):
                self.wake()
            self._release_handles(self.prepared.expired(self.clock()))
            for stale in self.early.sweep(self.clock()):
                self._forget_prepared(stale.key)
                await self._refuse_stale(stale)

    async def _refuse_stale(self, request: RequestData) -> None:
        """Answer a REQUEST_DATA whose key never showed up here, so gen fails fast."""
        await self._send_result(
            (request.instance_name, request.instance_rank),
            request.key,
            ResultStatus.ERROR,
            error=f"ctx has no request with disagg_request_id {request.key} (never prefilled "
            "here, or already released)",
        )
