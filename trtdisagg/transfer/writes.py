"""ctx's writes (part of the KvTransceiver's ctx side, transfer/send_side.py).

A write task maps blocks to fragments, submits one agent WRITE whose notification names the key,
announces it (WRITE_POSTED: bytes, descriptors, first tokens), polls it, and reports
TRANSFER_RESULT, also when it moved 0 bytes. A direct write is mapped, and when the post is quick
posted too, in the caller's turn (`start_writes`); a write the agent prepared while the prefill
ran (transfer/prepared.py) is only posted. The bounce path packs this rank's runs into staging
and writes them in one go (transfer/bounce.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol, TypeVar

import attrs
import trio

from trtdisagg.transfer.errors import TransferLayerError
from trtdisagg.transfer.pacing import (
    SPIN_POLL_S,
    WriteRates,
    gen_watches,
    polls_every_round,
    spins_for_done,
)
from trtdisagg.transfer.prepared import PreparedWrite, PreparedWrites
from trtdisagg.transfer.protocol.bounce import staged_fragments, staged_runs
from trtdisagg.transfer.protocol.fragments import Fragments
from trtdisagg.transfer.protocol.peers import PeerRegistrar, SendPlan, direct_fragments
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.sessions import SenderSession, SourceBlocks
from trtdisagg.transfer.protocol.wire import (
    Message,
    NoticeTemplate,
    RequestData,
    ResultStatus,
    TransferResult,
    WriteNotice,
    WritePosted,
    WritePrepared,
    encode,
    unpack_block_ids,
)
from trtdisagg.transfer.runtime.agents.base import (
    TransferAgent,
    XferHandle,
    XferStatus,
    posts_quickly,
    write_preparer,
)
from trtdisagg.transfer.runtime.messenger import Dealer
from trtdisagg.transfer.runtime.staging_area import StagingArea

log = logging.getLogger(__name__)

T = TypeVar("T")


class _CallAgent(Protocol):
    """The shell's `_call_agent`: one synchronous agent call, never overlapping another."""

    async def __call__(self, call: Callable[[], T], *, quick: bool) -> T: ...


@attrs.frozen(kw_only=True)
class _Posted:
    """ctx: one write handed to the agent, to be polled to its end (`_await_write`)."""

    key: int
    handle: XferHandle
    remote: str
    num_bytes: int
    num_descriptors: int
    posted: float
    expected: float  # when it should be done, from the peer's learned rate (= posted: unknown)


def _gone(request: RequestData) -> TransferLayerError:
    return TransferLayerError(f"gen rank {request.instance_name}#{request.instance_rank} is gone")


