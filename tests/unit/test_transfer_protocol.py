"""The transfer protocol core (transfer/protocol/core.py), driven by events alone.

A ctx and a gen `TransferProtocol` talk through `Net`, a test double of the driver: it carries
each Send and Reply to the other side as the messenger would (FIFO; a test may hold messages
back or drop them), answers LoadAgent at once, and makes a posted write land when told
(`land`): ctx gets WriteEnded, gen the write's notification. No sockets, no threads, no clock:
`now` is whatever the test says.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import attrs
import pytest

from tests.rank_infos import make_instance
from trtdisagg.transfer.protocol.core import TransferProtocol
from trtdisagg.transfer.protocol.events import (
    AgentLoaded,
    Effect,
    Event,
    ForgetPeer,
    KvReady,
    LoadAgent,
    MessageIn,
    NoticeIn,
    PostWrite,
    ReceiveAsked,
    Received,
    ReleaseStaging,
    Reply,
    ReserveStaging,
    Send,
    SendAbandoned,
    Sent,
    StagingReserved,
    Tick,
    Wake,
    WriteEnded,
    WriteOrder,
)
from trtdisagg.transfer.protocol.gen import StagingInfo
from trtdisagg.transfer.protocol.liveness import Gone
from trtdisagg.transfer.protocol.rank_info import BounceConfig, RankInfo
from trtdisagg.transfer.protocol.sessions import SourceBlocks, TransferOutcome
from trtdisagg.transfer.protocol.wire import (
    NOT_REGISTERED,
    PROTOCOL_VERSION,
    Cancel,
    InstanceInfo,
    Message,
    RegisterPeer,
    RequestData,
    ResultStatus,
    TransferResult,
    WriteNotice,
    decode,
    pack_block_ids,
)

TIMEOUT = 10.0
TOKENS = 7  # two blocks of 4


def _info(name: str, **changes: object) -> RankInfo:
    (info,) = make_instance(
        instance_name=name, tp_size=1, pp_size=1, layer_num_per_pp=(2,), num_kv_heads=2,
        head_dim=8, tokens_per_block=4, num_slots=16,
    )  # fmt: skip
    endpoint = "tcp://127.0.0.1:2001" if name.startswith("ctx") else "tcp://127.0.0.1:2002"
    return attrs.evolve(info, control_endpoint=endpoint, **changes)


def _source(blocks: tuple[int, ...] = (1, 2)) -> SourceBlocks:
    return SourceBlocks(block_ids=(blocks,), num_tokens=TOKENS)


@attrs.define(eq=False)
class Net:
    ctx: TransferProtocol
    gen: TransferProtocol
    now: float = 0.0
    held: collections.deque[tuple[str, MessageIn]] = attrs.Factory(collections.deque)
    drop: Callable[[str, Message], bool] = lambda to, message: False
    writes: dict[int, WriteOrder] = attrs.Factory(dict)  # posted, not landed
    notices: dict[int, bytes] = attrs.Factory(dict)  # the posted writes' notices, by write id
    sent: list[TransferOutcome] = attrs.Factory(list)
    received: list[TransferOutcome] = attrs.Factory(list)
    forgotten: list[ForgetPeer] = attrs.Factory(list)
    staging: list[ReserveStaging | ReleaseStaging] = attrs.Factory(list)  # gen's staging room
    elsewhere: list[tuple[str, Message]] = attrs.Factory(list)  # sent to a third party
    wakes: int = 0

    @classmethod
    def of(cls, timeout_s: float = TIMEOUT, **gen_changes: object) -> Net:
        ctx_info, gen_info = _info("ctx"), _info("gen", **gen_changes)
        ctx = TransferProtocol(local=ctx_info, instance=(ctx_info,), timeout_s=timeout_s)
        gen = TransferProtocol(local=gen_info, instance=(gen_info,), timeout_s=timeout_s)
        return cls(ctx, gen)

    @classmethod
    def bouncing(cls) -> Net:
        """Both sides bounce every transfer; gen has a staging buffer of 1 MiB at 0x9000."""
        bounce = BounceConfig(size_mb=1, threshold_bytes=1 << 30)
        ctx_info, gen_info = _info("ctx", bounce=bounce), _info("gen", bounce=bounce)
        staging = StagingInfo(address=0x9000, capacity=1 << 20)
        return cls(
            TransferProtocol(local=ctx_info, instance=(ctx_info,), timeout_s=TIMEOUT),
            TransferProtocol(local=gen_info, instance=(gen_info,), timeout_s=TIMEOUT,
                             staging=staging),
        )  # fmt: skip

    def side(self, name: str) -> TransferProtocol:
        return self.ctx if name == "ctx" else self.gen

    def feed(self, name: str, event: Event) -> None:
        self.apply(name, self.side(name).handle(event, self.now))

    def cancel(self, name: str, key: int) -> bool:
        """`cancel_request` on one side, its effects applied: whether the blocks are free."""
        quiescent, out = self.side(name).cancel(key, self.now)
        self.apply(name, out)
        return quiescent

    def apply(self, name: str, effects: list[Effect]) -> None:
        other = "gen" if name == "ctx" else "ctx"
        endpoint = self.side(name).local.control_endpoint
        for effect in effects:
            match effect:
                case Send(endpoint=to, message=message):  # to the other's (secured) router
                    if to != self.side(other).local.control_endpoint:
                        self.elsewhere.append((to, message))
                        continue
                    sender = self.side(name).local.key
                    self._queue(
                        other, MessageIn(message=message, reply_to=name.encode(), peer=sender)
                    )
                case Reply(message=message):  # back on the other's dealer to us
                    self._queue(other, MessageIn(message=message, source=endpoint))
                case LoadAgent(info=info, reply_to=reply_to):
                    self.feed(name, AgentLoaded(info=info, reply_to=reply_to))
                case PostWrite(order=order, notice=notice):
                    self.writes[order.write_id], self.notices[order.write_id] = order, notice
                case Sent(outcome=outcome):
                    self.sent.append(outcome)
                case Received(outcome=outcome):
                    self.received.append(outcome)
                case ForgetPeer():
                    self.forgotten.append(effect)
                case ReserveStaging() | ReleaseStaging():
                    self.staging.append(effect)
                case Wake():
                    self.wakes += 1

    def _queue(self, to: str, event: MessageIn) -> None:
        if not self.drop(to, event.message):
            self.held.append((to, event))

    def deliver(self, count: int | None = None) -> None:
        """Carry held messages (all, or the first `count`), and whatever they cause."""
        while self.held and count != 0:
            to, event = self.held.popleft()
            self.feed(to, event)
            count = None if count is None else count - 1

    def land(self, write_id: int | None = None, *, notice: bool = True) -> WriteOrder:
        """The (only, or given) posted write lands: gen gets its notice, ctx sees it DONE."""
        if write_id is None:
            (write_id,) = self.writes
        order = self.writes.pop(write_id)
        if notice:
            message = decode(self.notices.pop(write_id))
            assert isinstance(message, WriteNotice)
            self.feed("gen", NoticeIn(notice=message, remote=self.ctx.local.agent_name))
        self.feed("ctx", WriteEnded(write_id=write_id))
        return order

    def ask(self, key: int, blocks: tuple[int, ...] = (5, 6)) -> None:
        endpoint = self.ctx.local.control_endpoint
        ask = ReceiveAsked(key=key, endpoint=endpoint, block_ids=(blocks,), num_tokens=TOKENS)
        self.feed("gen", ask)

    def tick(self, now: float) -> None:
        self.now = now
        self.feed("ctx", Tick())
        self.feed("gen", Tick())


def test_context_first_ends_on_the_notice_which_says_what_moved() -> None:
    net = Net.of()
    net.feed("ctx", KvReady(key=7, source=_source(), first_tokens=(42,)))
    net.ask(7)
    net.deliver()  # rendezvous, REQUEST_DATA
    assert net.gen.gen.rendezvous == 1 and len(net.writes) == 1
    # the result is held back: gen finishes on the notice alone
    net.drop = lambda to, message: isinstance(message, TransferResult)
    order = net.land()
    assert order.peer == ("gen", 0) and len(order.fragments) == 1
    (outcome,) = net.received
    assert outcome.ok and outcome.first_tokens == (42,)
    assert outcome.num_bytes == order.fragments.num_bytes and outcome.num_descriptors == 1
    (sent,) = net.sent
    assert sent.ok and sent.key == 7 and net.wakes >= 2
    assert not len(net.ctx.ctx.senders) and not len(net.gen.gen.receivers)


def test_generation_first_holds_the_request_and_writes_once_the_kv_is_ready() -> None:
    net = Net.of()
    net.ask(9)
    net.deliver()
    assert len(net.ctx.ctx.early) == 1 and not net.writes  # held until the KV is ready
    net.tick(TIMEOUT / 2)
    assert len(net.ctx.ctx.early) == 1 and not net.writes and not net.received
    net.feed("ctx", KvReady(key=9, source=_source(), first_tokens=(3,)))
    assert not len(net.ctx.ctx.early)
    (posted,) = net.writes.values()
    assert decode(net.notices[posted.write_id]) == WriteNotice(
        key=9, instance_name="ctx", instance_rank=0, num_bytes=posted.fragments.num_bytes,
        num_descriptors=1, first_tokens=(3,),
    )  # fmt: skip
    net.land()
    assert net.received[0].ok and net.received[0].first_tokens == (3,)


def test_a_refused_registration_fails_every_request_there_naming_both_values() -> None:
    net = Net.of(dtype="bfloat16", element_bytes=2)
    net.ask(1)
    net.deliver()
    net.ask(2)
    net.deliver()
    assert [o.key for o in net.received] == [1, 2]
    for outcome in net.received:
        assert not outcome.ok and outcome.error is not None
        assert "dtype: local 'bfloat16' vs peer 'float32'" in outcome.error
    assert net.gen.gen.rendezvous == 1  # the refusal is kept per endpoint


@pytest.mark.parametrize("listed", [(0,), (1, 0), (0, 0)])
def test_an_instance_info_without_every_rank_in_order_is_refused_and_gen_serves_on(
    listed: tuple[int, ...],
) -> None:
    net = Net.of()
    ranks = make_instance(
        instance_name="ctx", tp_size=2, pp_size=1, layer_num_per_pp=(2,), num_kv_heads=2,
        head_dim=8, tokens_per_block=4, num_slots=16,
    )  # fmt: skip
    endpoint = net.ctx.local.control_endpoint
    forged = tuple(attrs.evolve(ranks[i], control_endpoint=endpoint) for i in listed)
    net.drop = lambda to, message: isinstance(message, InstanceInfo)  # ctx's own answer
    net.ask(1)
    net.deliver()
    info = InstanceInfo(protocol_version=PROTOCOL_VERSION, ranks=forged)
    net.feed("gen", MessageIn(message=info, source=endpoint))
    net.deliver()
    (outcome,) = net.received
    assert not outcome.ok and outcome.error is not None
    assert f"ranks {list(listed)} are not 0..1 of a TP 2 x PP 1 instance" in outcome.error
    assert not net.gen.gen.busy()


# A ctx instance has 5 s to answer, or the transfer's own deadline when that is shorter.
@pytest.mark.parametrize(("timeout_s", "rendezvous_s"), [(TIMEOUT, 5.0), (2.0, 2.0)])
def test_a_rendezvous_without_an_answer_fails_its_requests_and_drops_the_dealer(
    timeout_s: float, rendezvous_s: float
) -> None:
    net = Net.of(timeout_s=timeout_s)
    net.ask(1)
    net.held.clear()  # ctx never answers
    net.tick(rendezvous_s - 0.1)
    assert not net.received
    net.tick(rendezvous_s)
    (outcome,) = net.received
    want = f"cannot reach ctx at tcp://127.0.0.1:2001: no answer in {rendezvous_s:g}s"
    assert want in (outcome.error or "")
    assert net.forgotten == [ForgetPeer(instance=None, endpoints=("tcp://127.0.0.1:2001",))]
    net.ask(2)  # the next request tries again
    assert net.gen.gen.rendezvous == 2


def test_cancel_is_false_on_both_sides_while_the_write_is_in_flight() -> None:
    net = Net.of()
    net.feed("ctx", KvReady(key=3, source=_source()))
    net.ask(3)
    net.deliver()
    assert net.writes
    assert (net.cancel("gen", 3), net.cancel("ctx", 3)) == (False, False)
    net.deliver()
    assert not net.sent and not net.received  # nothing is over while the write may land
    net.land(notice=False)
    net.deliver()
    assert net.sent[0].cancelled and net.received[0].cancelled
    assert net.gen.cancel(3, net.now)[0] is True


def test_a_gen_that_asks_after_ctx_released_the_kv_is_refused_at_once() -> None:
    """The coordinator released ctx's KV (its client left) before gen asked: gen's REQUEST_DATA
    gets an error now, not after the ctx's sweep of messages it held for a session to come."""
    net = Net.of()
    net.feed("ctx", KvReady(key=11, source=_source()))
    quiescent, out = net.ctx.cancel(11, net.now)
    net.apply("ctx", out)
    assert quiescent and not len(net.ctx.ctx.senders)
    net.ask(11)
    net.deliver()
    (refused,) = net.received
    assert not refused.ok and "released" in (refused.error or "")
    assert not len(net.ctx.ctx.early) and not len(net.gen.gen.receivers) and not net.writes
    net.tick(TIMEOUT + 0.1)  # remembered for a transfer timeout: then held as any unknown key
    net.ask(11)
    net.deliver()
    assert len(net.ctx.ctx.early) == 1 and len(net.received) == 1


