"""ctx (sender) side of the KvTransceiver (transfer/transceiver.py): push KV when gen asks.

REQUEST_DATA joins the SenderSession (or waits in EarlyMessages until prefill ends); each
requesting gen rank then gets one write (transfer/writes.py). A rank whose RankInfo says
`request_notices` also gets REQUEST_DATA as an agent notification, sent by gen before the ZMQ
copy and about 0.1 ms sooner on a virtual machine: it only ever joins a session that waits for it
(a response's: context_first), and the ZMQ copy of a request so taken is dropped.

When REQUEST_DATA came before the KV and the executor said where the KV will be
(`prepare_send`), the write is mapped and prepared by the agent while the prefill runs, and only
posted when the KV is ready (transfer/prepared.py).

The transceiver's shell owns the sessions, the dealers, the agent lock and the nursery; `CtxSender`
is given them (or what uses them), and every task it starts runs in the shell's nursery.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence

import attrs
import trio

from trtdisagg.transfer.errors import TransferLayerError
from trtdisagg.transfer.pacing import REQUEST_WATCH_S
from trtdisagg.transfer.prepared import PreparedWrite, PreparedWrites
from trtdisagg.transfer.protocol.peers import PeerRegistrar, direct_fragments
from trtdisagg.transfer.protocol.sessions import (
    EarlyMessages,
    SenderSession,
    SenderStatus,
    SessionRegistry,
    SourceBlocks,
    TransferOutcome,
)
from trtdisagg.transfer.protocol.wire import Cancel, RequestData, ResultStatus
from trtdisagg.transfer.runtime.agents.base import TransferAgent, posts_quickly, write_preparer
from trtdisagg.transfer.writes import CtxWrites

log = logging.getLogger(__name__)


@attrs.define(eq=False, kw_only=True)
class CtxSender:
    """ctx: the sender sessions, from REQUEST_DATA (or `prepare_send`) to their outcomes."""

    agent: TransferAgent
    registrar: PeerRegistrar
    timeout_s: float
    clock: Callable[[], float]
    senders: SessionRegistry[SenderSession]
    early: EarlyMessages
    prepared: PreparedWrites
    writes: CtxWrites
    # The shell's, shared: agent names of registered gen ranks, the agent lock.
    _remote_names: Mapping[tuple[str, int], str]
    _agent_lock: trio.Lock
    # The shell's services (transfer/transceiver.py).
    _stamp: Callable[[int, str], None]
    _spawn: Callable[..., None]
    _start_timing: Callable[[int], None]
    _outcome: Callable[..., TransferOutcome]
    _watch: Callable[[Hashable, float], None]
    _forget: Callable[[Hashable], None]
    # (gen instance, gen rank, key) of requests taken from a notification -> when: their ZMQ
    # copies are dropped (`forget_noticed` drops entries whose copy never came).
    _noticed: dict[tuple[str, int, int], float] = attrs.Factory(dict)
    request_notices: int = 0  # REQUEST_DATA taken from a notification (since start)

    @property
    def copies_due(self) -> int:
        """Requests taken from a notification whose ZMQ copy has not come yet."""
        return len(self._noticed)

    def respond_and_send_async(
        self,
        key: int,
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        first_tokens: Sequence[int] = (),
    ) -> None:
        """See `KvTransceiver.respond_and_send_async`."""
        first_tokens = tuple(first_tokens)
        if self.prepared.is_safe(key) and self.senders.get(key) is None:
            # The KV is ready: its prepared writes go first, the bookkeeping after (which costs
            # as long as a write of 128 MiB on one GPU takes). Whether the session made below
            # takes their requests was checked when they were prepared (`_prepare`).
            source = SourceBlocks(block_ids=tuple(map(tuple, block_ids)), num_tokens=num_tokens)
            self.writes.post_ready(key, source, first_tokens)
        session = SenderSession(
            key=key, deadline=self.clock() + self.timeout_s, first_tokens=first_tokens
        )
        session.set_source(block_ids, num_tokens)
        self.senders.add(session)
        self._start_timing(key)
        requests, cancelled = self.early.take(key)
        if cancelled:
            session.cancel()
        elif not requests:
            # context_first: gen's REQUEST_DATA follows within milliseconds (pacing.py).
            self._watch(("request", key), REQUEST_WATCH_S)
        for request in requests:
            self._accept_request(session, request)
        self.writes.start_writes(session)
        self.writes.settle_posted_ahead(session)
        self.forget_prepared(key)  # what `start_writes` did not post is of no use now
        self.writes.nudge()  # a short write may have ended by now: gen hears of it at once

    def _takes_early_requests(self, key: int) -> bool:
        """Whether a session made for `key` will take every REQUEST_DATA held for it
        (`_accept_request`), so that a write posted for one before is sure to be its own:
        no session yet, no CANCEL held, one gen instance, one request per rank (or identical
        copies), each rank registered and overlapping."""
        if self.senders.get(key) is not None or self.early.cancelled(key):
            return False
        requests = self.early.peek(key)
        if not requests or len({request.instance_name for request in requests}) != 1:
            return False
        if len(set(requests)) != len({request.instance_rank for request in requests}):
            return False  # a rank asked twice, differently: the session takes the first
        first = self.registrar.get((requests[0].instance_name, requests[0].instance_rank))
        if first is None:
            return False
        expected = self.registrar.overlap(first, peer_dp_rank=first.dp_rank).ranks  # as `bind`
        return all(
            request.instance_rank in expected
            and self.registrar.get((request.instance_name, request.instance_rank)) is not None
            for request in requests
        )

    def prepare_send(self, key: int, block_ids: Sequence[Sequence[int]], num_tokens: int) -> None:
        """See `KvTransceiver.prepare_send`."""
        if write_preparer(self.agent) is None or self.senders.get(key) is not None:
            return
        stale = self.prepared.expect(key, block_ids, num_tokens, self.clock() + self.timeout_s)
        self.writes.release_handles(stale)
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
            or peer_key not in self._remote_names
        ):
            return
        plan = self.registrar.send_plan(peer_key)
        remote = self._remote_names[peer_key]
        try:
            fragments = direct_fragments(plan, source, request)
            if not len(fragments) or not posts_quickly(self.agent, fragments, remote):
                return
            memory_type, device_id = self.writes.destination(plan)
            handle = preparer.prepare_write(
                fragments,
                remote,
                self.writes.notice(key),
                dst_memory_type=memory_type,
                dst_device_id=device_id,
            )
        except (TransferLayerError, ValueError) as exc:
            log.debug("KV write %d to %s not prepared: %s", key, peer_key, exc)
            return  # the write path maps it again and reports what is wrong
        write = PreparedWrite(
            request=request,
            source=source,
            fragments=fragments,
            remote=remote,
            handle=handle,
            notice=self.writes.notice_template(key, fragments),
            told_at=self.writes.tell_prepared(key, request),
        )
        self.writes.release_handles([self.prepared.add(key, write)])
        if self._takes_early_requests(key):
            self.prepared.mark_safe(key)

    def forget_prepared(self, key: int) -> None:
        self.writes.release_handles(self.prepared.drop(key))

    def check_context_transfer_status(self) -> list[TransferOutcome]:
        self.writes.nudge()  # the executor's tick may come before the write's task polls
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

    def _accept_request(self, session: SenderSession, request: RequestData) -> bool:
        """Add `request` to `session`; False: a duplicate, or from a rank it does not expect."""
        peer_key = (request.instance_name, request.instance_rank)
        peer = self.registrar.get(peer_key)
        if peer is None:
            return False
        if session.expected is None:
            overlap = self.registrar.overlap(peer, peer_dp_rank=peer.dp_rank)
            session.bind(request.instance_name, frozenset(overlap.ranks))
        return session.add_request(request)

    def on_request_notice(self, remote: str, request: RequestData) -> None:
        """REQUEST_DATA as a notification from the agent `remote`: taken only by a session that
        waits for it, and only from the agent of the gen rank it names (else dropped: the ZMQ
        copy, which follows, does what is needed)."""
        rank_key = (request.instance_name, request.instance_rank)
        if self._remote_names.get(rank_key) != remote:
            return
        session = self.senders.lookup(request.instance_name, request.key)
        if session is None or not self._accept_request(session, request):
            return
        self._stamp(request.key, "received")
        self.request_notices += 1
        self._noticed[(request.instance_name, request.instance_rank, request.key)] = self.clock()
        self._forget(("request", request.key))
        # gen drains its notifications at every round just after sending REQUEST_DATA
        # (receive_side.py), so the write's own notification tells it soonest.
        self.writes.start_writes(session, gen_watching=True)

    def forget_noticed(self, now: float) -> None:
        """Forget requests taken from a notification whose ZMQ copy never came (a gen gone)."""
        stale = [key for key, at in self._noticed.items() if now - at > self.timeout_s]
        for key in stale:
            del self._noticed[key]

    def on_request_data(self, request: RequestData) -> None:
        if self._noticed.pop((request.instance_name, request.instance_rank, request.key), None):
            return  # taken from its notification already
        self._stamp(request.key, "received")
        if self.registrar.get((request.instance_name, request.instance_rank)) is None:
            log.warning(
                "REQUEST_DATA %d from unregistered rank %s#%d dropped",
                request.key,
                request.instance_name,
                request.instance_rank,
            )
            return
        if self.early.take_overtaken(request):
            log.info("REQUEST_DATA %d came after its CANCEL: dropped", request.key)
            return
        session = self.senders.lookup(request.instance_name, request.key)
        if session is None:
            if self.senders.get(request.key) is None:
                self.prepared.unsafe(request.key)  # `_prepare` checks again
                self.early.add_request(self.clock(), request)
                self._prepare(request.key, request)
            return
        self._forget(("request", request.key))
        self._accept_request(session, request)
        # As with a notification: gen watches just after sending REQUEST_DATA.
        self.writes.start_writes(session, gen_watching=True)

    async def ack_cancel(self, cancel: Cancel) -> None:
        """Answer a CANCEL for which no write of ours is in flight to its sender, so that it can
        free the blocks it keeps quarantined without waiting for a second timeout."""
        await self.writes.send_result(
            (cancel.instance_name, cancel.instance_rank),
            cancel.key,
            ResultStatus.CANCELLED,
            error="cancelled; no write in flight",
        )

    def abandon(self, key: int, reason: str) -> None:
        """See `KvTransceiver.abandon_send`."""
        if self.senders.get(key) is not None:
            return  # responded: the session's own cancel and deadline apply
        self.forget_prepared(key)
        requests, _ = self.early.take(key)
        error = f"the ctx request ended before its KV was ready: {reason}"
        for request in requests:
            self._spawn(self.refuse, request, error)

    async def refuse_stale(self, request: RequestData) -> None:
        """Answer a REQUEST_DATA whose key never showed up here, so gen fails fast."""
        await self.refuse(
            request,
            f"ctx has no request with disagg_request_id {request.key} (never prefilled here, "
            "or already released)",
        )

    async def refuse(self, request: RequestData, error: str) -> None:
        """Answer a REQUEST_DATA that no KV will ever answer with ERROR and `error`."""
        await self.writes.send_result(
            (request.instance_name, request.instance_rank),
            request.key,
            ResultStatus.ERROR,
            error=error,
        )