@attrs.define(eq=False, kw_only=True)
class CtxWrites:
    """ctx: every write to a requesting gen rank, from its mapping to its TRANSFER_RESULT."""

    local: RankInfo
    agent: TransferAgent
    registrar: PeerRegistrar
    wake: Callable[[], None]
    on_write: Callable[[int, int, float], None]
    clock: Callable[[], float]
    staging: StagingArea | None
    prepared: PreparedWrites
    # The shell's, shared: agent names of registered gen ranks, open dealers, the agent lock.
    _remote_names: Mapping[tuple[str, int], str]
    _dealers: Mapping[str, Dealer]
    _agent_lock: trio.Lock
    # The shell's services (transfer/transceiver.py).
    _stamp: Callable[[int, str], None]
    _spawn: Callable[..., None]
    _send: Callable[[str, Message], Awaitable[None]]
    _call_agent: _CallAgent
    prepared_posts: int = 0  # writes posted from a preparation (since start)
    # (key, gen rank) -> a prepared write posted by `post_ready` (or why its post failed),
    # for the session's write to that rank to take up
    _posted_ahead: dict[tuple[int, int], _Posted | TransferLayerError] = attrs.Factory(dict)
    bounced: int = 0  # sends that went through staging
    _write_rates: WriteRates = attrs.Factory(WriteRates)  # bytes/s of writes, per remote
    # Writes posted and not yet released by their tasks (`_await_write`), which `nudge` polls
    # too while they are young; a write it found ended -> (its state, when).
    _in_flight: dict[XferHandle, _Posted] = attrs.Factory(dict)
    _ended: dict[XferHandle, tuple[XferStatus, float]] = attrs.Factory(dict)
    _released: trio.Event = attrs.Factory(trio.Event)  # set (and replaced) at each release

    def release_handles(self, handles: Sequence[XferHandle | None]) -> None:
        """Hand prepared writes that will never be posted back to the agent (in a task: the
        agent may be busy in a worker thread)."""
        for handle in handles:
            if handle is not None:
                self._spawn(self._release_handle, handle)

    async def _release_handle(self, handle: XferHandle) -> None:
        await self._call_agent(lambda: self.agent.release(handle), quick=True)

    def post_ready(self, key: int, source: SourceBlocks, first_tokens: tuple[int, ...]) -> None:
        """The KV of `key` just became ready in `source`: post the writes prepared from it now,
        ahead of the session that `start_writes` then gives them to. The caller made sure that
        session takes each of their requests. Only writes that gen watches for (else WRITE_POSTED
        goes first, on the usual path), and never while a threaded agent call runs."""
        preparer = write_preparer(self.agent)
        if preparer is None or self._agent_lock.locked():
            return
        now = self.clock()
        for prepared in self.prepared.ready(key, source):
            if not gen_watches(now, prepared.told_at):
                continue
            notice = prepared.notice.encode(first_tokens)
            posted: _Posted | TransferLayerError
            try:
                self._stamp(key, "post")
                preparer.post_prepared(prepared.handle, notice)
                self._stamp(key, "posted")
                posted = self._posted(key, prepared.handle, prepared.remote, prepared.fragments)
            except TransferLayerError as exc:  # the agent released the handle
                posted = exc
            self._posted_ahead[(key, prepared.request.instance_rank)] = posted
        self.nudge(spin=True)  # the post call can outlast a short write (128 MiB on one H200)

    def settle_posted_ahead(self, session: SenderSession) -> None:
        """Writes `post_ready` posted for `session` that it did not take up. Its caller's check
        makes this unreachable; should one slip through, the session fails, and it keeps its
        blocks until the write has ended (its handle then goes back to the agent)."""
        for key, rank in [k for k in self._posted_ahead if k[0] == session.key]:
            posted = self._posted_ahead.pop((key, rank))
            self.prepared.posted(key, rank)
            if isinstance(posted, _Posted):
                log.error("KV write %d to gen rank %d posted for a request not taken", key, rank)
                session.adopt_write(rank)
                self._spawn(self._settle_untaken, session, rank, posted)

    async def _settle_untaken(self, session: SenderSession, rank: int, posted: _Posted) -> None:
        with contextlib.suppress(TransferLayerError):  # failed: ended all the same
            await self._await_write(session.key, posted)
        reason = "a write was posted for a request this session did not take"
        session.write_finished(rank, ResultStatus.ERROR, reason)
        self.wake()

    def start_writes(self, session: SenderSession, *, gen_watching: bool = False) -> None:
        """Start a write to each rank that asked and has none yet. `gen_watching`: its
        REQUEST_DATA just came, and gen drains its notifications at every round for a while
        after sending one (so a quick write is announced after its post)."""
        for request in session.take_writes():
            start = self.clock()
            early: _Posted | Fragments | Exception | None
            try:
                early = self._post_at_once(session, request, gen_watching=gen_watching)
            except (TransferLayerError, ValueError) as exc:
                early = exc
            self._spawn(self._write, session, request, start, early)
        self.nudge(spin=True)

    def _post_at_once(
        self, session: SenderSession, request: RequestData, *, gen_watching: bool = False
    ) -> _Posted | Fragments | None:
        """Map a direct write right here, and post it too when the post is quick: the write
        then starts the moment the KV is ready (or gen's request arrives), not at the write
        task's first turn on the loop. Fragments: mapped, for the task to post. None: the task
        does it all (the bounce path)."""
        if request.staging_bytes or session.source is None:
            return None
        self._stamp(session.key, "write")
        prepared, stale = self.prepared.take(session.key, request, session.source)
        ahead = self._posted_ahead.pop((session.key, request.instance_rank), None)
        if ahead is not None:  # `stale` is its handle when the request differs: posted, kept
            return self._took_posted(session, request, ahead, prepared or stale)
        self.release_handles([stale])
        if prepared is not None:
            if session.cancelled or self._agent_lock.locked():
                self.release_handles([prepared.handle])
            else:
                return self._post_prepared(session, request, prepared)
        plan = self._plan(request)
        fragments = self._fragments(session, request, plan)
        remote = self._remote(request)
        if (
            session.cancelled
            or not len(fragments)
            or self._agent_lock.locked()  # a threaded agent call runs: never overlap it
            or not posts_quickly(self.agent, fragments, remote)
        ):
            return fragments
        submit = self._submitter(session.key, fragments, request, plan, summary=session)
        return self._post_now(
            session, request, fragments, remote, submit, gen_watching=gen_watching
        )

    def _post_prepared(
        self, session: SenderSession, request: RequestData, prepared: PreparedWrite
    ) -> _Posted:
        preparer = write_preparer(self.agent)
        assert preparer is not None

        # Prepared before the first tokens were known: the notice is replaced at the post.
        notice = prepared.notice.encode(session.first_tokens)

        def post() -> XferHandle:
            self._stamp(session.key, "post")
            preparer.post_prepared(prepared.handle, notice)
            self._stamp(session.key, "posted")
            return prepared.handle

        watching = gen_watches(self.clock(), prepared.told_at)
        posted = self._post_now(
            session, request, prepared.fragments, prepared.remote, post, gen_watching=watching
        )
        self.prepared_posts += 1
        return posted

    def _took_posted(
        self,
        session: SenderSession,
        request: RequestData,
        posted: _Posted | TransferLayerError,
        prepared: PreparedWrite | XferHandle | None,
    ) -> _Posted:
        """The write `post_ready` posted for `request`, now the session's: announced after the
        post (gen watches for it)."""
        if isinstance(posted, TransferLayerError):
            raise posted
        self.prepared_posts += 1
        if isinstance(prepared, PreparedWrite) and self._write_rates.announce_after(
            posted.remote, posted.num_bytes, gen_watching=True
        ):
            self._announce(session, request, prepared.fragments, posted.remote)
        return posted

    def _post_now(
        self,
        session: SenderSession,
        request: RequestData,
        fragments: Fragments,
        remote: str,
        submit: Callable[[], XferHandle],
        *,
        gen_watching: bool = False,
    ) -> _Posted:
        """Post a quick write right here, announced before or after
        (`WriteRates.announce_first`; `gen_watching`: gen was told of it, see `gen_watches`)."""
        first = self._write_rates.announce_first(
            remote, fragments.num_bytes, quick=True, gen_watching=gen_watching
        )
        if first:
            self._announce(session, request, fragments, remote)
        posted = self._posted(session.key, submit(), remote, fragments)
        if not first and self._write_rates.announce_after(
            remote, fragments.num_bytes, gen_watching=gen_watching
        ):
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
        await self.send_result(
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

    async def send_result(
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
        plan = self._plan(request)
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
        fragments = direct_fragments(plan, session.source, request)
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
        remote = self._remote(request)
        submit = self._submitter(key, fragments, request, plan, summary=announce)
        # On the loop only when the agent says this post is quick (NIXL: a few descriptors to a
        # connected peer, from VRAM or a small DRAM region: ~0.1-0.2 ms, less than the thread
        # hop). A long descriptor list, a first write (connection set-up) or a large host-memory
        # write (which UCX may copy inside the post) goes to a worker thread.
        quick = posts_quickly(self.agent, fragments, remote)
        first = self._write_rates.announce_first(remote, fragments.num_bytes, quick=quick)
        if announce is not None and first:
            self._announce(announce, request, fragments, remote)
        handle = await self._call_agent(submit, quick=quick)
        if announce is not None and not first:
            self._announce(announce, request, fragments, remote)
        await self._await_write(key, self._posted(key, handle, remote, fragments))

    def _submitter(
        self,
        key: int,
        fragments: Fragments,
        request: RequestData,
        plan: SendPlan,
        *,
        summary: SenderSession | None = None,
    ) -> Callable[[], XferHandle]:
        """The agent call that posts the write (on the loop or in a worker thread).
        `summary`: the rank's only write for this session, whose notice says what it moves."""
        remote = self._remote(request)
        if summary is None:
            notice = self.notice(key)
        else:
            notice = self.notice(key, fragments, summary.first_tokens)
        memory_type, device_id = self.destination(plan)

        def submit() -> XferHandle:
            self._stamp(key, "post")
            handle = self.agent.submit_write(
                fragments, remote, notice, dst_memory_type=memory_type, dst_device_id=device_id
            )
            self._stamp(key, "posted")
            return handle

        return submit

    def notice(
        self, key: int, fragments: Fragments | None = None, first_tokens: tuple[int, ...] = ()
    ) -> bytes:
        """The notification payload of a write of `key` from this rank (WRITE_NOTICE); with
        `fragments`, the rank's only write, it also says what the write moves."""
        return encode(self._notice(key, fragments, first_tokens))

    def notice_template(self, key: int, fragments: Fragments) -> NoticeTemplate:
        """`notice(key, fragments, first_tokens)` for first tokens known later (a prepared
        write: the prefill that samples them still runs)."""
        return NoticeTemplate.of(self._notice(key, fragments))

    def _notice(
        self, key: int, fragments: Fragments | None, first_tokens: tuple[int, ...] = ()
    ) -> WriteNotice:
        return WriteNotice(
            key=key,
            instance_name=self.local.instance_name,
            instance_rank=self.local.instance_rank,
            num_bytes=fragments.num_bytes if fragments is not None else 0,
            num_descriptors=len(fragments) if fragments is not None else 0,
            first_tokens=first_tokens,
        )

    @staticmethod
    def destination(plan: SendPlan) -> tuple[str, int]:
        """The agent's `dst_memory_type` and `dst_device_id` for writes to `plan`'s peer."""
        pool = plan.peer.page_table.layer_groups[0].pool
        return pool.memory_type, pool.device_id

    def _posted(self, key: int, handle: XferHandle, remote: str, fragments: Fragments) -> _Posted:
        posted = self.clock()
        expected_s = self._write_rates.expected_s(remote, fragments.num_bytes)
        write = _Posted(
            key=key,
            handle=handle,
            remote=remote,
            num_bytes=fragments.num_bytes,
            num_descriptors=len(fragments),
            posted=posted,
            expected=posted + (expected_s or 0.0),
        )
        self._in_flight[handle] = write  # until `_await_write` has seen it end
        return write

    def _remote(self, request: RequestData) -> str:
        """The agent of the gen rank that sent `request`; TransferLayerError once that gen
        instance was forgotten as gone (transfer/liveness.py): its write fails."""
        remote = self._remote_names.get((request.instance_name, request.instance_rank))
        if remote is None:
            raise _gone(request)
        return remote

    def _plan(self, request: RequestData) -> SendPlan:
        """The send plan of the gen rank that sent `request` (TransferLayerError: gone)."""
        try:
            return self.registrar.send_plan((request.instance_name, request.instance_rank))
        except KeyError:
            raise _gone(request) from None

    async def until_not_writing_to(self, remotes: Sequence[str]) -> None:
        """Until no write to any of `remotes` may still be in flight (see `writing_to`)."""
        while any(self.writing_to(remote) for remote in remotes):
            await self._released.wait()

    def writing_to(self, remote: str) -> bool:
        """Whether a write to the agent `remote` may still be in flight (its handle not yet
        seen ended): the agent must stay loaded until then."""
        ahead = (p for p in self._posted_ahead.values() if isinstance(p, _Posted))
        return any(w.remote == remote for w in (*self._in_flight.values(), *ahead))

    def nudge(self, *, spin: bool = False) -> None:
        """Poll the writes posted within the last SPIN_POLL_S, here and now. The agent sends a
        write's notification from the first poll that finds the write ended (NIXL's UCX
        backend: gen hears nothing before), and a write's own task polls only once the loop is
        back from whoever posted it: on one H200, a write of 128 MiB ends 0.1 ms after its post,
        before the executor's call that posted it has returned. `spin` (just after a post):
        poll a write that should end within DONE_SPIN_MAX_S until it does (pacing.py).
        Synchronous; skipped while a threaded agent call runs (the tasks then poll as before)."""
        if not self._in_flight or self._agent_lock.locked():
            return
        now = self.clock()
        for handle, write in list(self._in_flight.items()):
            if handle in self._ended or now > write.posted + SPIN_POLL_S:
                continue  # ended, or old: its task's polls are paced (polls_every_round)
            until = spins_for_done(now, write.posted, write.expected) if spin else None
            while True:
                try:
                    state = self.agent.poll(handle)
                except TransferLayerError:
                    break  # its task's own poll reports it
                if state is not XferStatus.PENDING:
                    self._ended[handle] = (state, self.clock())
                    if state is XferStatus.DONE:
                        self._stamp(write.key, "done")
                    break
                if until is None or self.clock() > until:
                    break

    async def _await_write(self, key: int, write: _Posted) -> None:
        """Poll a posted write to its end, then hand its handle back (also when cancelled)."""
        handle = write.handle
        try:
            while True:
                state, ended = self._ended.pop(handle, (None, 0.0))
                if state is None:
                    state = await self._call_agent(lambda: self.agent.poll(handle), quick=True)
                    ended = self.clock()
                    if state is XferStatus.DONE:
                        self._stamp(key, "done")  # (`nudge` stamps what it finds)
                if state is XferStatus.DONE:
                    break
                if state is XferStatus.ERROR:
                    raise TransferLayerError(f"agent reported an error writing {key}")
                every_round = polls_every_round(self.clock(), write.posted, write.expected)
                await trio.sleep(0 if every_round else 0.001)
            self._write_rates.learn(write.remote, write.num_bytes, ended - write.posted)
        finally:
            # Shielded: a cancelled write task must still hand its handle back.
            with trio.CancelScope(shield=True):
                try:
                    await self._call_agent(lambda: self.agent.release(handle), quick=True)
                finally:
                    self._in_flight.pop(handle, None)  # released: its remote may go now
                    self._ended.pop(handle, None)
                    self._released.set()
                    self._released = trio.Event()

    def _announce(
        self, session: SenderSession, request: RequestData, fragments: Fragments, remote: str
    ) -> None:
        """WRITE_POSTED to the requesting rank, sent with the post so that it travels while the
        bytes do. The write's notification says the same and suffices, but gen's event loop
        may sleep until a message comes: this one wakes it to watch for the notification. Just
        before a slow post, which may copy a host pool's bytes inside the call, and before a
        quick one whose write is short when gen is not watching for it
        (`WriteRates.announce_first`); just after a quick post otherwise, except for a short
        write that gen watches for, which goes unannounced (`WriteRates.announce_after`). Safe
        before the post: gen counts the write only on its notification, which a write that
        failed to post never sends. On the loop (it may spawn a send)."""
        peer = self.registrar.get((request.instance_name, request.instance_rank))
        if peer is None:
            return
        expected_s = self._write_rates.expected_s(remote, fragments.num_bytes) or 0.0
        message = WritePosted(
            key=session.key,
            instance_name=self.local.instance_name,
            instance_rank=self.local.instance_rank,
            num_bytes=fragments.num_bytes,
            num_descriptors=len(fragments),
            expected_us=round(expected_s * 1e6),
            first_tokens=session.first_tokens,
        )
        self._send_now(peer.control_endpoint, message)

    def tell_prepared(self, key: int, request: RequestData) -> float | None:
        """WRITE_PREPARED to the requesting rank: its write is prepared and goes when the step
        running now ends, so gen watches for the notification from now on. When it was sent
        (None: the rank is gone)."""
        peer = self.registrar.get((request.instance_name, request.instance_rank))
        if peer is None:
            return None
        message = WritePrepared(
            key=key, instance_name=self.local.instance_name, instance_rank=self.local.instance_rank
        )
        self._send_now(peer.control_endpoint, message)
        return self.clock()

    def _send_now(self, endpoint: str, message: Message) -> None:
        """Send `message` from synchronous code: at once on an open dealer with room, else in a
        task (which opens the dealer or waits for room)."""
        dealer = self._dealers.get(endpoint)
        if dealer is not None:
            try:
                dealer.send_message_nowait(message)
                return
            except trio.WouldBlock:
                pass
        self._spawn(self._send, endpoint, message)