def test_a_timed_out_receive_is_reported_at_once_and_freed_when_ctx_answers() -> None:
    net = Net.of()
    net.feed("ctx", KvReady(key=4, source=_source()))
    net.ask(4)
    net.deliver()
    net.tick(TIMEOUT + 0.1)  # both deadlines: gen fails, sends CANCEL; ctx's write in flight
    (failed,) = net.received
    assert failed.blocks_held and "timed out" in (failed.error or "")
    assert net.gen.cancel(4, net.now)[0] is False
    net.deliver()  # the CANCEL: ctx answers it with the write's result, when it ends
    assert net.gen.cancel(4, net.now)[0] is False
    net.land(notice=False)
    net.deliver()
    assert net.gen.cancel(4, net.now)[0] is True and net.gen.gen.quarantine_expired == 0
    assert len(net.received) == 1  # told once


def test_a_silent_ctx_is_given_up_on_a_second_timeout_past_the_deadline() -> None:
    net = Net.of()
    net.ask(4)
    net.deliver()
    net.drop = lambda to, message: to == "gen"  # ctx answers nothing any more
    net.tick(TIMEOUT + 0.1)
    assert net.received[0].blocks_held
    net.tick(2 * TIMEOUT - 0.1)
    assert net.gen.cancel(4, net.now)[0] is False
    net.tick(2 * TIMEOUT + 0.1)
    assert net.gen.cancel(4, net.now)[0] is True and net.gen.gen.quarantine_expired == 1


