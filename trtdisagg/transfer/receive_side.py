"""gen (receiver) side of the KvTransceiver (transfer/transceiver.py): ask ctx for KV, see it land.

A ReceiverSession expects one TRANSFER_RESULT per overlapping ctx rank; REQUEST_DATA goes to each
of them, once the ctx instance was met (transfer/rendezvous.py). The session completes when every
expected rank reported OK and every rank that moved bytes delivered its WRITE_NOTICE notification
(the data has landed). A rank whose write was announced (WRITE_POSTED) counts once its notice is
in: gen need not wait for the TRANSFER_RESULT hop. A receive that bounces lands in staging first
and is scattered into its blocks afterwards (transfer/bounce.py).

Quarantine: a receiver that ends before every ctx rank reported sends CANCEL once and stays
quarantined until each answers (a ctx rank with no write in flight answers a CANCEL at once) or,
if ctx is silent, a second timeout past the deadline; its failure is reported at once, with
`blocks_held`, unless the transceiver's `early_failures` is off.

The transceiver's shell owns the sessions, the dealers, the agent lock and the nursery;
`GenReceiver` is given them (or what uses them), and every task it starts runs in the shell's
nursery.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence

import attrs
import trio

from trtdisagg.transfer.errors import PeerIncompatible, TransferLayerError
from trtdisagg.transfer.pacing import SPIN_POLL_S, WRITE_WATCH_S, notice_spin_s
from trtdisagg.transfer.protocol.bounce import bounces, canonical_bytes
from trtdisagg.transfer.protocol.peers import PeerRegistrar
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.sessions import (
    ReceiverSession,
    ReceiverStatus,
    SessionRegistry,
    TransferOutcome,
)
from trtdisagg.transfer.protocol.wire import (
    Cancel,
    Message,
    RequestData,
    TransferResult,
    WriteNotice,
    WritePosted,
    WritePrepared,
    pack_block_ids,
)
from trtdisagg.transfer.rendezvous import CtxPeers
from trtdisagg.transfer.runtime.messenger import Dealer
from trtdisagg.transfer.runtime.staging_area import StagingArea

log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class _Staged:
    """gen: where a bouncing receive's canonical region is, and where it goes afterwards."""

    offset: int
    num_bytes: int
    block_ids: tuple[int, ...]
    first_token: int
    num_tokens: int


