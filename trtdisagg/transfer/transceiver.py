"""KvTransceiver: the executor-facing KV transfer service of one rank (the I/O shell).

It joins the messenger (ZMQ), the session state machines, the peer registrar and the transfer
agent (NIXL). The executor calls these sync methods between steps and never waits on the network:

    ctx  prepare_send(key, blocks, num_tokens)             last prefill chunk runs (optional)
         abandon_send(key, reason)                         the request ended without its KV
         respond_and_send_async(key, blocks, num_tokens)   prefill done: push KV when gen asks
         check_context_transfer_status() -> outcomes       sessions that ended; free their blocks
    gen  request_and_receive_async(key, endpoint, blocks)  blocks allocated: ask ctx for the KV
         check_gen_transfer_status() -> outcomes           KV landed (or failed): decode or fail
    both cancel_request(key) -> bool                       False while a write may still land

Lifecycle of a transfer key (= disagg_request_id):
1. gen: first contact with a `ctx_info_endpoint` runs the rendezvous (REQUEST_INSTANCE_INFO,
   then REGISTER_PEER to every ctx rank); the result, or the refusal, is cached per endpoint.
2. gen: a ReceiverSession expects one TRANSFER_RESULT per overlapping ctx rank; REQUEST_DATA
   goes to each of them (to a rank whose RankInfo says `request_notices`, also as an agent
   notification, which ctx takes when it comes first: it is the quicker on a virtual machine).
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

6. Both: a peer instance that goes silent is probed, and one that is gone (three probes
   unanswered, or another instance at its endpoint) is forgotten and its agents unloaded, so
   that its GPU memory is not kept mapped (transfer/liveness.py, transfer/peer_watch.py).

Listener tasks only update sessions and wake the executor; they never wait on a transfer.

This module is the shell: the service's tasks, dealers and router, message dispatch, and what
both sides share. The ctx side is transfer/send_side.py (`CtxSender`) and transfer/writes.py
(`CtxWrites`), gen's is transfer/receive_side.py (`GenReceiver`) and transfer/rendezvous.py
(`CtxPeers`); when to poll and when to announce is transfer/pacing.py. Each is given what it
uses of the shell, and every task runs in the shell's nursery.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import attrs
import trio
import trio.lowlevel

from trtdisagg.faults.spec import FaultInjector
from trtdisagg.transfer.errors import PeerIncompatible, TransferLayerError
from trtdisagg.transfer.pacing import (
    ANNOUNCE_AFTER_S,
    DRAIN_BURST_S,
    NOTICE_SPIN_MAX_S,
    NOTICE_SPIN_S,
    SPIN_POLL_S,
    TIMER_SLACK_S,
    Watches,
    polls_every_round,
)
from trtdisagg.transfer.peer_watch import PeerWatch
from trtdisagg.transfer.prepared import PreparedWrites
from trtdisagg.transfer.protocol.liveness import Gone, PeerLiveness
from trtdisagg.transfer.protocol.peers import PeerRegistrar
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.sessions import (
    EarlyMessages,
    ReceiverSession,
    ReceiverStatus,
    SenderSession,
    SessionRegistry,
    TransferOutcome,
)
from trtdisagg.transfer.protocol.wire import (
    NOT_REGISTERED,
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
    WritePrepared,
    decode,
    encode,
)
from trtdisagg.transfer.receive_side import GenReceiver
from trtdisagg.transfer.rehearsal import REHEARSE_EVERY_S, HandoverRehearsal
from trtdisagg.transfer.rendezvous import RENDEZVOUS_TIMEOUT_S, CtxPeers
from trtdisagg.transfer.runtime.agents.base import Notifier, TransferAgent, XferHandle, notifier
from trtdisagg.transfer.runtime.messenger import Dealer, Router, open_dealer
from trtdisagg.transfer.runtime.staging_area import StagingArea
from trtdisagg.transfer.send_side import CtxSender
from trtdisagg.transfer.writes import CtxWrites

__all__ = [
    "ANNOUNCE_AFTER_S",
    "NOTICE_SPIN_MAX_S",
    "NOTICE_SPIN_S",
    "RENDEZVOUS_TIMEOUT_S",
    "SPIN_POLL_S",
    "STAGES",
    "TIMER_SLACK_S",
    "KvTransceiver",
    "TransceiverStatistics",
    "TransferOutcome",
    "polls_every_round",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# The steps `KvTransceiver.stages` records, in the order a transfer normally takes them.
STAGES = (
    "request",  # gen: request_and_receive_async called
    "sent",  # gen: REQUEST_DATA handed to zmq (every expected ctx rank)
    "received",  # ctx: REQUEST_DATA dispatched
    "prepared_seen",  # gen: WRITE_PREPARED dispatched (generation_first: ctx prepared the write)
    "write",  # ctx: the write task runs
    "mapped",  # ctx: the write's fragments are computed
    "post",  # ctx: the agent's post call starts
    "posted",  # ctx: the agent write is posted (WRITE_POSTED goes to zmq around it)
    "posted_seen",  # gen: WRITE_POSTED dispatched
    "done",  # ctx: the agent reports DONE
    "result_sent",  # ctx: TRANSFER_RESULT handed to zmq
    "result",  # gen: TRANSFER_RESULT dispatched
    "drain_idle",  # gen: the last drain before the notice's found nothing
    "drain_call",  # gen: the drain that found the notice started
    "drain_got",  # gen: ... and the agent's call returned (then it is decoded)
    "notice",  # gen: the write's notification drained
    "outcome",  # both: the outcome handed to the executor
    "woke",  # gen (benchmarks): the waiter's `wait_for` returned
    "checked",  # gen (benchmarks): the check that hands the outcome over returned
)


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
    watched: int = 0  # peers' next moves watched for now (pacing.py)
    watch_s: float = 0.0  # seconds the loop spun watching for them (since start)
    # ctx: REQUEST_DATA taken from an agent notification, ahead of its ZMQ copy (since start),
    # and how many of those copies are still to come (each is dropped when it does)
    request_notices: int = 0
    request_copies_due: int = 0
    # peer instances watched for being gone (transfer/liveness.py), and forgotten as gone
    peers_watched: int = 0
    peers_forgotten: int = 0
    peers_dead: int = 0  # ... of which had ended: what waited on them failed at once
    peer_probes: int = 0
    rehearsals: int = 0  # gen: twin hand-overs run while spinning for a write (rehearsal.py)


@attrs.define(eq=False, kw_only=True)
class _Timing:
    started: float
    finished: float | None = None


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
    # Report a failed receive at once while its blocks stay quarantined (`blocks_held`). A
    # multi-rank instance turns it off: its ranks' outcomes are merged, and a rank reports a
    # failure only once its blocks are free, so the merged outcome can free them.
    early_failures: bool = True
    # Whether the loop may spin now to watch for a peer's next move (pacing.py): the worker
    # says so while its executor runs no step; a multi-rank follower never does.
    may_spin: Callable[[], bool] = lambda: True
    # Which peer instances are gone (transfer/liveness.py); tests shorten its times.
    liveness: PeerLiveness = attrs.Factory(PeerLiveness)
    registrar: PeerRegistrar = attrs.field(init=False)
    senders: SessionRegistry[SenderSession] = attrs.Factory(SessionRegistry)
    receivers: SessionRegistry[ReceiverSession] = attrs.Factory(SessionRegistry)
    early: EarlyMessages = attrs.Factory(EarlyMessages)
    prepared: PreparedWrites = attrs.Factory(PreparedWrites)
    _nursery: trio.Nursery | None = None
    _agent_lock: trio.Lock = attrs.Factory(trio.Lock)
    _dealers: dict[str, Dealer] = attrs.Factory(dict)
    _dealer_scopes: dict[str, trio.CancelScope] = attrs.Factory(dict)
    _closed_bad_frames: int = 0  # bad frames counted by dealers since closed
    _dealer_locks: dict[str, trio.Lock] = attrs.Factory(dict)
    _remote_names: dict[tuple[str, int], str] = attrs.Factory(dict)  # ctx: gen ranks' agents
    # gen: the agents of ctx ranks that take REQUEST_DATA as a notification, connected
    _notice_remotes: dict[tuple[str, int], str] = attrs.Factory(dict)
    _timing: dict[int, _Timing] = attrs.Factory(dict)
    _watches: Watches = attrs.Factory(Watches)
    watch_s: float = 0.0  # time the loop spun watching (since start; what it cost in CPU)
    _watch_started: trio.Event = attrs.Factory(trio.Event)
    _waiting: int = 0  # tasks in `wait_for` (the executor), which then spin in its place
    _waiter_spins: bool = False  # ... and one of them spins now: gen's poller leaves it alone
    # Benchmarks only: when a list, every transfer appends (key, stage, clock()) at each step
    # of its way (see `STAGES`), so a bench can tell where the time goes. None: nothing kept.
    stages: list[tuple[int, str, float]] | None = None
    _drained_empty_at: float = 0.0  # (stages kept only) when a drain last found nothing
    _rehearsal: HandoverRehearsal | None = None  # gen: made at its first spin for a write
    _rehearsal_due: float = 0.0  # ... and run again from then (inf: it failed, never again)
    # The two sides (transfer/send_side.py, writes.py, receive_side.py, rendezvous.py).
    _ctx_peers: CtxPeers = attrs.field(init=False)
    _writes: CtxWrites = attrs.field(init=False)
    _ctx_side: CtxSender = attrs.field(init=False)
    _gen_side: GenReceiver = attrs.field(init=False)
    _peer_watch: PeerWatch = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.registrar = PeerRegistrar(self.local)
        # A REQUEST_DATA whose ctx session never appears is refused after the transfer timeout.
        self.early = EarlyMessages(ttl=self.timeout_s)
        self._ctx_peers = CtxPeers(
            local=self.local,
            registrar=self.registrar,
            send=self._send,
            drop_dealer=self._drop_dealer,
            met=self._met_ctx,
            replaced=self._forget_request_notices,
        )
        self._peer_watch = PeerWatch(
            liveness=self.liveness, clock=self.clock, send=self._send, forget=self._forget_peer
        )
        self._writes = CtxWrites(
            local=self.local,
            agent=self.agent,
            registrar=self.registrar,
            wake=self.wake,
            on_write=self.on_write,
            clock=self.clock,
            staging=self.staging,
            prepared=self.prepared,
            remote_names=self._remote_names,
            dealers=self._dealers,
            agent_lock=self._agent_lock,
            stamp=self._stamp,
            spawn=self._spawn,
            send=self._send,
            call_agent=self._call_agent,
        )
        self._ctx_side = CtxSender(
            agent=self.agent,
            registrar=self.registrar,
            timeout_s=self.timeout_s,
            clock=self.clock,
            senders=self.senders,
            early=self.early,
            prepared=self.prepared,
            writes=self._writes,
            remote_names=self._remote_names,
            agent_lock=self._agent_lock,
            stamp=self._stamp,
            spawn=self._spawn,
            start_timing=self._start_timing,
            outcome=self._outcome,
            watch=self._watch,
            forget=self._watches.forget,
        )
        self._gen_side = GenReceiver(
            local=self.local,
            registrar=self.registrar,
            timeout_s=self.timeout_s,
            wake=self.wake,
            clock=self.clock,
            staging=self.staging,
            receivers=self.receivers,
            ctx_peers=self._ctx_peers,
            dealers=self._dealers,
            stamp=self._stamp,
            spawn=self._spawn,
            send=self._send,
            start_timing=self._start_timing,
            outcome=self._outcome,
            cancel_message=self._cancel_message,
            watch=self._watch,
            forget=self._watches.forget,
            drain=self._drain_notifications,
            waiter_spins=lambda: self._waiter_spins,
            notice_request=self._notice_request,
        )

    @property
    def info_endpoint(self) -> str:
        return self.instance[0].control_endpoint

    @property
    def bounced(self) -> int:
        """Transfers (sends and receives) that went through staging."""
        return self._writes.bounced + self._gen_side.bounced

    @property
    def quarantine_expired(self) -> int:
        """gen quarantines ended by the second timeout, not by ctx."""
        return self._gen_side.quarantine_expired

    @property
    def prepared_posts(self) -> int:
        """ctx writes posted from a preparation made before their KV was ready (since start)."""
        return self._writes.prepared_posts

    @property
    def rendezvous_count(self) -> int:
        """gen's rendezvous with ctx instances (since start)."""
        return self._ctx_peers.rendezvous_count

    # ---- service ----

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._listen_router)
            nursery.start_soon(self._gen_side.poll_notifications)
            nursery.start_soon(self._sweep)
            nursery.start_soon(self._keep_awake)
            nursery.start_soon(self._peer_watch.run)
            task_status.started()

    def statistics(self) -> TransceiverStatistics:
        bad = (
            self.router.statistics().bad_frames
            + self._closed_bad_frames
            + sum(d.statistics().bad_frames for d in self._dealers.values())
        )
        now = self.clock()
        quarantined = sum(s.is_terminal and not s.is_quiescent for s in self.senders) + sum(
            s.is_terminal and not self._gen_side.released(s, now) for s in self.receivers
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
            watched=self._watches.count(self.clock()),
            watch_s=self.watch_s,
            request_notices=self._ctx_side.request_notices,
            request_copies_due=self._ctx_side.copies_due,
            peers_watched=len(self.liveness),
            peers_forgotten=self._peer_watch.forgotten,
            peers_dead=self._peer_watch.dead,
            peer_probes=self._peer_watch.probes,
            rehearsals=self._rehearsal.runs if self._rehearsal is not None else 0,
        )

    def _stamp(self, key: int, stage: str) -> None:
        if self.stages is not None:
            self.stages.append((key, stage, self.clock()))

    def _watch(self, what: Hashable, seconds: float) -> None:
        """Watch for `what` (a peer's next move) for up to `seconds` (pacing.py)."""
        self._watches.watch(what, self.clock() + seconds)
        self._watch_started.set()
        if self._waiting and self.may_spin():
            self.wake()  # a waiter in `wait_for` parked: it comes back and spins

    async def wait_for(self, event: trio.Event) -> None:
        """Wait for `event`, which `wake` sets (the executor's wake-up). While a peer's next move
        is watched and the loop may spin (pacing.py), this task spins and drains the agent's
        notifications itself, in place of `_keep_awake`: a notification that ends a transfer
        then sets `event` in the waiter's own turn, and the waiter goes on at once rather than
        one scheduling round later (a bare Trio hand-off takes 25 us at p50 on the CPU host).
        A watch that starts while the waiter is parked wakes it (`_watch`)."""
        self._waiting += 1
        spinning_since: float | None = None
        try:
            while not event.is_set():
                now = self.clock()
                self._waiter_spins = self._watches.active(now) and self.may_spin()
                if self._waiter_spins:
                    spinning_since = now if spinning_since is None else spinning_since
                    await trio.lowlevel.checkpoint()
                    if not event.is_set() and self._drains():
                        self._drain_burst()
                else:
                    if spinning_since is not None:
                        self.watch_s += now - spinning_since
                        spinning_since = None
                    await event.wait()
        finally:
            self._waiting -= 1
            self._waiter_spins = False
            if spinning_since is not None:
                self.watch_s += self.clock() - spinning_since

    def _drains(self) -> bool:
        """Whether a notification may be due: gen receives, or ctx takes REQUEST_DATA so."""
        return bool(len(self.receivers) or (self.local.request_notices and len(self.senders)))

    def _drain_burst(self) -> None:
        """Drain until a notification comes, for up to DRAIN_BURST_S: a round of the loop costs
        more than a drain (on the device 10-20 us, for its epoll call), and a notification that
        lands within one waited half a round on average. A burst that ends with nothing
        drained is when gen rehearses its hand-over, if one is due (`_rehearse`)."""
        until = self.clock() + DRAIN_BURST_S
        while not self._drain_notifications():
            now = self.clock()
            if now >= until:
                if len(self.receivers) and now >= self._rehearsal_due:
                    self._rehearse(now)
                return

    def _rehearse(self, now: float) -> None:
        """gen, spinning for a write: take a twin transfer through the hand-over, so that the
        real one finds its code and data in the CPU caches (transfer/rehearsal.py). A rehearsal
        that fails says the twin left the real path; it is logged once and not run again."""
        rehearsal = self._rehearsal
        try:
            if rehearsal is None:
                rehearsal = self._rehearsal = HandoverRehearsal.of(
                    self.local, timeout_s=self.timeout_s, clock=self.clock
                )
            rehearsal.run(now)
            self._rehearsal_due = now + REHEARSE_EVERY_S
        except Exception:
            log.exception("the hand-over rehearsal failed; gen goes on without it")
            self._rehearsal_due = math.inf

    async def _keep_awake(self) -> None:
        """Spin the loop while something is watched: a loop asleep in epoll takes 0.1-0.3 ms to
        wake for a message on a virtual machine, while one that checkpoints at every round
        polls epoll without a timeout and reads the message as it lands. gen's notifications
        are drained at every round too (`_drain_burst`; one spinning task, not two). A waiter
        in `wait_for` (the executor) spins in this one's place."""
        spinning_since: float | None = None
        while True:
            now = self.clock()
            watched = self._watches.active(now)
            spins = watched and self.may_spin() and not self._waiting
            if spinning_since is not None and not spins:
                self.watch_s += now - spinning_since
                spinning_since = None
            if not watched:
                await self._watch_started.wait()
                self._watch_started = trio.Event()
            elif not spins:
                await trio.sleep(0.001)
            else:
                spinning_since = now if spinning_since is None else spinning_since
                await trio.lowlevel.checkpoint()
                if self._drains() and not self._waiting:
                    self._drain_burst()

    def _drain_notifications(self) -> bool:
        """The agent's notifications: a write's WRITE_NOTICE to gen's side, a REQUEST_DATA sent
        as one to ctx's (anything else is dropped: only peers we loaded can send them). Whether
        there were any (or the agent is busy in a thread: nothing to wait for now)."""
        if self._agent_lock.locked():
            return True  # a threaded agent call is running; the pollers come back within 1 ms
        stages = self.stages
        called = self.clock() if stages is not None else 0.0
        notifications = self.agent.get_notifications()
        got = self.clock() if stages is not None else 0.0
        if stages is not None and not notifications:
            self._drained_empty_at = got
        for remote, payload in notifications:
            try:
                message = decode(payload)
            except TransferLayerError:
                continue
            if stages is not None and isinstance(message, WriteNotice):
                stages += [
                    (message.key, "drain_idle", self._drained_empty_at),
                    (message.key, "drain_call", called),
                    (message.key, "drain_got", got),
                ]
            if isinstance(message, WriteNotice | RequestData):
                self.liveness.heard(message.instance_name, self.clock())
            if isinstance(message, WriteNotice):
                self._gen_side.on_write_notice(message)
            elif isinstance(message, RequestData):
                self._ctx_side.on_request_notice(remote, message)
        return bool(notifications)

    def _request_notices(self) -> Notifier | None:
        """gen: the agent's own notifications, when REQUEST_DATA may go that way too. Not with
        faults armed: they apply to ZMQ messages, which a test must be able to drop."""
        return notifier(self.agent) if self.faults is None else None

    async def _met_ctx(self, ranks: Sequence[RankInfo]) -> None:
        """gen, once a ctx instance accepted us: watch it (liveness.py), and connect the agents
        of its ranks that take REQUEST_DATA as a notification."""
        rank0 = min(ranks, key=lambda info: info.instance_rank)
        self.liveness.track(rank0.instance_name, rank0.control_endpoint, self.clock())
        for info in ranks:
            self.liveness.track_link(info.instance_name, info.control_endpoint)
        await self._connect_request_notices(ranks)

    def _forget_peer(self, gone: Gone) -> None:
        """A peer instance is gone (transfer/liveness.py): forget it, so that a new request
        meets it again should it come back, and unload its agents. A dead peer's KV pool stays
        allocated on its GPU while an agent of ours maps it. ctx unloads a gen rank's agent once
        no write to it is in flight (such a write fails: the rank is gone). A peer that ended
        fails what waits on it now, and frees gen's blocks it was to fill: it writes no more."""
        instance = gone.instance
        if gone.dead:
            reason = f"peer instance {instance} is gone: {gone.reason}"
            for receiver in self.receivers:
                if receiver.peer_instance == instance:
                    receiver.peer_died(reason)
            for sender in self.senders:
                if sender.peer_instance == instance:
                    sender.fail(reason)
        ranks = [*self.registrar.ranks_of(instance), *self._ctx_peers.forget_instance(instance)]
        self.registrar.forget(instance)
        handles = self.prepared.drop_requests_of(instance)
        names = [self._remote_names.pop(k) for k in list(self._remote_names) if k[0] == instance]
        if names or handles:
            self._spawn(self._unload_gen_agents, names, handles)
        self._forget_request_notices(ranks)  # gen: ctx ranks' agents (gen never writes to them)
        for endpoint in {info.control_endpoint for info in ranks}:
            self._drop_dealer(endpoint)
        self.wake()  # the executor's metrics count it

    async def _unload_gen_agents(self, names: Sequence[str], handles: Sequence[XferHandle]) -> None:
        """ctx: release the writes prepared to a gone gen instance, wait for those in flight to
        end (each ends by its deadline), then unload its ranks' agents."""
        for handle in handles:
            await self._call_agent(functools.partial(self.agent.release, handle), quick=True)
        with trio.move_on_after(2 * self.timeout_s):
            await self._writes.until_not_writing_to(names)
        for name in names:
            if self._writes.writing_to(name):
                log.warning("agent %s stays loaded: a write to it never ended", name)
            else:
                await self._remove_remote(name)

    async def _connect_request_notices(self, ranks: Sequence[RankInfo]) -> None:
        """gen, once a ctx instance accepted us: load and connect the agents of its ranks that
        take REQUEST_DATA as a notification (off the loop: the connection takes milliseconds).
        A rank that cannot be reached so gets REQUEST_DATA over ZMQ only."""
        channel = self._request_notices()
        if channel is None:
            return
        for info in ranks:
            if not info.request_notices or info.key in self._notice_remotes:
                continue

            def connect(info: RankInfo = info, channel: Notifier = channel) -> str:
                name = self.agent.add_remote(info.agent_metadata)
                try:
                    channel.connect(name)
                except TransferLayerError:
                    self.agent.remove_remote(name)  # not left loaded for nothing
                    raise
                return name

            try:
                async with self._agent_lock:
                    name = await trio.to_thread.run_sync(connect)
            except TransferLayerError as exc:
                log.warning("REQUEST_DATA to %s goes over ZMQ only: %s", info.label, exc)
                continue
            self._notice_remotes[info.key] = name

    def _forget_request_notices(self, ranks: Sequence[RankInfo]) -> None:
        """gen: the ctx instance of `ranks` was replaced by a new one (a restart on the same
        endpoint): its agents are unloaded, so that restarts do not pile up peers in ours."""
        for info in ranks:
            name = self._notice_remotes.pop(info.key, None)
            if name is not None:
                self._spawn(self._remove_remote, name)

    async def _remove_remote(self, name: str) -> None:
        try:
            await self._call_agent(lambda: self.agent.remove_remote(name), quick=False)
        except TransferLayerError as exc:
            log.warning("could not unload agent %s: %s", name, exc)

    def _notice_request(self, ctx_rank: tuple[str, int], request: RequestData) -> None:
        """gen: send `request` to `ctx_rank` as a notification too, if that rank takes it so.
        Best effort (the ZMQ copy follows), and never while a threaded agent call runs."""
        remote = self._notice_remotes.get(ctx_rank)
        channel = self._request_notices()
        if remote is None or channel is None or self._agent_lock.locked():
            return
        try:
            channel.send_notification(remote, encode(request))
        except TransferLayerError as exc:
            log.debug("REQUEST_DATA %d by notification to %s: %s", request.key, remote, exc)

    def _spawn(self, fn: Callable[..., object], *args: object) -> None:
        assert self._nursery is not None, "the transceiver is not running"
        self._nursery.start_soon(fn, *args)  # type: ignore[arg-type]

    def _start_timing(self, key: int) -> None:
        self._timing[key] = _Timing(started=self.clock())

    @asynccontextmanager
    async def lend_agent(self) -> AsyncIterator[TransferAgent]:
        """The agent, for the caller's own calls (a benchmark's raw writes, from a worker
        thread), as one of our threaded calls holds it: nothing of ours calls it meanwhile,
        so none of its notifications is drained from under the caller."""
        async with self._agent_lock:
            yield self.agent

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
        self._ctx_side.respond_and_send_async(key, block_ids, num_tokens, first_tokens)

    def prepare_send(self, key: int, block_ids: Sequence[Sequence[int]], num_tokens: int) -> None:
        """ctx, optional: the KV of `key` will be in `block_ids` once the step now starting
        ends. A gen rank that already asked (generation_first) gets its write made ready during
        that step, so that `respond_and_send_async` only has to post it."""
        self._ctx_side.prepare_send(key, block_ids, num_tokens)

    def abandon_send(self, key: int, reason: str) -> None:
        """ctx: the request of `key` ended (aborted, failed) before its KV was ready, so it will
        never call `respond_and_send_async`. A write prepared for it is dropped, and a gen rank
        that already asked for the KV (generation_first) is refused at once with `reason`
        instead of waiting for its deadline. One that asks later waits as before (its CANCEL or
        deadline ends it): the key may come back with a retried request. A no-op once the
        request has responded."""
        self._ctx_side.abandon(key, reason)

    def check_context_transfer_status(self) -> list[TransferOutcome]:
        return self._ctx_side.check_context_transfer_status()

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
        self._gen_side.request_and_receive_async(
            key, ctx_info_endpoint, block_ids, num_tokens, ctx_instance=ctx_instance
        )

    def check_gen_transfer_status(self) -> list[TransferOutcome]:
        return self._gen_side.check_gen_transfer_status(early_failures=self.early_failures)

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
                self._gen_side.stop_receiver(receiver)
            return self._gen_side.released(receiver, self.clock())
        self._ctx_side.forget_prepared(key)  # ctx: the request ended before its KV was ready
        return self._gen_side.cancel_unstarted(key)

    async def _notify_cancel(self, session: SenderSession, rank: int) -> None:
        if session.peer_instance is None:
            return
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
                on_link = functools.partial(self._on_link, endpoint)
                async with open_dealer(endpoint, faults=self.faults, on_link=on_link) as dealer:
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

    def _on_link(self, endpoint: str, up: bool) -> None:
        """Our connection to a peer rank's control endpoint came up or dropped: a dropped one
        that stays down means that peer's process ended (liveness.py)."""
        self.liveness.link(endpoint, up, self.clock())

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
        sender = getattr(message, "instance_name", None)
        if isinstance(sender, str):
            self.liveness.heard(sender, self.clock())
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
            case InstanceInfo() | RegisterAck():
                if isinstance(message, InstanceInfo) and message.ranks and source:
                    self.liveness.answered(source, message.ranks[0].instance_name, self.clock())
                self._ctx_peers.deliver(message, source)
            case RequestData():
                known = self.registrar.get((message.instance_name, message.instance_rank))
                if known is None and reply is not None:
                    await self._refuse_unregistered(message, reply)
                else:
                    self._ctx_side.on_request_data(message)
            case TransferResult():
                if message.status is ResultStatus.ERROR and message.error.startswith(
                    NOT_REGISTERED
                ):
                    # meet it again (a new instance may answer where we met another)
                    self._ctx_peers.forget_instance(message.instance_name, rank_endpoint=source)
                self._gen_side.on_transfer_result(message)
            case WritePrepared():
                self._gen_side.on_write_prepared(message)
            case WritePosted():
                self._gen_side.on_write_posted(message)
            case Cancel():
                self._on_cancel(message)
            case WriteNotice():
                pass  # only valid as an agent notification payload

    async def _refuse_unregistered(self, request: RequestData, identity: bytes) -> None:
        """ctx: REQUEST_DATA from a gen rank we do not know (never registered, or forgotten as
        gone while it was alive): fail it at once, and gen meets us again at its next request."""
        log.warning(
            "REQUEST_DATA %d from unregistered gen rank %s#%d refused",
            request.key,
            request.instance_name,
            request.instance_rank,
        )
        result = TransferResult(
            key=request.key,
            instance_name=self.local.instance_name,
            instance_rank=self.local.instance_rank,
            status=ResultStatus.ERROR,
            error=f"{NOT_REGISTERED}: gen rank {request.instance_name}#{request.instance_rank}"
            " registers again at its next request",
        )
        await self.router.send_message(identity, result)

    async def _register_peer(self, info: RankInfo, identity: bytes) -> None:
        accepted, reason = True, ""
        try:
            self.registrar.register(info)
            if info.key not in self._remote_names:
                async with self._agent_lock:
                    name = await trio.to_thread.run_sync(self.agent.add_remote, info.agent_metadata)
                self._remote_names[info.key] = name
            if info.instance_rank == 0:
                self.liveness.track(info.instance_name, info.control_endpoint, self.clock())
            self.liveness.track_link(info.instance_name, info.control_endpoint)
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

    def _on_cancel(self, cancel: Cancel) -> None:
        sender = self.senders.lookup(cancel.instance_name, cancel.key)
        if sender is not None:
            if cancel.instance_rank not in sender.heard:
                self.early.add_overtaken(
                    self.clock(), cancel.instance_name, cancel.instance_rank, cancel.key
                )
            sender.cancel()
            if not sender.is_writing(cancel.instance_rank):
                self._spawn(self._ctx_side.ack_cancel, cancel)  # else the write's result answers it
            self.wake()
            return
        receiver = self.receivers.lookup(cancel.instance_name, cancel.key)
        if receiver is not None:
            receiver.cancel()
            if receiver.status is ReceiverStatus.CANCELLED:
                self._gen_side.stop_receiver(receiver)  # ctx ranks' answers end the quarantine
            self.wake()
            return
        if self.senders.get(cancel.key) is None:
            # The answer below is that rank's one answer to its request: drop what we hold of
            # it (else our sweep answers it again, maybe to a later use of the key); if we
            # hold nothing, the CANCEL overtook the request, which is dropped when it comes.
            if not self.early.drop_requests_of(
                cancel.instance_name, cancel.instance_rank, cancel.key
            ):
                self.early.add_overtaken(
                    self.clock(), cancel.instance_name, cancel.instance_rank, cancel.key
                )
            self.early.add_cancel(self.clock(), cancel.key)  # a session made later starts cancelled
            self._ctx_side.forget_prepared(cancel.key)
            self._spawn(self._ctx_side.ack_cancel, cancel)

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
            if any(
                s.is_terminal and self._gen_side.released(s, self.clock()) for s in self.receivers
            ):
                self.wake()
            self._writes.release_handles(self.prepared.expired(self.clock()))
            self._ctx_side.forget_noticed(self.clock())
            if self.local.request_notices and not self._waiter_spins:
                self._drain_notifications()  # REQUEST_DATA copies that came while not watching
            for stale in self.early.sweep(self.clock()):
                self._ctx_side.forget_prepared(stale.key)
                await self._ctx_side.refuse_stale(stale)