def test_a_cancel_before_the_session_is_answered_and_starts_it_cancelled() -> None:
    net = Net.of()
    net.ask(5)
    net.deliver()
    net.cancel("gen", 5)
    net.deliver()
    assert 5 in net.ctx.ctx.early.cancelled and net.received[0].cancelled
    net.feed("ctx", KvReady(key=5, source=_source()))
    assert net.sent[0].cancelled and not net.writes


def test_an_unregistered_gen_is_refused_at_once_and_meets_ctx_again() -> None:
    net = Net.of()
    net.feed("ctx", KvReady(key=1, source=_source()))
    net.ask(1)
    net.deliver()
    net.land()
    net.deliver()
    net.apply("ctx", net.ctx.forget(Gone("gen", False, "a test"), net.now))
    net.feed("ctx", KvReady(key=2, source=_source()))
    net.ask(2)
    net.deliver()
    refused = net.received[-1]
    assert not refused.ok and NOT_REGISTERED in (refused.error or "")
    net.feed("ctx", KvReady(key=3, source=_source()))
    net.ask(3)
    net.deliver()
    net.land()
    assert net.received[-1].ok and net.gen.gen.rendezvous == 2


def test_a_ctx_that_ended_fails_what_waits_on_it_without_quarantine() -> None:
    net = Net.of()
    net.ask(6)
    net.deliver()
    net.apply("gen", net.gen.forget(Gone("ctx", True, "its connection dropped"), net.now))
    (outcome,) = net.received
    assert not outcome.ok and not outcome.blocks_held
    assert "peer instance ctx is gone: its connection dropped" in (outcome.error or "")
    assert net.gen.cancel(6, net.now)[0] is True


