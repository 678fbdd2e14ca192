"""The gen (receiver) side of the transfer protocol: ask ctx for KV, see it land. Pure.

docs/LIFECYCLE.md tells the path (gen side, cancellation, who may touch a transfer). The first
request to a ctx info endpoint meets the instance there (REQUEST_INSTANCE_INFO, the compatibility
gate on every rank, REGISTER_PEER to each, their REGISTER_ACKs), kept per endpoint until that
instance is replaced or forgotten; one that gets no answer is forgotten and the next request
tries again.
"""

from __future__ import annotations

import logging

import attrs

from trtdisagg.transfer.errors import PeerIncompatible
from trtdisagg.transfer.protocol import events as ev
from trtdisagg.transfer.protocol import wire
from trtdisagg.transfer.protocol.bounce import canonical_bytes, skipped_tokens
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.sessions import (
    ReceiverSession,
    Sessions,
    Status,
    TransferOutcome,
)
from trtdisagg.transfer.protocol.side import Out, Side

log = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 5.0  # a ctx instance's time to answer, within the transfer's own deadline


@attrs.frozen(kw_only=True)
class StagingInfo:  # this rank's staging buffer, as REQUEST_DATA names its room
    address: int
    capacity: int


@attrs.define(eq=False, kw_only=True)
class _CtxInstance:  # what gen knows of the ctx instance at one info endpoint
    endpoint: str
    deadline: float  # of the rendezvous under way
    instance_name: str | None = None  # the instance that answered, refused or not
    ranks: tuple[RankInfo, ...] = ()
    unacked: set[int] = attrs.Factory(set)  # ranks whose REGISTER_ACK is still to come
    refusal: str | None = None

    @property
    def met(self) -> bool:  # every rank acknowledged us
        return bool(self.ranks) and not self.unacked and self.refusal is None

    @property
    def settled(self) -> bool:  # met or refused: no rendezvous under way
        return self.met or self.refusal is not None


@attrs.define(eq=False, kw_only=True)
class _Starting:  # a receive with no session yet: its rendezvous or staging room is under way
    ask: ev.ReceiveAsked
    deadline: float
    cancelled: bool = False
    peers: tuple[RankInfo, ...] = ()  # the ctx ranks to ask (registrar overlap); () until met
    staged: ev.Staged | None = None


