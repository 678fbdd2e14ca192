"""TransferProtocol: one rank's whole transfer protocol as a pure state machine.

    effects = protocol.handle(event, now)

The driver (runtime/driver.py) feeds every event in (events.py) and carries out the effects it
gets back, in order; nothing here does I/O or reads a clock. The protocol routes each event to
the ctx side (ctx.py: sessions of KV we send), the gen side (gen.py: sessions of KV we receive)
and the peers' liveness (liveness.py), and answers what concerns the instance as a whole
(REQUEST_INSTANCE_INFO: every rank's RankInfo, from rank 0).

Peers that are gone: any message from a peer instance counts as a sign of life; one that goes
silent is probed (REQUEST_INSTANCE_INFO to its rank 0), and one that is gone (probes
unanswered, another instance at its endpoint, or a control connection that dropped and stayed
down) is forgotten by both sides (ForgetPeer: its dealers closed, its agents unloaded). One
whose process ended (`Gone.dead`) also fails at once what waits on it.
"""

from __future__ import annotations

import logging

import attrs

from trtdisagg.transfer.errors import TransferLayerError
from trtdisagg.transfer.protocol.ctx import CtxProtocol
from trtdisagg.transfer.protocol.events import (
    WAKE,
    AgentLoaded,
    Effect,
    Event,
    ForgetPeer,
    KvExpected,
    KvReady,
    LinkChanged,
    MessageIn,
    NoticeIn,
    ReceiveAsked,
    Reply,
    Scattered,
    Send,
    SendAbandoned,
    StagingReserved,
    Tick,
    TransferCancelled,
    WriteEnded,
)
from trtdisagg.transfer.protocol.gen import GenProtocol, StagingInfo
from trtdisagg.transfer.protocol.liveness import Gone, PeerLiveness
from trtdisagg.transfer.protocol.peers import PeerRegistrar
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.wire import (
    PROTOCOL_VERSION,
    Cancel,
    InstanceInfo,
    Message,
    RegisterAck,
    RegisterPeer,
    RequestData,
    RequestInstanceInfo,
    TransferResult,
)

log = logging.getLogger(__name__)

Out = list[Effect]