def test_requests_that_wait_for_an_abandoned_ctx_request_are_refused_at_once() -> None:
    net = Net.of()
    net.ask(8)
    net.deliver()
    net.feed("ctx", SendAbandoned(key=8, reason="it was aborted"))
    net.deliver()
    (outcome,) = net.received
    assert "the ctx request ended before its KV was ready: it was aborted" in (outcome.error or "")


def test_a_request_no_session_ever_takes_is_refused_after_the_timeout() -> None:
    net = Net.of()
    net.ask(8)
    net.deliver()
    net.feed("ctx", Tick())
    assert len(net.ctx.ctx.early) == 1
    net.now = TIMEOUT + 0.1
    net.feed("ctx", Tick())  # gen's own deadline has not been looked at: ctx's answer first
    net.deliver()
    (outcome,) = net.received
    assert "timed out" in (outcome.error or "")  # gen's deadline passed as well
    assert 8 not in net.ctx.ctx.early.requests  # (gen's CANCEL is held: a session may come)


def test_a_late_result_of_an_ended_use_of_the_key_is_not_taken_by_the_next() -> None:
    net = Net.of()
    net.feed("ctx", KvReady(key=2, source=_source(), first_tokens=(11,)))
    net.ask(2)
    net.deliver()
    net.land()  # gen ends on the notice; ctx's result is held in the net
    first_result = net.held.pop()
    assert isinstance(first_result[1].message, TransferResult)
    net.feed("ctx", KvReady(key=2, source=_source((3, 4)), first_tokens=(22,)))
    net.ask(2, blocks=(7, 8))
    net.deliver()
    net.feed(*first_result)  # the first use's result comes late
    assert len(net.received) == 1 and net.gen.gen.receivers.get(2) is not None
    net.land()
    assert net.received[-1].first_tokens == (22,)


