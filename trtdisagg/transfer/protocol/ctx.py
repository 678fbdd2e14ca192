"""The ctx (sender) side of the transfer protocol: push KV to the gen ranks that ask. Pure.

docs/LIFECYCLE.md tells the path (ctx side, generation-first, cancellation, who may touch a
transfer). A REQUEST_DATA that comes before its session waits in EarlyMessages until the KV is
ready. Every CANCEL is answered, at once or by the write in flight to its sender.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

from trtdisagg.transfer.errors import PeerIncompatible, TransferLayerError
from trtdisagg.transfer.protocol import events as ev
from trtdisagg.transfer.protocol import wire
from trtdisagg.transfer.protocol.bounce import skipped_tokens, staged_fragments, staged_runs
from trtdisagg.transfer.protocol.peers import SendPlan, direct_fragments
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.sessions import (
    EarlyMessages,
    SenderSession,
    Sessions,
    SourceBlocks,
    Status,
)
from trtdisagg.transfer.protocol.side import Out, Side

log = logging.getLogger(__name__)


@attrs.define(eq=False, kw_only=True)
class CtxProtocol(Side):
    max_per_peer: int = 1024  # sessions and held messages of one gen instance
    senders: Sessions[SenderSession] = attrs.Factory(Sessions)
    early: EarlyMessages = attrs.field(init=False)
    _writes: dict[int, tuple[SenderSession, ev.WriteOrder]] = attrs.Factory(dict)  # in flight
    _next_write: int = 1
    # key -> until: sends cancelled here (the coordinator released the KV: no gen leg takes
    # it). A gen that asks for one later is refused at once, not held for a session that will
    # not come (keys are random per attempt: none comes back).
    _released: dict[int, float] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        # A REQUEST_DATA whose session never appears is refused after the transfer timeout.
        self.early = EarlyMessages(ttl=self.timeout_s)

    def ready(self, key: int, source: SourceBlocks, first_tokens: tuple[int, ...], now: float,
              out: Out) -> None:  # fmt: skip
        if key in self.senders:
            raise ValueError(f"a session for key {key} already exists")
        session = SenderSession(key=key, deadline=now + self.timeout_s, first_tokens=first_tokens)
        session.set_source(source)
        self.senders[key], self._started[key] = session, now
        requests, canceller = self.early.take(key)
        for request in requests:
            self._accept(session, request)
        if canceller is not None and session.peer_instance in (None, canceller):
            session.cancel()
        self._start_writes(session, out)
        self._settle(session, now, out)

    def abandon(self, key: int, reason: str, out: Out) -> None:
        """The request ended before its KV was ready: refuse what waits for it now. One that
        asks later waits as before (the key may come back with a retried request)."""
        if key in self.senders:
            return  # responded: the session's own cancel and deadline apply
        for request in self.early.take(key)[0]:
            self._refuse(request, f"the ctx request ended before its KV was ready: {reason}", out)

    def cancel(self, key: int, now: float, out: Out) -> bool | None:
        """Stop `key`'s send; whether no write may still read its blocks (None: no session)."""
        if (sender := self.senders.get(key)) is None:
            return None
        quiescent = sender.cancel()
        self._released[key] = now + self.timeout_s
        self._cancel(key, sender.peer_instance or "", sender.requests, out)
        self._settle(sender, now, out)
        return quiescent

    def on_register(self, info: RankInfo, reply_to: bytes, out: Out) -> None:
        try:
            self.registrar.register(info)
        except PeerIncompatible as exc:
            self.on_agent_loaded(info, reply_to, str(exc), out)
            return
        out.append(ev.LoadAgent(info=info, reply_to=reply_to))

    def on_agent_loaded(self, info: RankInfo, reply_to: bytes, error: str | None, out: Out) -> bool:
        if error is not None:
            log.warning("refused gen rank %s: %s", info.label, error)
        ack = wire.RegisterAck(accepted=error is None, reason=error or "", **self._me)
        out.append(ev.Reply(reply_to=reply_to, message=ack))
        return error is None

    def on_request(self, request: wire.RequestData, reply_to: bytes | None, now: float,
                   out: Out) -> None:  # fmt: skip
        name, rank, key = request.instance_name, request.instance_rank, request.key
        if self.registrar.get((name, rank)) is None:
            # Never registered, or forgotten as gone while alive: gen meets us again.
            self.refusals.warn(name, now, "REQUEST_DATA %d from unregistered gen rank %s#%d",
                               key, name, rank)  # fmt: skip
            if reply_to is not None:
                again = f"gen rank {name}#{rank} registers again at its next try"
                error = f"{wire.NOT_REGISTERED}: {again}"
                message = self._message(key, wire.ResultStatus.ERROR, error=error)
                out.append(ev.Reply(reply_to=reply_to, message=message))
        elif self.early.take_overtaken(request):
            log.info("REQUEST_DATA %d came after its CANCEL: dropped", key)
        elif (session := self.senders.lookup(name, key)) is not None:
            if session.peer_instance is None and self._over_limit(request, now, out):
                return
            self._accept(session, request)
            self._start_writes(session, out)
        elif key in self.senders:
            self.refusals.not_owner("REQUEST_DATA", key, name, now)
        elif key in self._released:
            error = f"ctx released the KV of transfer {key}: no gen leg takes it"
            self._refuse(request, error, out)
        elif not self._over_limit(request, now, out):
            self.early.add_request(now, request)

    def _over_limit(self, request: wire.RequestData, now: float, out: Out) -> bool:
        """Whether `request`'s gen instance holds `max_per_peer` sessions and messages here
        already; it is then refused at once."""
        if len(self.senders) + self.early.size < self.max_per_peer:
            return False  # (nobody can be over it: no count per instance needed)
        name = request.instance_name
        held = sum(s.peer_instance == name for s in self.senders.values())
        held += self.early.held_by(name)
        if held < self.max_per_peer:
            return False
        limit = f"cache_transceiver_config.max_sessions_per_peer {self.max_per_peer}"
        error = f"gen instance {name} holds {held} transfers with this ctx rank (limit: {limit})"
        self.refusals.refuse("over_limit", name, now, "REQUEST_DATA %d refused: %s",
                             request.key, error)  # fmt: skip
        self._refuse(request, error, out)
        return True

    def on_cancel(self, cancel: wire.Cancel, now: float, out: Out) -> bool:
        """A gen rank's CANCEL for a session of ours; False: we have none for it."""
        if (sender := self.senders.lookup(cancel.instance_name, cancel.key)) is None:
            return False
        rank = cancel.instance_rank
        if rank not in sender.heard:  # it overtook that rank's request, dropped when it comes
            self.early.add_overtaken(now, cancel.instance_name, rank, cancel.key)
        sender.cancel()
        if rank not in sender.in_flight:  # else the write's result answers it
            self._ack_cancel(cancel, out)
        self._settle(sender, now, out)
        out.append(ev.WAKE)
        return True

    def on_stray_cancel(self, cancel: wire.Cancel, now: float, out: Out) -> None:
        """A CANCEL that found no session, ours or gen's: answer it, and hold it for a session
        made later, which starts cancelled."""
        name, rank, key = cancel.instance_name, cancel.instance_rank, cancel.key
        if self.early.held_by(name) >= self.max_per_peer:
            self._ack_cancel(cancel, out)  # answered, not remembered: the peer holds enough
            return
        # The answer is that rank's one answer to its request: drop what we hold of it (else a
        # sweep answers it again, maybe to a later use of the key); if we hold nothing, the
        # CANCEL overtook the request, which is dropped when it comes.
        if not self.early.drop_requests_of(name, rank, key):
            self.early.add_overtaken(now, name, rank, key)
        self.early.add_cancel(now, key, name)
        self._ack_cancel(cancel, out)

    def on_write_ended(self, write_id: int, error: str | None, now: float, out: Out) -> None:
        if (write := self._writes.pop(write_id, None)) is None:
            return
        session, order = write
        if error is not None:
            log.warning("KV write %d to %s failed: %s", session.key, order.peer, error)
        self.bounced += order.staged is not None and error is None
        self._write_done(session, order.peer[1], error, out, order)
        self._settle(session, now, out)

    def tick(self, now: float, out: Out) -> None:
        for session in list(self.senders.values()):
            session.expire(now, self.timeout_s)
            self._settle(session, now, out)
        self._released = {k: until for k, until in self._released.items() if now < until}
        for stale in self.early.sweep(now):
            why = "never prefilled here, or already released"
            self._refuse(stale, f"ctx has no request with transfer key {stale.key} ({why})", out)

    def forget(self, instance: str, dead: str | None, now: float, out: Out) -> None:
        """Forget the gen instance `instance` (gone; `dead`: why, when its process ended: what
        is bound to it fails now)."""
        for session in list(self.senders.values()):
            if dead is not None and session.peer_instance == instance:
                session.fail(f"peer instance {instance} is gone: {dead}")
                self._settle(session, now, out)

    def _accept(self, session: SenderSession, request: wire.RequestData) -> None:
        if (peer := self.registrar.get(request.sender)) is None:
            return
        if session.expected is None:
            overlap = self.registrar.overlap(peer, peer_dp_rank=peer.dp_rank)
            session.bind(request.instance_name, frozenset(overlap))
        session.add_request(request)

    def _start_writes(self, session: SenderSession, out: Out) -> None:
        for request in session.take_writes():
            rank = request.instance_rank
            try:
                order = self._order(session, request)
            except (TransferLayerError, ValueError) as exc:
                self._write_done(session, rank, f"{type(exc).__name__}: {exc}", out)
                continue
            if order is None:  # nothing of this rank's share to write
                self._write_done(session, rank, None, out)
                continue
            self._writes[order.write_id] = (session, order)
            fragments = order.fragments
            notice = wire.WriteNotice(key=order.key, num_bytes=fragments.num_bytes,
                                      num_descriptors=len(fragments),
                                      first_tokens=session.first_tokens, **self._me)  # fmt: skip
            out.append(ev.PostWrite(order=order, notice=wire.encode(notice)))

    def _order(self, session: SenderSession, request: wire.RequestData) -> ev.WriteOrder | None:
        """The write of `session`'s KV into `request`'s blocks (None: this rank has nothing to
        write there). TransferLayerError or ValueError: the request does not fit."""
        peer, source = request.sender, session.source
        assert source is not None
        try:
            plan = self.registrar.send_plan(peer)
        except KeyError:
            raise TransferLayerError(f"gen rank {peer[0]}#{peer[1]} is gone") from None
        staged = None
        if not request.staging_bytes:
            fragments = direct_fragments(plan, source, request)
        elif (staged := self._staged(request, plan, source)) is not None:
            # sources as offsets into the staging room, reserved later
            fragments = staged_fragments(staged.runs, src_address=0,
                                         dst_address=request.staging_address)  # fmt: skip
        else:
            return None
        if not len(fragments):
            return None
        pool = plan.peer.page_table.layer_groups[0].pool
        write_id, self._next_write = self._next_write, self._next_write + 1
        return ev.WriteOrder(
            write_id=write_id, key=session.key, peer=peer, fragments=fragments, staged=staged,
            dst_memory_type=pool.memory_type, dst_device_id=pool.device_id,
            deadline=session.deadline,
        )  # fmt: skip

    def _staged(self, request: wire.RequestData, plan: SendPlan,
                source: SourceBlocks) -> ev.Staged | None:  # fmt: skip
        """Bounce: the runs this rank owns of gen's canonical region (bounce.py)."""
        if not plan.elected:
            return None
        if len(request.block_ids) != 1 or len(source.block_ids) != 1:
            raise TransferLayerError("the bounce path moves one layer group")
        num_tokens = min(request.num_tokens, source.num_tokens)
        num_blocks = len(wire.unpack_block_ids(request.block_ids[0]))
        first = skipped_tokens(num_tokens, num_blocks, self.local.tokens_per_block)
        if not (runs := staged_runs(self.local, plan.peer, num_tokens=num_tokens - first)):
            return None
        if (needed := max(run.dst_offset + run.num_bytes for run in runs)) > request.staging_bytes:
            raise TransferLayerError(
                f"gen's staging region of {request.staging_bytes} bytes cannot hold {needed}"
            )
        num_bytes = sum(run.num_bytes for run in runs)
        return ev.Staged(runs=runs, block_ids=source.block_ids[0], first_token=first,
                             num_tokens=num_tokens, num_bytes=num_bytes)  # fmt: skip

    def _write_done(self, session: SenderSession, rank: int, error: str | None, out: Out,
                    order: ev.WriteOrder | None = None) -> None:  # fmt: skip
        moved = (order.fragments.num_bytes, len(order.fragments)) if order else (0, 0)
        status = wire.ResultStatus.OK if error is None else wire.ResultStatus.ERROR
        if session.cancelled and status is wire.ResultStatus.OK and not moved[0]:
            status = wire.ResultStatus.CANCELLED
        session.write_finished(rank, status, error or "")
        tokens = session.first_tokens if status is wire.ResultStatus.OK else ()
        result = self._message(session.key, status, error=error or "", num_bytes=moved[0],
                               num_descriptors=moved[1], first_tokens=tokens)  # fmt: skip
        self._send((session.peer_instance or "", rank), result, out)
        out.append(ev.WAKE)

    def _settle(self, session: SenderSession, now: float, out: Out) -> None:
        """A session over (terminal and quiescent) leaves; its outcome goes to the executor."""
        over = session.is_terminal and session.is_quiescent
        if not over or self.senders.get(session.key) is not session:
            return
        del self.senders[session.key]
        ok, cancelled = session.status is Status.TRANSFERRED, session.status is Status.CANCELLED
        outcome = self._outcome(session.key, now, ok=ok, cancelled=cancelled, error=session.error)
        out += [ev.Sent(outcome=outcome), ev.WAKE]

    def _message(self, key: int, status: wire.ResultStatus, **fields: Any) -> wire.TransferResult:
        return wire.TransferResult(key=key, status=status, **self._me, **fields)

    def _refuse(self, request: wire.RequestData, error: str, out: Out) -> None:
        message = self._message(request.key, wire.ResultStatus.ERROR, error=error)
        self._send(request.sender, message, out)

    def _ack_cancel(self, cancel: wire.Cancel, out: Out) -> None:
        error = "cancelled; no write in flight"
        message = self._message(cancel.key, wire.ResultStatus.CANCELLED, error=error)
        self._send(cancel.sender, message, out)
