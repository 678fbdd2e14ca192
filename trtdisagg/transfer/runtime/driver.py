"""KvTransceiver: one rank's KV transfer service, the Trio driver of the protocol core.

The executor calls these between steps; none of them waits on the network:

    ctx  respond_and_send_async(key, blocks, num_tokens, first_tokens)   the KV is ready
         abandon_send(key, reason)                         the request ended without its KV
         check_context_transfer_status() -> outcomes       sends over: free their blocks
    gen  request_and_receive_async(key, endpoint, blocks, num_tokens)    ask ctx for the KV
         check_gen_transfer_status() -> outcomes           KV landed (or failed): decode or fail
    both cancel_request(key) -> bool                       False while a write may still land

Each call, control message, notification and write's end is an event for the pure protocol core
(protocol/core.py); this driver carries out the effects it answers with and owns every I/O
resource. `wake` tells the executor when there are outcomes. `tracer`, when given, is called
with (key, stage, time) at each of `STAGES`; unset, it costs nothing.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Final

import attrs
import trio

from trtdisagg.security.keys import PeerLabel
from trtdisagg.transfer.errors import ProtocolError, TransferLayerError
from trtdisagg.transfer.protocol import events as ev
from trtdisagg.transfer.protocol import wire
from trtdisagg.transfer.protocol.core import TransferProtocol
from trtdisagg.transfer.protocol.gen import StagingInfo
from trtdisagg.transfer.protocol.liveness import PeerLiveness
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.sessions import SourceBlocks, TransferOutcome
from trtdisagg.transfer.runtime.agents.base import TransferAgent, XferStatus
from trtdisagg.transfer.runtime.collector import TransceiverStatistics, WriteTally
from trtdisagg.transfer.runtime.control import ControlPlane, ControlRouter, DealerOpener
from trtdisagg.transfer.runtime.messenger import open_dealer
from trtdisagg.transfer.runtime.pump import AgentPump, Ended, Notifications, Posted
from trtdisagg.transfer.runtime.staging_area import StagingArea

log = logging.getLogger(__name__)

# What `tracer` is told, in the order a transfer usually goes: gen's call, ctx's REQUEST_DATA,
# the write's post and end (ctx), gen's TRANSFER_RESULT and notification, the outcome (both).
STAGES: Final = ("request", "received", "posted", "done", "result", "notice", "outcome")
TICK_S: Final = 0.01  # deadlines are looked at this often while a transfer is under way


@attrs.define(eq=False, kw_only=True)
class _Flight:
    order: ev.WriteOrder
    remote: str
    posted: float
    staging_offset: int | None = None


@attrs.define(eq=False, kw_only=True)
class KvTransceiver:
    local: RankInfo
    instance: tuple[RankInfo, ...]  # every rank of this instance
    agent: TransferAgent
    router: ControlRouter
    timeout_s: float
    wake: Callable[[], None]
    clock: Callable[[], float] = time.monotonic
    # Report a failed receive at once while its blocks stay quarantined (`blocks_held`). A
    # multi-rank instance turns it off: its ranks' outcomes are merged, and a rank reports a
    # failure only once its blocks are free, so the merged outcome can free them.
    early_failures: bool = True
    staging: StagingArea | None = None  # the bounce path (kv_cache_bounce_size_mb > 0)
    liveness: PeerLiveness = attrs.Factory(PeerLiveness)
    connect: DealerOpener = open_dealer
    tracer: Callable[[int, str, float], None] | None = None
    max_sessions_per_peer: int = 1024  # transfers one gen instance may hold with a ctx rank
    protocol: TransferProtocol = attrs.field(init=False)
    tally: WriteTally = attrs.Factory(WriteTally)  # KV writes (since start), for the metrics
    # (bytes, descriptors, seconds, gen rank) of each KV write, instead of `tally` (a follower
    # rank reports its writes to rank 0, which counts them)
    on_write: Callable[[int, int, float, str], None] | None = None
    _control: ControlPlane = attrs.field(init=False)
    _pump: AgentPump = attrs.field(init=False)
    _nursery: trio.Nursery | None = None
    _remotes: dict[tuple[str, int], str] = attrs.Factory(dict)  # gen ranks' loaded agents
    _flights: dict[int, _Flight] = attrs.Factory(dict)  # posted writes, by write id
    _landed: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)  # a write ended
    _sent: list[TransferOutcome] = attrs.Factory(list)
    _received: list[TransferOutcome] = attrs.Factory(list)
    _busy: trio.Event = attrs.Factory(trio.Event)  # wakes the ticker when work starts
    _ticking: bool = False  # the ticker looks at deadlines every TICK_S

    def __attrs_post_init__(self) -> None:
        staging = None
        if self.staging is not None:
            stager = self.staging.stager
            staging = StagingInfo(address=stager.address, capacity=stager.capacity)
        self.protocol = TransferProtocol(
            local=self.local, instance=self.instance, timeout_s=self.timeout_s,
            liveness=self.liveness, early_failures=self.early_failures, staging=staging,
            max_sessions_per_peer=self.max_sessions_per_peer,
        )  # fmt: skip
        self._control = ControlPlane(router=self.router, deliver=self._message,
                                     on_link=self._link, connect=self.connect)  # fmt: skip
        self._pump = AgentPump(self.agent, self._delivered)

    @property
    def info_endpoint(self) -> str:
        return self.instance[0].control_endpoint

    def respond_and_send_async(self, key: int, block_ids: Sequence[Sequence[int]], num_tokens: int,
                               first_tokens: Sequence[int] = ()) -> None:  # fmt: skip
        blocks = tuple(tuple(ids) for ids in block_ids)
        source = SourceBlocks(block_ids=blocks, num_tokens=num_tokens)
        self._feed(ev.KvReady(key=key, source=source, first_tokens=tuple(first_tokens)))

    def abandon_send(self, key: int, reason: str) -> None:
        # a gen rank that already asked is refused at once (a no-op once it responded)
        self._feed(ev.SendAbandoned(key=key, reason=reason))

    def request_and_receive_async(self, key: int, ctx_info_endpoint: str,
                                  block_ids: Sequence[Sequence[int]], num_tokens: int, *,
                                  ctx_instance: str | None = None) -> None:  # fmt: skip
        # (`ctx_instance`, when known: another instance met at that endpoint is met again)
        self._trace(key, "request")
        blocks = tuple(tuple(ids) for ids in block_ids)
        self._feed(ev.ReceiveAsked(key=key, endpoint=ctx_info_endpoint, block_ids=blocks,
                                   num_tokens=num_tokens, ctx_instance=ctx_instance))  # fmt: skip

    def check_context_transfer_status(self) -> list[TransferOutcome]:
        done, self._sent = self._sent, []
        return done

    def check_gen_transfer_status(self) -> list[TransferOutcome]:
        done, self._received = self._received, []
        return done

    def cancel_request(self, key: int) -> bool:
        quiescent, effects = self.protocol.cancel(key, self.clock())
        self._apply(effects)
        return quiescent

    def statistics(self) -> TransceiverStatistics:
        protocol, ctx, gen, now = self.protocol, self.protocol.ctx, self.protocol.gen, self.clock()
        quarantined = sum(s.is_terminal and not s.is_quiescent for s in ctx.senders.values())
        quarantined += sum(s.is_terminal and not gen.released(s, now)
                           for s in gen.receivers.values())  # fmt: skip
        return TransceiverStatistics(
            rendezvous=gen.rendezvous, senders=len(ctx.senders), receivers=len(gen.receivers),
            refused={**self._control.refused, **protocol.refusals.counts},
            bad_frames=self._control.bad_frames, quarantined=quarantined,
            quarantine_expired=gen.quarantine_expired, early=len(ctx.early),
            bounced=ctx.bounced + gen.bounced, connections=self._control.connections,
            probes=protocol.probes, peers_forgotten=protocol.forgotten, peers_dead=protocol.dead,
        )  # fmt: skip

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._pump.start()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self._control.run)
                nursery.start_soon(self._tick)
                task_status.started()
        finally:
            self._nursery = None
            self._pump.stop()  # (waits for its poll of a few microseconds at most)

    async def _tick(self) -> None:
        while True:
            self._ticking = self.protocol.busy()
            with trio.move_on_after(TICK_S if self._ticking else self.protocol.tick_period):
                await self._busy.wait()
            self._busy = trio.Event()
            self._feed(ev.Tick())

    def _message(self, message: wire.Message, reply_to: bytes | None, peer: PeerLabel | None,
                 source: str) -> None:  # fmt: skip
        if self.tracer is not None and isinstance(message, wire.RequestData | wire.TransferResult):
            stage = "received" if isinstance(message, wire.RequestData) else "result"
            self._trace(message.key, stage)
        self._feed(ev.MessageIn(message=message, reply_to=reply_to, source=source,
                                peer=peer.key if peer is not None else None))  # fmt: skip

    def _link(self, endpoint: str, up: bool) -> None:
        self._feed(ev.LinkChanged(endpoint=endpoint, up=up))

    def _feed(self, event: ev.Event) -> None:
        self._apply(self.protocol.handle(event, self.clock()))

    def _apply(self, effects: list[ev.Effect]) -> None:
        woken = False
        for effect in effects:
            match effect:
                case ev.Send(endpoint=endpoint, message=message):
                    self._control.send(endpoint, message)
                case ev.Reply(reply_to=identity, message=message):
                    self._control.reply(identity, message)
                case ev.PostWrite(order=order, notice=notice):
                    self._post(order, notice)
                case ev.Sent(outcome=outcome) | ev.Received(outcome=outcome):
                    self._trace(outcome.key, "outcome")
                    (self._sent if isinstance(effect, ev.Sent) else self._received).append(outcome)
                case ev.Wake():
                    woken = True
                case ev.LoadAgent(info=info, reply_to=identity):
                    self._spawn(self._load_agent, info, identity)
                case ev.ForgetPeer(instance=instance, endpoints=endpoints):
                    self._forget(instance, endpoints)
                case ev.ReserveStaging(key=key, num_bytes=num_bytes, deadline=deadline):
                    self._spawn(self._reserve, key, num_bytes, deadline)
                case ev.ReleaseStaging(offset=offset):
                    assert self.staging is not None
                    self.staging.release(offset)
                case ev.ScatterStaged(key=key, staged=staged):
                    self._spawn(self._scatter, key, staged)
        # a ctx write may land, and its notification come, in any session held (a quarantined
        # one too); without NIXL's progress thread draining also progresses a receiving write
        self._pump.want_notices(bool(self.protocol.gen.receivers))
        if not self._ticking and self.protocol.busy():
            self._ticking = True
            self._busy.set()
        if woken:
            self.wake()

    def _trace(self, key: int, stage: str) -> None:
        if self.tracer is not None:
            self.tracer(key, stage, self.clock())

    def _spawn(self, fn: Callable[..., object], *args: object) -> None:
        assert self._nursery is not None, "the transceiver is not running"
        self._nursery.start_soon(fn, *args)  # type: ignore[arg-type]

    def _post(self, order: ev.WriteOrder, notice: bytes) -> None:
        remote = self._remotes.get(order.peer)
        if remote is None:
            error = f"gen rank {order.peer[0]}#{order.peer[1]} is gone"
            self._feed(ev.WriteEnded(write_id=order.write_id, error=error))
        elif order.staged is not None:
            self._spawn(self._stage_and_post, order, remote, notice)
        else:
            self._fly(order, remote, notice)

    async def _stage_and_post(self, order: ev.WriteOrder, remote: str, notice: bytes) -> None:
        """Pack this rank's share into staging room, then write it in one go."""
        assert self.staging is not None
        try:
            offset, order = await self.staging.stage(order, self._pump.in_thread)
        except TransferLayerError as exc:
            self._feed(ev.WriteEnded(write_id=order.write_id, error=str(exc)))
            return
        self._fly(order, remote, notice, staging_offset=offset)

    def _fly(self, order: ev.WriteOrder, remote: str, notice: bytes,
             staging_offset: int | None = None) -> None:  # fmt: skip
        self._flights[order.write_id] = _Flight(order=order, remote=remote, posted=self.clock(),
                                                staging_offset=staging_offset)  # fmt: skip
        quick = staging_offset is None and self.agent.submit_is_quick(order.fragments, remote)
        submit = functools.partial(
            self.agent.submit, order.fragments, remote, notice,
            dst_memory_type=order.dst_memory_type, dst_device_id=order.dst_device_id,
        )  # fmt: skip
        self._pump.post(order.write_id, submit, quick=quick)

    def _delivered(self, posted: Posted, notifications: Notifications, ended: Ended) -> None:
        """What the pump did (a quick post: at once) and found, on the Trio thread."""
        if self._nursery is None:
            return  # the service has ended
        for write_id, error in posted:
            if error is None:
                self._trace(self._flights[write_id].order.key, "posted")
            else:
                self._land(write_id)
                self._feed(ev.WriteEnded(write_id=write_id, error=error))
        for write_id, state in ended:
            flight = self._land(write_id)
            error = None if state is XferStatus.DONE else "the agent reported an error writing it"
            if error is None:
                self._trace(flight.order.key, "done")
                fragments, seconds = flight.order.fragments, self.clock() - flight.posted
                peer = "{}#{}".format(*flight.order.peer)
                (self.on_write or self.tally.count)(
                    fragments.num_bytes, len(fragments), seconds, peer
                )
            self._feed(ev.WriteEnded(write_id=write_id, error=error))
        for remote, payload in notifications:
            try:
                notice = wire.decode(payload)
            except ProtocolError:
                continue  # not a notification of this protocol's
            if isinstance(notice, wire.WriteNotice):
                self._trace(notice.key, "notice")
                self._feed(ev.NoticeIn(notice=notice, remote=remote))

    def _land(self, write_id: int) -> _Flight:
        flight = self._flights.pop(write_id)
        if flight.staging_offset is not None and self.staging is not None:
            self.staging.release(flight.staging_offset)
        self._landed.unpark_all()
        return flight

    async def _load_agent(self, info: RankInfo, identity: bytes) -> None:
        error = None
        if info.key not in self._remotes:
            try:
                add = functools.partial(self.agent.add_remote, info.agent_metadata)
                self._remotes[info.key] = await self._pump.in_thread(add)
            except TransferLayerError as exc:
                error = str(exc)
        self._feed(ev.AgentLoaded(info=info, reply_to=identity, error=error))

    def _forget(self, instance: str | None, endpoints: Sequence[str]) -> None:
        for endpoint in endpoints:
            self._control.drop(endpoint)
        names = [self._remotes.pop(k) for k in list(self._remotes) if k[0] == instance]
        if names:
            self._spawn(self._unload, names)

    async def _unload(self, names: Sequence[str]) -> None:
        """Unload a gone peer's agents once no write to them is in flight: a loaded agent of a
        peer on this node maps that peer's whole KV pool on its GPU."""
        with trio.move_on_after(2 * self.timeout_s):
            while any(f.remote in names for f in self._flights.values()):
                await self._landed.park()
        for name in names:
            if any(f.remote == name for f in self._flights.values()):
                log.warning("agent %s stays loaded: a write to it never ended", name)
                continue
            try:
                await self._pump.in_thread(functools.partial(self.agent.remove_remote, name))
            except TransferLayerError as exc:
                log.warning("could not unload agent %s: %s", name, exc)

    async def _reserve(self, key: int, num_bytes: int, deadline: float) -> None:
        assert self.staging is not None
        offset, error = None, ""
        try:
            offset = await self.staging.reserve(num_bytes, deadline)
        except TransferLayerError as exc:
            error = str(exc)
        self._feed(ev.StagingReserved(key=key, offset=offset, error=error))

    async def _scatter(self, key: int, staged: ev.Staged) -> None:
        """Copy a bounced receive into its blocks (which stay held until it is reported)."""
        assert self.staging is not None
        error = await self.staging.scatter(staged)
        self._feed(ev.Scattered(key=key, error=error))
