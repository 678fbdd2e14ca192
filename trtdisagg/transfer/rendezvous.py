"""gen's rendezvous with ctx instances (part of the KvTransceiver shell, transfer/transceiver.py).

First contact with a `ctx_info_endpoint` runs the rendezvous: REQUEST_INSTANCE_INFO to the
endpoint, then REGISTER_PEER to every ctx rank it names. The result, or the refusal, is cached
per endpoint (`CtxPeers`); a failure that may be transient is not, and the next request tries
again. Replies come back on the dealers and are routed here by the transceiver's dispatch
(`CtxPeers.deliver`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

import attrs
import trio

from trtdisagg.transfer.errors import PeerIncompatible, TransferLayerError
from trtdisagg.transfer.protocol.peers import PeerRegistrar
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.wire import (
    PROTOCOL_VERSION,
    InstanceInfo,
    Message,
    RegisterAck,
    RegisterPeer,
    RequestInstanceInfo,
)

log = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 5.0


@attrs.define(eq=False, kw_only=True)
class _CtxPeer:
    """What gen knows about one ctx instance, reached at its info endpoint."""

    ranks: tuple[RankInfo, ...] = ()
    refusal: str | None = None
    ready: trio.Event = attrs.Factory(trio.Event)
    instance_name: str | None = None  # the instance that answered, refused or not


@attrs.frozen(kw_only=True)
class _Slot:
    """Where a rendezvous reply is awaited: the dealer's endpoint and what it answers."""

    endpoint: str
    kind: str
    instance_name: str = ""
    instance_rank: int = 0