def test_an_error_result_fails_the_receive_and_a_duplicate_changes_nothing() -> None:
    net = Net.of()
    net.feed("ctx", KvReady(key=2, source=_source()))
    net.ask(2)
    net.deliver()
    (write_id,) = net.writes
    net.feed("ctx", WriteEnded(write_id=write_id, error="the agent reported an error"))
    net.deliver()
    (outcome,) = net.received
    assert not outcome.ok and "ctx rank 0: error" in (outcome.error or "")
    assert not net.sent[0].ok
    result = TransferResult(key=2, instance_name="ctx", instance_rank=0, status=ResultStatus.OK)
    net.feed("gen", MessageIn(message=result, reply_to=b"ctx"))
    assert len(net.received) == 1


@pytest.mark.parametrize("request_first", [True, False])
def test_a_request_overtaken_by_its_cancel_is_dropped(request_first: bool) -> None:
    net = Net.of()
    net.ask(5)
    net.deliver(2)  # INFO and its answer
    net.deliver(2)  # REGISTER_PEER and its ack: REQUEST_DATA is now held in the net
    (request,) = [e for to, e in net.held if isinstance(e.message, RequestData)]
    net.held.clear()
    cancel = Cancel(key=5, instance_name="gen", instance_rank=0)
    events = [MessageIn(message=cancel, reply_to=b"gen"), request]
    for event in events if request_first else events[::-1]:
        net.feed("ctx", event)
    net.feed("ctx", KvReady(key=5, source=_source()))
    assert not net.writes and net.sent[0].cancelled


