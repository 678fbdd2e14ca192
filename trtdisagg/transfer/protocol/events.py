"""What the protocol core (core.py) takes in, events, and gives out, effects: small frozen values
that the driver (runtime/driver.py) makes and carries out. Pure.
"""

from __future__ import annotations

import attrs

from trtdisagg.transfer.protocol.bounce import StagedRun
from trtdisagg.transfer.protocol.fragments import Fragments
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.sessions import SourceBlocks, TransferOutcome
from trtdisagg.transfer.protocol.wire import Message, WriteNotice

# ---- events: the executor's calls (runtime/driver.py names each one) ----


@attrs.frozen(kw_only=True)
class KvReady:  # respond_and_send_async: the KV is in `source`
    key: int
    source: SourceBlocks
    first_tokens: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class SendAbandoned:  # abandon_send: the request ended before its KV was ready
    key: int
    reason: str


@attrs.frozen(kw_only=True)
class ReceiveAsked:  # request_and_receive_async: ask the ctx at `endpoint` for the KV
    key: int
    endpoint: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    ctx_instance: str | None = None


# ---- events: the network, the agent, the driver's own work ----


@attrs.frozen(kw_only=True)
class MessageIn:
    """A control message: on the ROUTER (`reply_to`: the sender's identity; `peer`: the rank it
    proved to be, None on an unsecured control plane) or on the DEALER to `source`."""

    message: Message
    reply_to: bytes | None = None
    source: str = ""
    peer: tuple[str, int] | None = None


@attrs.frozen(kw_only=True)
class NoticeIn:  # a write's notification (its bytes have landed), from the agent `remote`
    notice: WriteNotice
    remote: str = ""


@attrs.frozen(kw_only=True)
class LinkChanged:  # the control connection to `endpoint` came up, or dropped (or was refused)
    endpoint: str
    up: bool


@attrs.frozen(kw_only=True)
class WriteEnded:  # a posted write is over (`error` None: DONE), or could not be posted
    write_id: int
    error: str | None = None


@attrs.frozen(kw_only=True)
class AgentLoaded:  # ctx: a registering gen rank's agent is loaded, or could not be
    info: RankInfo
    reply_to: bytes
    error: str | None = None


@attrs.frozen(kw_only=True)
class StagingReserved:  # gen: staging room for `key` at `offset`, or why there is none
    key: int
    offset: int | None
    error: str = ""


@attrs.frozen(kw_only=True)
class Scattered:  # gen: a bounced receive is copied into its blocks (or the copy failed)
    key: int
    error: str | None = None


@attrs.frozen(kw_only=True)
class Tick:  # time passed: deadlines, probes and stale held messages are looked at
    pass


Event = (
    KvReady | SendAbandoned | ReceiveAsked | MessageIn | NoticeIn | LinkChanged | WriteEnded
    | AgentLoaded | StagingReserved | Scattered | Tick
)  # fmt: skip

# ---- effects ----


@attrs.frozen(kw_only=True)
class Send:  # a control message on the DEALER to a peer rank's endpoint
    endpoint: str
    message: Message


@attrs.frozen(kw_only=True)
class Reply:  # a control message back to whoever sent one on our ROUTER
    reply_to: bytes
    message: Message


@attrs.frozen(kw_only=True)
class Staged:
    """A bounced transfer's share of one layer group's blocks, from `first_token` of a request
    of `num_tokens`: ctx packs `runs` into staging room and writes from it; gen's lands at
    `offset` of its staging buffer and is scattered into the blocks from there."""

    block_ids: tuple[int, ...]
    first_token: int
    num_tokens: int
    num_bytes: int
    runs: tuple[StagedRun, ...] = ()
    offset: int = -1  # (gen: reserved with ReserveStaging)


@attrs.frozen(kw_only=True, eq=False)
class WriteOrder:  # one write of ctx's KV to the gen rank `peer`
    write_id: int
    key: int
    peer: tuple[str, int]
    fragments: Fragments
    dst_memory_type: str
    dst_device_id: int
    deadline: float
    staged: Staged | None = None  # sources are then offsets into the staging room


@attrs.frozen(kw_only=True)
class PostWrite:  # ctx: start `order`
    order: WriteOrder
    notice: bytes  # its notification: made now, since it carries ctx's first tokens


@attrs.frozen(kw_only=True)
class LoadAgent:  # ctx: load a registering gen rank's agent, then say so (AgentLoaded)
    info: RankInfo
    reply_to: bytes


@attrs.frozen(kw_only=True)
class ForgetPeer:  # close the dealers to `endpoints`; unload `instance`'s agents (None: none)
    instance: str | None
    endpoints: tuple[str, ...]


@attrs.frozen(kw_only=True)
class ReserveStaging:  # gen: reserve staging room for `key` by `deadline`, then say so
    key: int
    num_bytes: int
    deadline: float


@attrs.frozen(kw_only=True)
class ReleaseStaging:
    offset: int


@attrs.frozen(kw_only=True)
class ScatterStaged:  # gen: copy `staged` into its blocks, free its room, then say so
    key: int
    staged: Staged


@attrs.frozen(kw_only=True)
class Sent:  # ctx: a send is over, its blocks may be freed (check_context_transfer_status)
    outcome: TransferOutcome


@attrs.frozen(kw_only=True)
class Received:  # gen: a receive is over or failed (check_gen_transfer_status)
    outcome: TransferOutcome


@attrs.frozen(kw_only=True)
class Wake:  # the executor has something to look at
    pass


WAKE = Wake()

Effect = (
    Send | Reply | PostWrite | LoadAgent | ForgetPeer | ReserveStaging | ReleaseStaging
    | ScatterStaged | Sent | Received | Wake
)  # fmt: skip