@attrs.define(eq=False, kw_only=True)
class TransferProtocol:
    local: RankInfo
    instance: tuple[RankInfo, ...]  # every rank of this instance; rank 0 answers INSTANCE_INFO
    timeout_s: float
    liveness: PeerLiveness = attrs.Factory(PeerLiveness)
    early_failures: bool = True
    staging: StagingInfo | None = None
    ctx: CtxProtocol = attrs.field(init=False)
    gen: GenProtocol = attrs.field(init=False)
    forgotten: int = 0  # peer instances forgotten as gone (since start)
    dead: int = 0  # ... of which had ended
    probes: int = 0  # probes sent (since start)

    def __attrs_post_init__(self) -> None:
        self.ctx = CtxProtocol(
            local=self.local, timeout_s=self.timeout_s, registrar=PeerRegistrar(self.local)
        )
        self.gen = GenProtocol(
            local=self.local,
            timeout_s=self.timeout_s,
            registrar=PeerRegistrar(self.local),
            early_failures=self.early_failures,
            staging=self.staging,
        )

    @property
    def tick_period(self) -> float:
        """How often the liveness of peers wants a look (Tick)."""
        watch = self.liveness
        return min(watch.idle_s, watch.answer_s, watch.relink_s) / 4

    def busy(self) -> bool:
        """Whether a transfer, or something held for one, has a deadline to watch."""
        ctx = self.ctx
        return bool(len(ctx.senders) or len(ctx.early) or ctx.prepared or self.gen.busy())

    def cancel(self, key: int, now: float) -> tuple[bool, Out]:
        """`cancel_request`: whether no write may still land in (or read from) `key`'s blocks."""
        out: Out = []
        quiescent = self.ctx.cancel(key, now, out)
        if quiescent is None:
            quiescent = self.gen.cancel(key, now, out)
        return quiescent, out

    def handle(self, event: Event, now: float) -> Out:
        out: Out = []
        match event:
            case MessageIn(message=message, reply_to=reply_to, source=source):
                try:
                    self._message(message, reply_to, source, now, out)
                except TransferLayerError as exc:  # never raises on peer input
                    log.warning("dropped %s: %s", type(message).__name__, exc)
            case NoticeIn(notice=notice):
                self.liveness.heard(notice.instance_name, now)
                self.gen.on_notice(notice, now, out)
            case WriteEnded(write_id=write_id, error=error):
                self.ctx.on_write_ended(write_id, error, now, out)
            case KvReady(key=key, source=source, first_tokens=tokens):
                self.ctx.ready(key, source, tokens, now, out)
            case KvExpected(key=key, source=source):
                self.ctx.expect(key, source, now, out)
            case SendAbandoned(key=key, reason=reason):
                self.ctx.abandon(key, reason, out)
            case ReceiveAsked():
                self.gen.ask(event, now, out)
            case TransferCancelled(key=key):
                out = self.cancel(key, now)[1]
            case AgentLoaded(info=info, reply_to=reply_to, error=error):
                if self.ctx.on_agent_loaded(info, reply_to, error, out):
                    if info.instance_rank == 0:
                        self.liveness.track(info.instance_name, info.control_endpoint, now)
                    self.liveness.track_link(info.instance_name, info.control_endpoint)
            case StagingReserved(key=key, offset=offset, error=error):
                self.gen.on_staging(key, offset, error, now, out)
            case Scattered(key=key, error=error):
                self.gen.on_scattered(key, error, out)
            case LinkChanged(endpoint=endpoint, up=up):
                self.liveness.link(endpoint, up, now)
            case Tick():
                self._tick(now, out)
        return out

    def _message(
        self, message: Message, reply_to: bytes | None, source: str, now: float, out: Out
    ) -> None:
        sender = getattr(message, "instance_name", None)
        if isinstance(sender, str):
            self.liveness.heard(sender, now)
        match message:
            case RequestInstanceInfo():
                if reply_to is not None and self.local.instance_rank == 0:
                    info = InstanceInfo(protocol_version=PROTOCOL_VERSION, ranks=self.instance)
                    out.append(Reply(reply_to=reply_to, message=info))
            case RegisterPeer(info=info):
                if reply_to is not None:
                    self.ctx.on_register(info, reply_to, out)
            case InstanceInfo(ranks=ranks):
                if ranks and source:  # also a probe's answer: who is at that endpoint now
                    self.liveness.answered(source, ranks[0].instance_name, now)
                self.gen.on_instance_info(message, source, now, out)
            case RegisterAck():
                met = self.gen.on_ack(message, source, now, out)
                if met is not None:
                    rank0 = min(met.ranks, key=lambda rank: rank.instance_rank)
                    self.liveness.track(rank0.instance_name, rank0.control_endpoint, now)
                    for rank in met.ranks:
                        self.liveness.track_link(rank.instance_name, rank.control_endpoint)
            case RequestData():
                self.ctx.on_request(message, reply_to, now, out)
            case TransferResult():
                self.gen.on_result(message, source, now, out)
            case Cancel():
                # ours to send, or to receive, or held for a session to come
                handled = self.ctx.on_cancel(message, now, out)
                if not handled and not self.gen.on_cancel(message, now, out):
                    self.ctx.on_stray_cancel(message, now, out)
            case _:
                pass  # WRITE_NOTICE is only valid as an agent notification

    def forget(self, gone: Gone, now: float) -> Out:
        """Forget a peer instance that is gone (both sides), and unload its agents."""
        out: Out = []
        self.liveness.forget(gone.instance)
        self.forgotten += 1
        self.dead += gone.dead
        log.warning("peer instance %s is gone (%s)", gone.instance, gone.reason)
        dead = gone.reason if gone.dead else None
        ranks = [
            *self.ctx.forget(gone.instance, dead, now, out),
            *self.gen.forget(gone.instance, dead, now, out),
        ]
        endpoints = tuple(sorted({info.control_endpoint for info in ranks}))
        out += [ForgetPeer(instance=gone.instance, endpoints=endpoints), WAKE]
        return out

    def _tick(self, now: float, out: Out) -> None:
        self.ctx.tick(now, out)
        self.gen.tick(now, out)
        for gone in self.liveness.gone(now):
            out += self.forget(gone, now)
        for _instance, endpoint in self.liveness.to_probe(now):
            self.probes += 1
            message = RequestInstanceInfo(protocol_version=PROTOCOL_VERSION)
            out.append(Send(endpoint=endpoint, message=message))