def test_a_request_whose_kv_never_comes_is_refused_by_ctx_at_the_deadline() -> None:
    net = Net.of()
    net.ask(9)
    net.deliver()
    net.tick(TIMEOUT - 0.1)
    assert len(net.ctx.ctx.early) == 1 and not net.received
    net.now = TIMEOUT  # the prefill that was to produce the KV never ended
    net.feed("ctx", Tick())
    (answer,) = [e.message for to, e in net.held if isinstance(e.message, TransferResult)]
    assert answer.status is ResultStatus.ERROR and answer.key == 9
    assert "no request with transfer key 9" in answer.error
    assert not len(net.ctx.ctx.early) and not net.writes


# ---- who may touch a transfer: the sender a connection proved, the session's owner ----

INTRUDER = "gen-b"  # a second gen instance of the cluster, registered with ctx


def _intruder(net: Net) -> None:
    info = attrs.evolve(_info(INTRUDER), control_endpoint="tcp://127.0.0.1:2003")
    net.feed("ctx", MessageIn(message=RegisterPeer(info=info), reply_to=b"b", peer=info.key))
    net.held.clear()  # (its REGISTER_ACK: it is nobody's dealer here)


def _from_intruder(net: Net, to: str, message: Message) -> None:
    net.feed(to, MessageIn(message=message, reply_to=b"b", peer=(INTRUDER, 0)))


def _request(key: int, name: str = INTRUDER) -> RequestData:
    blocks = (pack_block_ids([9, 10]),)
    return RequestData(key=key, instance_name=name, instance_rank=0, block_ids=blocks,
                       num_tokens=TOKENS)  # fmt: skip


def test_a_message_that_names_another_sender_than_its_connection_is_dropped() -> None:
    net = Net.of()
    _intruder(net)
    net.feed("ctx", KvReady(key=5, source=_source()))
    _from_intruder(net, "ctx", _request(5, name="gen"))  # gen's name, the intruder's key
    assert net.ctx.refusals.counts["impersonation"] == 1
    assert not net.writes and not net.elsewhere and len(net.ctx.ctx.early) == 0


def test_another_gen_instance_can_neither_take_nor_cancel_a_session_bound_to_its_owner() -> None:
    net = Net.of()
    _intruder(net)
    net.feed("ctx", KvReady(key=5, source=_source(), first_tokens=(1,)))
    net.ask(5)
    net.deliver()  # gen's REQUEST_DATA bound the session; its write is posted
    (order,) = net.writes.values()
    _from_intruder(net, "ctx", _request(5))
    _from_intruder(net, "ctx", Cancel(key=5, instance_name=INTRUDER, instance_rank=0))
    assert net.ctx.refusals.counts == {"impersonation": 0, "not_owner": 2, "over_limit": 0}
    assert list(net.writes.values()) == [order] and not net.elsewhere  # nothing for it
    net.land()
    net.deliver()
    assert net.sent[0].ok and net.received[0].ok


def test_a_cancel_of_another_instance_before_the_session_does_not_cancel_it() -> None:
    net = Net.of()
    _intruder(net)
    net.ask(6)
    net.deliver()  # gen's REQUEST_DATA waits at ctx (generation-first)
    _from_intruder(net, "ctx", Cancel(key=6, instance_name=INTRUDER, instance_rank=0))
    ((_, answer),) = net.elsewhere  # every CANCEL is answered, to its sender
    assert isinstance(answer, TransferResult) and answer.status is ResultStatus.CANCELLED
    net.feed("ctx", KvReady(key=6, source=_source(), first_tokens=(2,)))
    net.land()
    net.deliver()
    assert net.sent[0].ok and net.received[0].ok


