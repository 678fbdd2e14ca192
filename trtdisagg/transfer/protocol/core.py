"""TransferProtocol: one rank's whole transfer protocol as a pure state machine.

The driver (runtime/driver.py) feeds every event (events.py) to `handle(event, now)` and carries
out the effects it returns, in order; nothing here does I/O or reads a clock. Events go to the
ctx side (ctx.py: KV we send), the gen side (gen.py: KV we receive) and the peers' liveness
(liveness.py, docs/LIFECYCLE.md "Peers that are gone").

On a secured control plane a ROUTER message names the rank its connection proved
(`MessageIn.peer`); one whose own fields name another rank is dropped and counted (side.py).
On a DEALER the peer is whoever answers at the endpoint we dialled; unsecured (loopback only),
the message's word is taken.
"""

from __future__ import annotations

import logging

import attrs

from trtdisagg.transfer.errors import TransferLayerError
from trtdisagg.transfer.protocol import events as ev
from trtdisagg.transfer.protocol import wire
from trtdisagg.transfer.protocol.ctx import CtxProtocol
from trtdisagg.transfer.protocol.gen import GenProtocol, StagingInfo
from trtdisagg.transfer.protocol.liveness import Gone, PeerLiveness
from trtdisagg.transfer.protocol.peers import PeerRegistrar
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.side import Out, Refusals

log = logging.getLogger(__name__)