@attrs.define(eq=False, kw_only=True)
class GenReceiver:
    """gen: the receiver sessions, from the executor's request to their outcomes."""

    local: RankInfo
    registrar: PeerRegistrar
    timeout_s: float
    wake: Callable[[], None]
    clock: Callable[[], float]
    staging: StagingArea | None
    receivers: SessionRegistry[ReceiverSession]
    ctx_peers: CtxPeers
    # The shell's, shared: open dealers.
    _dealers: Mapping[str, Dealer]
    # The shell's services (transfer/transceiver.py).
    _stamp: Callable[[int, str], None]
    _spawn: Callable[..., None]
    _send: Callable[[str, Message], Awaitable[None]]
    _start_timing: Callable[[int], None]
    _outcome: Callable[..., TransferOutcome]
    _cancel_message: Callable[[int], Cancel]
    _watch: Callable[[Hashable, float], None]
    _forget: Callable[[Hashable], None]
    _drain: Callable[[], object]  # the agent's notifications, to both sides
    _notice_request: Callable[[tuple[str, int], RequestData], None]  # the quicker copy
    # Whether a waiter spins in `KvTransceiver.wait_for` now, draining as it goes: the poller
    # then leaves the notifications to it, which hands their outcomes over in its own turn.
    _waiter_spins: Callable[[], bool] = lambda: False
    quarantine_expired: int = 0  # quarantines ended by the second timeout, not by ctx
    bounced: int = 0  # receives that went through staging
    _failed_early: dict[int, str] = attrs.Factory(dict)
    # Receives still in rendezvous (no session yet) -> cancelled meanwhile. A cancelled one
    # never asks ctx for data, and reports a cancelled outcome once the rendezvous returns.
    _starting: dict[int, bool] = attrs.Factory(dict)
    _cancelled_early: set[int] = attrs.Factory(set)
    _landed: list[TransferOutcome] = attrs.Factory(list)  # ended as their KV landed: to report
    _staged: dict[int, _Staged] = attrs.Factory(dict)  # gen: receives that bounce
    _scattering: set[int] = attrs.Factory(set)  # gen: staged KV being copied into the blocks
    _scattered: list[TransferOutcome] = attrs.Factory(list)  # ... and copied: to report
    _receiving: trio.Event = attrs.Factory(trio.Event)  # set when a receive session starts
    _spin_notices_until: float = 0.0  # gen: drain notifications every round until then
    # (ctx instance, ctx rank, key) -> when: a session of `key` ended before that rank's
    # TRANSFER_RESULT came (on the write's notice, or given up on). That result, when it
    # comes, is the ended session's, not one of a later session of the key.
    _results_due: dict[tuple[str, int, int], float] = attrs.Factory(dict)

    def request_and_receive_async(
        self,
        key: int,
        ctx_info_endpoint: str,
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        *,
        ctx_instance: str | None = None,
    ) -> None:
        """See `KvTransceiver.request_and_receive_async`."""
        self._start_timing(key)
        self._stamp(key, "request")
        if ctx_instance is not None:
            self.ctx_peers.forget_replaced(ctx_info_endpoint, ctx_instance)
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
        ranks = self.ctx_peers.met(endpoint)
        if ranks is None:
            return False
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
        rank over ZMQ, or None (the failure is reported) if `key` is already being received.
        A ctx rank that takes REQUEST_DATA as a notification gets it here, first: nothing can
        land before this returns to the loop, so the session may follow."""
        if self.receivers.get(key) is not None:
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
        by_rank = {info.instance_rank: info for info in ranks}
        for rank in sorted(expected):
            self._notice_request(by_rank[rank].key, request)
        session = ReceiverSession(
            key=key,
            peer_instance=ranks[0].instance_name,
            expected=frozenset(expected),
            deadline=deadline,
        )
        self.receivers.add(session)
        self._receiving.set()
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
            ranks = await self.ctx_peers.ensure_ctx_peer(endpoint)
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

    def check_gen_transfer_status(self, *, early_failures: bool) -> list[TransferOutcome]:
        if len(self.receivers):
            # A busy gen's loop does not spin, and its poller drains every millisecond: what
            # landed during the executor's step is taken now, at the step's end.
            self._drain()
        now = self.clock()
        done, self._landed = self._landed, []
        if self._results_due:
            for due in [d for d, at in self._results_due.items() if now - at > 2 * self.timeout_s]:
                del self._results_due[due]
        if self._failed_early:
            done += [self._outcome(key, ok=False, error=e) for key, e in self._failed_early.items()]
            self._failed_early.clear()
        if self._cancelled_early:
            done += [self._outcome(key, ok=False, cancelled=True) for key in self._cancelled_early]
            self._cancelled_early.clear()
        for session in self.receivers.expired(now):
            session.fail(f"KV transfer {session.key} timed out after {self.timeout_s:g}s")
            self.stop_receiver(session)
        for session in self.receivers:
            if not session.is_terminal:
                continue
            if not self.released(session, now):
                # Quarantined. A failure is told now (the request fails on time); the blocks
                # stay pinned until `cancel_request(key)` says no write can land any more.
                if (
                    early_failures
                    and session.status is ReceiverStatus.ERROR
                    and not session.failure_reported
                ):
                    session.failure_reported = True
                    failed = self._outcome(session.key, ok=False, error=session.error)
                    done.append(attrs.evolve(failed, blocks_held=True))
                continue
            outcome = self._end(session, now)
            if outcome is not None:
                done.append(outcome)
        if self._scattered:
            done += self._scattered
            self._scattered.clear()
        return done

    def _end(self, session: ReceiverSession, now: float) -> TransferOutcome | None:
        """Forget `session`, terminal and released: its outcome to report now, or None (told
        before, or reported once its staged KV is in the blocks)."""
        self.receivers.pop(session.key)
        self._forget(("write", session.key))  # (a failed or cancelled one may be watched)
        if not session.peer_dead:
            for rank in session.unreported:
                self._results_due[(session.peer_instance, rank, session.key)] = now
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
            return None  # reported once the staged KV is in the blocks
        if not session.is_quiescent and status is not ReceiverStatus.TRANSFERRED:
            self.quarantine_expired += 1
            log.warning(
                "KV transfer %d: no answer from ctx %s %gs past the deadline; blocks freed",
                session.key,
                session.peer_instance,
                self.timeout_s,
            )
        return outcome

    def _end_if_landed(self, session: ReceiverSession) -> None:
        """`session`'s KV has all landed: end it here and now, so that the executor's next
        check only hands the outcome over. The notice that completes a transfer is drained in
        the watching loop's turn, and the rest of the check would cost the transfer 0.05-0.1
        ms of cold Python on the device before the executor sees it."""
        if self.receivers.get(session.key) is not session:
            return  # ended already (by the notice a drain just now found)
        if session.status is ReceiverStatus.TRANSFERRED:
            outcome = self._end(session, self.clock())
            if outcome is not None:
                self._landed.append(outcome)
        elif session.is_terminal:
            self._forget(("write", session.key))
        self.wake()

    def cancel_unstarted(self, key: int) -> bool:
        """`cancel_request` of a `key` with no receive session: True when nothing can land."""
        if key in self._starting:
            self._starting[key] = True  # no REQUEST_DATA will go out, so nothing can land
        return key not in self._scattering  # a worker thread still copies into the blocks

    # ---- gen quarantine: blocks that a ctx write may still reach ----

    def released(self, session: ReceiverSession, now: float) -> bool:
        """Whether no ctx write can land in `session`'s blocks any more.

        True once the KV landed, or every expected ctx rank reported: a result, or its answer
        to our CANCEL (a ctx rank answers a CANCEL at once when it has no write in flight to us,
        else with the write's result when it ends). A ctx that stays silent for a second
        `timeout_s` past the deadline is taken for dead; that is counted and logged, since a
        ctx that is alive but that slow could still write.
        """
        settled = session.status is ReceiverStatus.TRANSFERRED or session.is_quiescent
        return settled or now >= session.deadline + self.timeout_s

    def stop_receiver(self, session: ReceiverSession) -> None:
        """Tell every expected ctx rank, once, that we gave up on `session`."""
        if not session.cancel_sent:
            session.cancel_sent = True
            self._spawn(self._send_cancel, session)

    async def _send_cancel(self, session: ReceiverSession) -> None:
        for rank in session.expected:
            peer = self.registrar.get((session.peer_instance, rank))
            if peer is not None:
                await self._send(peer.control_endpoint, self._cancel_message(session.key))

    # ---- ctx's messages, and the agent's notifications that a write landed ----

    def on_transfer_result(self, message: TransferResult) -> None:
        self._stamp(message.key, "result")
        due = (message.instance_name, message.instance_rank, message.key)
        if self._results_due.pop(due, None) is not None:
            return  # an ended session's, come late
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
            self._drain()
            self._end_if_landed(session)

    def on_write_posted(self, posted: WritePosted) -> None:
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
        spin = notice_spin_s(posted.expected_us)
        self._spin_notices_until = max(self._spin_notices_until, self.clock() + spin)
        self._drain()
        if session.is_terminal:
            self._end_if_landed(session)

    def on_write_prepared(self, prepared: WritePrepared) -> None:
        """ctx prepared the write of `prepared.key` (generation_first): it goes when ctx's
        prefill step ends, so watch for its notification from now on (pacing.py)."""
        self._stamp(prepared.key, "prepared_seen")
        session = self.receivers.lookup(prepared.instance_name, prepared.key)
        if session is not None and not session.is_terminal:
            self._watch(("write", prepared.key), WRITE_WATCH_S)

    async def poll_notifications(self) -> None:
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
            # (a notification for no session would be dropped)
            if len(self.receivers) and not self._waiter_spins():
                self._drain()

    def on_write_notice(self, notice: WriteNotice) -> None:
        """A write's notification (drained by the shell): its bytes have landed."""
        self._stamp(notice.key, "notice")
        session = self.receivers.lookup(notice.instance_name, notice.key)
        if session is None:
            return
        if notice.summarizes:  # what WRITE_POSTED says, should it not be in yet
            session.on_posted(
                notice.instance_rank,
                num_bytes=notice.num_bytes,
                num_descriptors=notice.num_descriptors,
                first_tokens=notice.first_tokens,
            )
        if session.on_notice(notice.instance_rank):
            if session.is_terminal:  # every ctx rank's part is in (one of several: not yet)
                self._end_if_landed(session)
            else:
                self.wake()