def test_a_gen_instance_over_its_limit_is_refused_at_once() -> None:
    net = Net.of()
    net.ctx.ctx.max_per_peer = 2
    for key in (1, 2, 3):
        net.ask(key)
    net.deliver()  # three requests wait at ctx for their sessions: room for two
    (refused,) = net.received
    assert refused.key == 3 and not refused.ok
    assert "max_sessions_per_peer 2" in (refused.error or "")
    assert net.ctx.refusals.counts["over_limit"] == 1 and len(net.ctx.ctx.early) == 2


def test_gen_takes_results_cancels_and_notices_only_from_the_ctx_it_asked() -> None:
    net = Net.of()
    net.feed("ctx", KvReady(key=4, source=_source(), first_tokens=(3,)))
    net.ask(4)
    net.deliver()  # ctx's write is under way; gen waits for it
    forged = TransferResult(key=4, instance_name="ctx-b", instance_rank=0,
                            status=ResultStatus.ERROR, error="forged")  # fmt: skip
    for message in (forged, Cancel(key=4, instance_name="ctx-b", instance_rank=0)):
        net.feed("gen", MessageIn(message=message, reply_to=b"x", peer=("ctx-b", 0)))
    in_ctx_name = attrs.evolve(forged, instance_name="ctx")
    net.feed("gen", MessageIn(message=in_ctx_name, reply_to=b"x", peer=("ctx-b", 0)))
    notice = WriteNotice(key=4, instance_name="ctx", instance_rank=0, num_bytes=8,
                         num_descriptors=1, first_tokens=(3,))  # fmt: skip
    net.feed("gen", NoticeIn(notice=notice, remote="ctx-b#0"))  # another agent's
    assert net.gen.refusals.counts == {"impersonation": 2, "not_owner": 2, "over_limit": 0}
    assert not net.received
    net.land()
    net.deliver()
    assert net.received[0].ok and net.received[0].first_tokens == (3,)


def test_a_receive_cancelled_during_the_rendezvous_ends_at_once_and_asks_nothing() -> None:
    net = Net.of()
    net.ask(6)
    assert net.gen.gen.meeting()
    assert net.cancel("gen", 6) and net.received[0].cancelled and net.received[0].key == 6
    net.deliver()  # the rendezvous completes; nothing is asked of ctx
    assert not net.gen.gen.meeting() and not len(net.ctx.ctx.early) and len(net.received) == 1


def test_a_bounced_receive_asks_ctx_once_its_staging_room_is_reserved() -> None:
    net = Net.bouncing()
    net.ask(4)
    net.deliver()  # the rendezvous; gen reserves its room before it asks
    (reserve,) = net.staging
    assert isinstance(reserve, ReserveStaging) and reserve.key == 4 and not net.held
    net.feed("gen", StagingReserved(key=4, offset=512))
    ((_, request),) = net.held
    assert isinstance(request.message, RequestData)
    assert request.message.staging_address == 0x9000 + 512
    assert request.message.staging_bytes == reserve.num_bytes


def test_a_bounced_receive_cancelled_while_its_room_is_reserved_frees_it_and_asks_nothing() -> None:
    net = Net.bouncing()
    net.ask(4)
    net.deliver()
    assert net.cancel("gen", 4) and not net.received  # told once the reservation is over
    net.feed("gen", StagingReserved(key=4, offset=512))
    assert net.staging[1:] == [ReleaseStaging(offset=512)]
    assert net.received[0].cancelled and not net.held  # no REQUEST_DATA went out


def test_a_bounced_receive_without_staging_room_fails_with_why() -> None:
    net = Net.bouncing()
    net.ask(4)
    net.deliver()
    net.feed("gen", StagingReserved(key=4, offset=None, error="no room before the deadline"))
    (outcome,) = net.received
    assert not outcome.ok and outcome.error == "no room before the deadline"
    assert net.staging[1:] == [] and not net.held