@attrs.define(eq=False, kw_only=True)
class GenProtocol(Side):
    early_failures: bool = True
    staging: StagingInfo | None = None
    receivers: Sessions[ReceiverSession] = attrs.Factory(Sessions)
    rendezvous: int = 0  # rendezvous started (since start)
    quarantine_expired: int = 0  # quarantines ended by the second timeout, not by ctx
    _instances: dict[str, _CtxInstance] = attrs.Factory(dict)  # by info endpoint
    _starting: dict[int, _Starting] = attrs.Factory(dict)
    _staged: dict[int, ev.Staged] = attrs.Factory(dict)
    _scattering: dict[int, TransferOutcome] = attrs.Factory(dict)  # reported once copied
    # (ctx instance, ctx rank, key) -> when: a session of `key` ended before that rank's
    # TRANSFER_RESULT came. That result, when it comes, is the ended session's.
    _results_due: dict[tuple[str, int, int], float] = attrs.Factory(dict)

    def meeting(self) -> set[str]:
        """The endpoints of the rendezvous under way."""
        return {e for e, i in self._instances.items() if not i.settled}

    def busy(self) -> bool:
        return bool(self.receivers or self._starting or self._scattering or self.meeting())

    def ask(self, ask: ev.ReceiveAsked, now: float, out: Out) -> None:
        key, endpoint = ask.key, ask.endpoint
        self._started[key] = now
        if key in self.receivers or key in self._starting:
            self._fail(key, f"transfer key {key} is already being received", now, out)
            return
        instance = self._instances.get(endpoint)
        if instance and instance.settled and ask.ctx_instance not in (None, instance.instance_name):
            # another instance answers there now (receives under way keep their sessions)
            log.info("ctx at %s is now instance %s: meeting it again", endpoint, ask.ctx_instance)
            instance = None
        if instance is None:
            self.rendezvous += 1
            instance = _CtxInstance(endpoint=endpoint, deadline=now + self._rendezvous_s)
            self._instances[endpoint] = instance
            info = wire.RequestInstanceInfo(protocol_version=wire.PROTOCOL_VERSION)
            out.append(ev.Send(endpoint=endpoint, message=info))
        if instance.refusal is not None:
            self._fail(key, instance.refusal, now, out)
            return
        self._starting[key] = _Starting(ask=ask, deadline=now + self.timeout_s)
        if instance.met:
            self._proceed(key, instance, now, out)

    def cancel(self, key: int, now: float, out: Out) -> bool:
        """Stop receiving `key`; whether nothing can land in its blocks any more."""
        if (session := self.receivers.get(key)) is not None:
            session.cancel()
            if session.status is not Status.TRANSFERRED:
                self._stop(session, out)
            self._settle(session, now, out)
            return key not in self.receivers and key not in self._scattering
        if (starting := self._starting.get(key)) is not None:
            starting.cancelled = True  # no REQUEST_DATA will go out: nothing can land
            if not starting.peers:  # waiting for the rendezvous (else `on_staging` ends it)
                del self._starting[key]
                self._fail(key, None, now, out)
        return key not in self._scattering  # a copy into the blocks may still run

    def on_instance_info(self, info: wire.InstanceInfo, source: str, now: float, out: Out) -> None:
        instance = self._instances.get(source)
        if instance is None or instance.ranks or instance.refusal or not info.ranks:
            return  # not a rendezvous's answer (a probe's), or none we can use
        instance.instance_name = info.ranks[0].instance_name
        if (problem := _not_one_instance(info.ranks)) is not None:
            self._refused(instance, f"INSTANCE_INFO from {source}: {problem}", now, out)
            return
        try:
            for rank in info.ranks:
                self.registrar.register(rank)  # the compatibility gate on our side
        except PeerIncompatible as exc:
            self._refused(instance, str(exc), now, out)
            return
        instance.ranks, instance.unacked = info.ranks, {r.instance_rank for r in info.ranks}
        register = wire.RegisterPeer(info=self.local)
        out += [ev.Send(endpoint=rank.control_endpoint, message=register) for rank in info.ranks]

    def on_ack(self, ack: wire.RegisterAck, source: str, now: float,
               out: Out) -> _CtxInstance | None:  # fmt: skip
        """A REGISTER_ACK on the dealer to `source`; the instance now met, if this did it."""
        for instance in self._instances.values():
            rank = next((r for r in instance.ranks if r.control_endpoint == source), None)
            if rank is None or ack.sender != rank.key:
                continue
            if ack.instance_rank not in instance.unacked:
                return None
            if not ack.accepted:
                self._refused(instance, str(PeerIncompatible(rank.label, ack.reason)), now, out)
                return None
            instance.unacked.discard(ack.instance_rank)
            if instance.unacked:
                return None
            log.info("registered with ctx instance %s at %s", rank.instance_name, source)
            for key in self._waiting(instance):
                self._proceed(key, instance, now, out)
            return instance
        return None

    def on_result(self, result: wire.TransferResult, source: str, now: float, out: Out) -> None:
        failed = result.status is wire.ResultStatus.ERROR
        if failed and result.error.startswith(wire.NOT_REGISTERED):
            # ctx forgot us: meet it again (a new instance may answer where we met another)
            self.forget(result.instance_name, None, now, out, rank_endpoint=source)
        due = (result.instance_name, result.instance_rank, result.key)
        if self._results_due.pop(due, None) is not None:
            return  # an ended session's, come late
        if (session := self.receivers.lookup(result.instance_name, result.key)) is not None:
            self._expire(session, now, out)  # a result past the deadline comes too late
            session.on_result(result)
            self._settle(session, now, out)
        elif result.key in self.receivers:
            self.refusals.not_owner("TRANSFER_RESULT", result.key, result.instance_name, now)

    def on_notice(self, notice: wire.WriteNotice, remote: str, now: float, out: Out) -> None:
        name, rank = notice.instance_name, notice.instance_rank
        if (peer := self.registrar.get((name, rank))) is not None and peer.agent_name != remote:
            why = f"WRITE_NOTICE {notice.key} from agent {remote} dropped: it names {name}#{rank}"
            self.refusals.refuse("impersonation", remote, now, why)
            return
        if (session := self.receivers.lookup(name, notice.key)) is not None:
            self._expire(session, now, out)
            session.on_notice(notice)
            self._settle(session, now, out)

    def on_cancel(self, cancel: wire.Cancel, now: float, out: Out) -> bool:
        """ctx cancelled a session of ours; False: we have none for it."""
        if (session := self.receivers.lookup(cancel.instance_name, cancel.key)) is None:
            if cancel.key in self.receivers:
                self.refusals.not_owner("CANCEL", cancel.key, cancel.instance_name, now)
                return True  # (handled: dropped)
            return False
        session.cancel()
        if session.status is Status.CANCELLED:
            self._stop(session, out)  # ctx ranks' answers end the quarantine
        self._settle(session, now, out)
        out.append(ev.WAKE)
        return True

    def on_staging(self, key: int, offset: int | None, error: str, now: float, out: Out) -> None:
        starting = self._starting.get(key)
        if starting is None or starting.staged is None:
            if offset is not None:
                out.append(ev.ReleaseStaging(offset=offset))
        elif offset is None or starting.cancelled:
            del self._starting[key]
            if offset is not None:
                out.append(ev.ReleaseStaging(offset=offset))
            self._fail(key, error if offset is None else None, now, out)
        else:
            starting.staged = attrs.evolve(starting.staged, offset=offset)
            self._open(key, now, out)

    def on_scattered(self, key: int, error: str | None, out: Out) -> None:
        if (outcome := self._scattering.pop(key, None)) is None:
            return
        if error is None:
            self.bounced += 1
        else:
            log.warning("KV transfer %d: scattering the staged KV failed: %s", key, error)
            outcome = attrs.evolve(outcome, ok=False, error=f"scattering the staged KV: {error}")
        out += [ev.Received(outcome=outcome), ev.WAKE]

    @property
    def _rendezvous_s(self) -> float:
        return min(RENDEZVOUS_TIMEOUT_S, self.timeout_s)

    def tick(self, now: float, out: Out) -> None:
        due, limit = self._results_due, 2 * self.timeout_s
        self._results_due = {d: at for d, at in due.items() if now - at <= limit}
        for session in list(self.receivers.values()):
            self._expire(session, now, out)
            self._settle(session, now, out)  # a quarantine may end by time
        for endpoint, instance in list(self._instances.items()):
            if not instance.settled and now >= instance.deadline:
                del self._instances[endpoint]  # transient: the next request tries again
                # a dead or forged endpoint must not keep a reconnecting socket
                out.append(ev.ForgetPeer(instance=None, endpoints=(endpoint,)))
                error = f"cannot reach ctx at {endpoint}: no answer in {self._rendezvous_s:g}s"
                self._fail_waiting(instance, error, now, out)

    def forget(self, instance: str, dead: str | None, now: float, out: Out, *,
               rank_endpoint: str = "") -> list[RankInfo]:  # fmt: skip
        """Drop the rendezvous with the ctx instance `instance`, and with whichever instance has
        a rank at `rank_endpoint` (the next request there meets whoever answers); the ranks they
        had. `dead`: why `instance`'s process ended: what waits on it fails now."""
        for session in list(self.receivers.values()):
            if dead is not None and session.peer_instance == instance:
                session.peer_died(f"peer instance {instance} is gone: {dead}")
                self._settle(session, now, out)
        dropped: list[RankInfo] = []
        for endpoint, met in list(self._instances.items()):
            there = any(rank.control_endpoint == rank_endpoint for rank in met.ranks)
            if met.settled and (met.instance_name == instance or there):
                del self._instances[endpoint]
                dropped += met.ranks
        return dropped

    def _proceed(self, key: int, instance: _CtxInstance, now: float, out: Out) -> None:
        """`key`'s ctx instance is met: reserve staging room if it bounces, then ask."""
        starting, first = self._starting[key], instance.ranks[0]
        overlap = self.registrar.overlap(first, peer_dp_rank=first.dp_rank)
        starting.peers = tuple(instance.ranks[rank] for rank in overlap)  # (ranks 0..n-1)
        blocks, num_tokens = starting.ask.block_ids, starting.ask.num_tokens
        if self.staging is not None and len(blocks) == 1 and self._bounces(starting):
            skipped = skipped_tokens(num_tokens, len(blocks[0]), self.local.tokens_per_block)
            num_bytes = canonical_bytes(self.local, num_tokens - skipped)
            if num_bytes <= self.staging.capacity:
                starting.staged = ev.Staged(offset=-1, num_bytes=num_bytes,
                                                   block_ids=blocks[0], first_token=skipped,
                                                   num_tokens=num_tokens)  # fmt: skip
                out.append(ev.ReserveStaging(key=key, num_bytes=num_bytes,
                                             deadline=starting.deadline))  # fmt: skip
                return
            log.info("KV of %d tokens exceeds the staging buffer: direct writes", num_tokens)
        self._open(key, now, out)

    def _bounces(self, starting: _Starting) -> bool:
        """Whether this receive goes through staging; ctx decides the same from the same
        mapper, and both ends agreed on the settings."""
        bounce = self.local.bounce
        return bounce.size_mb > 0 and any(
            self.registrar.send_plan(peer.key).piece_bytes < bounce.threshold_bytes
            for peer in starting.peers
        )

    def _open(self, key: int, now: float, out: Out) -> None:
        starting = self._starting.pop(key)
        staged = starting.staged
        address = staged.offset + self.staging.address if staged and self.staging else 0
        request = wire.RequestData(
            key=key, **self._me,
            block_ids=tuple(wire.pack_block_ids(ids) for ids in starting.ask.block_ids),
            num_tokens=starting.ask.num_tokens, staging_address=address,
            staging_bytes=staged.num_bytes if staged is not None else 0,
        )  # fmt: skip
        session = ReceiverSession(key=key, peer_instance=starting.peers[0].instance_name,
                                  expected=frozenset(p.instance_rank for p in starting.peers),
                                  deadline=starting.deadline)  # fmt: skip
        self.receivers[key] = session
        if staged is not None:
            self._staged[key] = staged
        out += [ev.Send(endpoint=p.control_endpoint, message=request) for p in starting.peers]

    def _settle(self, session: ReceiverSession, now: float, out: Out) -> None:
        """A terminal session ends once no ctx write can land in its blocks; until then a
        failure is reported at once (`early_failures`), the blocks held."""
        key = session.key
        if not session.is_terminal or self.receivers.get(key) is not session:
            return
        status = session.status
        if not self.released(session, now):
            if self.early_failures and status is Status.ERROR and not session.failure_reported:
                session.failure_reported = True
                failed = self._outcome(key, now, ok=False, error=session.error, blocks_held=True)
                out += [ev.Received(outcome=failed), ev.WAKE]
            return
        del self.receivers[key]
        if not session.peer_dead:
            due = {(session.peer_instance, r, key): now for r in session.unreported}
            self._results_due.update(due)
        if not session.is_quiescent:  # (TRANSFERRED is quiescent: every rank's part landed)
            self.quarantine_expired += 1
            log.warning("KV transfer %d: no answer from ctx %s %gs past the deadline; blocks freed",
                        key, session.peer_instance, self.timeout_s)  # fmt: skip
        outcome = None
        if not session.failure_reported:  # else it was told, and the executor frees
            num_bytes, num_descriptors, tokens = session.moved()
            outcome = self._outcome(
                key, now, ok=status is Status.TRANSFERRED, cancelled=status is Status.CANCELLED,
                error=session.error, num_bytes=num_bytes, num_descriptors=num_descriptors,
                first_tokens=tokens,
            )  # fmt: skip
        if (staged := self._staged.pop(key, None)) is not None:
            if outcome is not None and outcome.ok:
                self._scattering[key] = outcome  # reported once it is in the blocks
                out.append(ev.ScatterStaged(key=key, staged=staged))
                return
            out.append(ev.ReleaseStaging(offset=staged.offset))
        if outcome is not None:
            out.append(ev.Received(outcome=outcome))
        out.append(ev.WAKE)  # (a quarantine that ends frees blocks: `cancel_request` says so now)

    def released(self, session: ReceiverSession, now: float) -> bool:
        """Whether no ctx write can land in `session`'s blocks any more: its KV landed, or
        every expected rank reported (ctx answers a CANCEL at once when no write to us is in
        flight, else with that write's result), or ctx stayed silent a second timeout past the
        deadline (taken for dead)."""
        return session.is_quiescent or now >= session.deadline + self.timeout_s

    def _expire(self, session: ReceiverSession, now: float, out: Out) -> None:
        if session.expire(now, self.timeout_s):
            self._stop(session, out)

    def _stop(self, session: ReceiverSession, out: Out) -> None:
        """Tell every expected ctx rank, once, that we gave up on `session`."""
        if session.cancel_sent:
            return
        session.cancel_sent = True
        self._cancel(session.key, session.peer_instance, session.expected, out)

    def _refused(self, instance: _CtxInstance, refusal: str, now: float, out: Out) -> None:
        """The ctx instance refused us, or we it: every request to it fails with `refusal`,
        now and later (kept per endpoint)."""
        log.warning("refused ctx instance at %s: %s", instance.endpoint, refusal)
        instance.refusal, instance.unacked = refusal, set()
        self._fail_waiting(instance, refusal, now, out)

    def _waiting(self, instance: _CtxInstance) -> list[int]:
        """The receives that wait for the rendezvous with `instance`, in the order asked."""
        at = instance.endpoint
        return [k for k, s in self._starting.items() if not s.peers and s.ask.endpoint == at]

    def _fail_waiting(self, instance: _CtxInstance, reason: str, now: float, out: Out) -> None:
        for key in self._waiting(instance):
            del self._starting[key]
            self._fail(key, reason, now, out)

    def _fail(self, key: int, reason: str | None, now: float, out: Out) -> None:
        """`key`'s receive failed with `reason`, or was cancelled (None) before it started."""
        fields = {"error": reason} if reason is not None else {"cancelled": True}
        out += [ev.Received(outcome=self._outcome(key, now, ok=False, **fields)), ev.WAKE]


def _not_one_instance(ranks: tuple[RankInfo, ...]) -> str | None:
    """What is wrong with `ranks` as every rank of one instance, in order (None: nothing). gen
    looks ranks up by number, so a list with one missing would fail a request later."""
    first = ranks[0]
    world = first.tp_size * first.pp_size
    numbers = [rank.instance_rank for rank in ranks]
    if numbers != list(range(world)):
        shape = f"TP {first.tp_size} x PP {first.pp_size}"
        return f"ranks {numbers} are not 0..{world - 1} of a {shape} instance"
    if any(rank.instance_name != first.instance_name for rank in ranks):
        return "its ranks name different instances"
    return None