@attrs.define(eq=False, kw_only=True)
class TransferProtocol:
    local: RankInfo
    instance: tuple[RankInfo, ...]  # every rank of this instance; rank 0 answers INSTANCE_INFO
    timeout_s: float
    liveness: PeerLiveness = attrs.Factory(PeerLiveness)
    early_failures: bool = True
    staging: StagingInfo | None = None
    max_sessions_per_peer: int = 1024
    refusals: Refusals = attrs.Factory(Refusals)
    registrar: PeerRegistrar = attrs.field(init=False)
    ctx: CtxProtocol = attrs.field(init=False)
    gen: GenProtocol = attrs.field(init=False)
    forgotten: int = 0  # peer instances forgotten as gone (since start)
    dead: int = 0  # ... of which had ended
    probes: int = 0  # probes sent (since start)

    def __attrs_post_init__(self) -> None:
        # one registrar: an instance name is fresh per start, so ctx and gen peers never collide
        local, timeout_s, refusals = self.local, self.timeout_s, self.refusals
        registrar = self.registrar = PeerRegistrar(local)
        self.ctx = CtxProtocol(
            local=local, timeout_s=timeout_s, registrar=registrar, refusals=refusals,
            max_per_peer=self.max_sessions_per_peer,
        )  # fmt: skip
        self.gen = GenProtocol(
            local=local, timeout_s=timeout_s, registrar=registrar, refusals=refusals,
            early_failures=self.early_failures, staging=self.staging,
        )  # fmt: skip

    @property
    def tick_period(self) -> float:
        """How often the peers' liveness wants a look (Tick)."""
        return min(self.liveness.idle_s, self.liveness.answer_s, self.liveness.relink_s) / 4

    def busy(self) -> bool:
        """Whether a transfer, or something held for one, has a deadline to watch."""
        return bool(self.ctx.senders or self.ctx.early or self.gen.busy())

    def cancel(self, key: int, now: float) -> tuple[bool, Out]:
        """`cancel_request`: whether no write may still land in (or read from) `key`'s blocks."""
        out: Out = []
        quiescent = self.ctx.cancel(key, now, out)
        return self.gen.cancel(key, now, out) if quiescent is None else quiescent, out

    def handle(self, event: ev.Event, now: float) -> Out:
        out: Out = []
        ctx, gen = self.ctx, self.gen
        match event:
            case ev.MessageIn(message=message, source=source, peer=peer):
                try:
                    self._message(event, now, out)
                except TransferLayerError as exc:  # peer input never takes the protocol down
                    who = peer[0] if peer else source or getattr(message, "instance_name", "?")
                    self.refusals.warn(who, now, "dropped %s: %s", type(message).__name__, exc)
            case ev.NoticeIn(notice=notice, remote=remote):
                self.liveness.heard(notice.instance_name, now)
                gen.on_notice(notice, remote, now, out)
            case ev.WriteEnded(write_id=write_id, error=error):
                ctx.on_write_ended(write_id, error, now, out)
            case ev.KvReady(key=key, source=source, first_tokens=tokens):
                ctx.ready(key, source, tokens, now, out)
            case ev.SendAbandoned(key=key, reason=reason):
                ctx.abandon(key, reason, out)
            case ev.ReceiveAsked():
                gen.ask(event, now, out)
            case ev.AgentLoaded(info=info, reply_to=reply_to, error=error):
                if ctx.on_agent_loaded(info, reply_to, error, out):
                    self._track(info, now)
            case ev.StagingReserved(key=key, offset=offset, error=error):
                gen.on_staging(key, offset, error, now, out)
            case ev.Scattered(key=key, error=error):
                gen.on_scattered(key, error, out)
            case ev.LinkChanged(endpoint=endpoint, up=up):
                self.liveness.link(endpoint, up, now)
            case ev.Tick():
                self.refusals.flush(now)
                ctx.tick(now, out)
                gen.tick(now, out)
                for gone in self.liveness.gone(now):
                    out += self.forget(gone, now)
                for _, endpoint in self.liveness.to_probe(now):
                    self.probes += 1
                    probe = wire.RequestInstanceInfo(protocol_version=wire.PROTOCOL_VERSION)
                    out.append(ev.Send(endpoint=endpoint, message=probe))
        return out

    def forget(self, gone: Gone, now: float) -> Out:
        """Forget a peer instance that is gone, on both sides, and unload its agents."""
        out: Out = []
        self.liveness.forget(gone.instance)
        self.forgotten += 1
        self.dead += gone.dead
        log.warning("peer instance %s is gone (%s)", gone.instance, gone.reason)
        dead = gone.reason if gone.dead else None
        self.ctx.forget(gone.instance, dead, now, out)
        ranks = self.gen.forget(gone.instance, dead, now, out)
        ranks += self.registrar.forget(gone.instance)  # last: what the sides send goes to its ranks
        # (not an endpoint that a rendezvous with a new instance there now uses)
        endpoints = sorted({info.control_endpoint for info in ranks} - self.gen.meeting())
        return [*out, ev.ForgetPeer(instance=gone.instance, endpoints=tuple(endpoints)), ev.WAKE]

    def _message(self, event: ev.MessageIn, now: float, out: Out) -> None:
        message, reply_to, source, peer = event.message, event.reply_to, event.source, event.peer
        claimed = wire.sender_of(message)
        if peer is not None and claimed is not None and claimed != peer:
            self.refusals.refuse("impersonation", peer[0], now,
                                 "dropped %s from %s#%d: it names %s#%d as its sender",
                                 type(message).__name__, *peer, *claimed)  # fmt: skip
            return
        if (sender := peer or claimed) is not None:
            self.liveness.heard(sender[0], now)
        match message:
            case wire.RequestInstanceInfo():
                if reply_to is not None and self.local.instance_rank == 0:
                    info = wire.InstanceInfo(protocol_version=wire.PROTOCOL_VERSION,
                                             ranks=self.instance)  # fmt: skip
                    out.append(ev.Reply(reply_to=reply_to, message=info))
            case wire.RegisterPeer(info=info):
                if reply_to is not None:
                    self.ctx.on_register(info, reply_to, out)
            case wire.InstanceInfo(ranks=ranks):
                if ranks and source:  # also a probe's answer: who is at that endpoint now
                    self.liveness.answered(source, ranks[0].instance_name, now)
                self.gen.on_instance_info(message, source, now, out)
            case wire.RegisterAck():
                if (met := self.gen.on_ack(message, source, now, out)) is not None:
                    for rank in met.ranks:
                        self._track(rank, now)
            case wire.RequestData():
                self.ctx.on_request(message, reply_to, now, out)
            case wire.TransferResult():
                self.gen.on_result(message, source, now, out)
            case wire.Cancel():  # ours to send, or to receive, or held for a session to come
                if self.ctx.on_cancel(message, now, out) or self.gen.on_cancel(message, now, out):
                    pass
                elif message.key in self.ctx.senders:
                    self.refusals.not_owner("CANCEL", message.key, message.instance_name, now)
                else:
                    self.ctx.on_stray_cancel(message, now, out)
            case _:
                pass  # WRITE_NOTICE is only valid as an agent notification

    def _track(self, peer: RankInfo, now: float) -> None:
        rank0 = peer.instance_rank == 0
        self.liveness.track(peer.instance_name, peer.control_endpoint, now, rank0=rank0)