@attrs.define(eq=False, kw_only=True)
class CtxPeers:
    """gen: the ctx instances met so far, by info endpoint, and the rendezvous that meets them."""

    local: RankInfo
    registrar: PeerRegistrar
    _send: Callable[[str, Message], Awaitable[None]]  # on the dealer to an endpoint
    _drop_dealer: Callable[[str], None]
    _met: Callable[[tuple[RankInfo, ...]], Awaitable[None]]  # a ctx instance accepted us
    _replaced: Callable[[tuple[RankInfo, ...]], None]  # ... and was replaced by another
    rendezvous_count: int = 0
    _ctx_peers: dict[str, _CtxPeer] = attrs.Factory(dict)
    _replies: dict[_Slot, trio.MemorySendChannel[Message]] = attrs.Factory(dict)

    def met(self, endpoint: str) -> tuple[RankInfo, ...] | None:
        """The ranks of the ctx instance at `endpoint` when it was met and accepted before (the
        usual case); None when a rendezvous is needed, under way, or was refused."""
        peer = self._ctx_peers.get(endpoint)
        if peer is None or not peer.ready.is_set() or peer.refusal is not None or not peer.ranks:
            return None
        return peer.ranks

    def forget_replaced(self, endpoint: str, instance: str) -> None:
        """Drop what is cached for `endpoint` when it belongs to another ctx instance than
        `instance`; the next request meets the endpoint again. Receives already under way keep
        their sessions (they are keyed by instance) and end as they would have."""
        peer = self._ctx_peers.get(endpoint)
        if peer is None or not peer.ready.is_set() or peer.instance_name in (None, instance):
            return
        log.info(
            "ctx at %s is now instance %s (was %s): meeting it again",
            endpoint,
            instance,
            peer.instance_name,
        )
        del self._ctx_peers[endpoint]
        self._replaced(peer.ranks)

    def forget_instance(self, instance: str, *, rank_endpoint: str = "") -> tuple[RankInfo, ...]:
        """Drop what is cached for the ctx instance `instance` (gone, or it forgot us), and for
        whichever instance was met with a rank at `rank_endpoint` (the one that just said it
        does not know us: it may have replaced the instance we met there). The next request to
        such an endpoint meets whatever answers there. The ranks dropped, as met."""
        ranks: tuple[RankInfo, ...] = ()
        for endpoint, peer in list(self._ctx_peers.items()):
            there = bool(rank_endpoint) and any(
                info.control_endpoint == rank_endpoint for info in peer.ranks
            )
            if peer.ready.is_set() and (peer.instance_name == instance or there):
                del self._ctx_peers[endpoint]
                ranks += peer.ranks
        return ranks

    async def ensure_ctx_peer(self, endpoint: str) -> tuple[RankInfo, ...]:
        """Rendezvous with the ctx instance at `endpoint` once; cached, refusal included."""
        peer = self._ctx_peers.get(endpoint)
        if peer is not None and peer.ready.is_set() and peer.refusal is None and peer.ranks:
            return peer.ranks  # the usual case: no scheduling round on a request's way out
        if peer is None:
            peer = self._ctx_peers[endpoint] = _CtxPeer()
            try:
                with trio.fail_after(RENDEZVOUS_TIMEOUT_S):
                    peer.ranks = await self._rendezvous(endpoint)
            except PeerIncompatible as exc:
                peer.refusal = str(exc)
                # Once per endpoint; every later request to it fails fast with this message.
                log.warning("refused ctx instance at %s: %s", endpoint, exc)
            except BaseException:
                del self._ctx_peers[endpoint]  # transient: the next request tries again
                # A dead or forged endpoint must not keep a reconnecting socket (and its file
                # descriptor) forever; the next attempt opens a fresh one.
                self._drop_dealer(endpoint)
                peer.ready.set()
                raise
            finally:
                peer.ready.set()
        await peer.ready.wait()
        if peer.refusal is not None:
            raise PeerIncompatible(endpoint, peer.refusal)
        if not peer.ranks:
            raise TransferLayerError(f"rendezvous with {endpoint} failed")
        return peer.ranks

    async def _rendezvous(self, endpoint: str) -> tuple[RankInfo, ...]:
        self.rendezvous_count += 1
        reply = await self._request(
            endpoint,
            RequestInstanceInfo(protocol_version=PROTOCOL_VERSION),
            _Slot(endpoint=endpoint, kind="INFO"),
        )
        if not isinstance(reply, InstanceInfo) or not reply.ranks:
            raise TransferLayerError(f"{endpoint} answered {type(reply).__name__}, no RankInfo")
        peer = self._ctx_peers.get(endpoint)
        if peer is not None:
            peer.instance_name = reply.ranks[0].instance_name
        for info in reply.ranks:
            self.registrar.register(info)  # compatibility gate on our side
        for info in reply.ranks:
            ack = await self._request(
                info.control_endpoint,
                RegisterPeer(info=self.local),
                _Slot(
                    endpoint=info.control_endpoint,
                    kind="ACK",
                    instance_name=info.instance_name,
                    instance_rank=info.instance_rank,
                ),
            )
            if not isinstance(ack, RegisterAck) or not ack.accepted:
                reason = ack.reason if isinstance(ack, RegisterAck) else "no acknowledgement"
                raise PeerIncompatible(info.label, reason)
        await self._met(reply.ranks)
        log.info(
            "registered with ctx instance %s at %s (%d ranks)",
            reply.ranks[0].instance_name,
            endpoint,
            len(reply.ranks),
        )
        return reply.ranks

    async def _request(self, endpoint: str, message: Message, slot: _Slot) -> Message:
        """Send `message` on the dealer to `endpoint`; wait for the reply filed under `slot`."""
        send, receive = trio.open_memory_channel[Message](1)
        self._replies[slot] = send
        try:
            await self._send(endpoint, message)
            return await receive.receive()
        finally:
            self._replies.pop(slot, None)

    def deliver(self, message: InstanceInfo | RegisterAck, source: str) -> None:
        """A rendezvous reply that came on the dealer to `source`: to whoever awaits it."""
        if isinstance(message, InstanceInfo):
            slot = _Slot(endpoint=source, kind="INFO")
        else:
            slot = _Slot(
                endpoint=source,
                kind="ACK",
                instance_name=message.instance_name,
                instance_rank=message.instance_rank,
            )
        channel = self._replies.get(slot)
        if channel is not None:
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
                channel.send_nowait(message)
