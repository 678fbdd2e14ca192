"""What the transfer protocol core takes in (events) and gives out (effects). Pure.

The driver (runtime/driver.py) turns whatever happens to one rank into an event: an executor
call, a control message, a write's notification, a write that ended, a link that dropped, the
clock's tick. `TransferProtocol.handle(event, now)` (core.py) answers with the effects to carry
out, in order: a message to send, a write to prepare or post, an agent to load, staging room to
reserve, an outcome for the executor, a wake-up. Every type here is a small frozen value.
"""

from __future__ import annotations

import attrs

from trtdisagg.transfer.protocol.bounce import StagedRun
from trtdisagg.transfer.protocol.fragments import Fragments
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.sessions import SourceBlocks, TransferOutcome
from trtdisagg.transfer.protocol.wire import Message, WriteNotice

# ---- events: the executor's calls ----


@attrs.frozen(kw_only=True)
class KvExpected:
    """ctx: `key`'s KV will be in `source` once the step now starting ends (`prepare_send`)."""

    key: int
    source: SourceBlocks


@attrs.frozen(kw_only=True)
class KvReady:
    """ctx: `key`'s KV is in `source`; write it to whoever asks (`respond_and_send_async`)."""

    key: int
    source: SourceBlocks
    first_tokens: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class SendAbandoned:
    """ctx: `key`'s request ended before its KV was ready (`abandon_send`)."""

    key: int
    reason: str


@attrs.frozen(kw_only=True)
class ReceiveAsked:
    """gen: blocks are allocated for `key`; ask the ctx at `endpoint` for the KV."""

    key: int
    endpoint: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    ctx_instance: str | None = None


@attrs.frozen(kw_only=True)
class TransferCancelled:
    """Either side: stop transfer `key` (`cancel_request`)."""

    key: int


# ---- events: the network, the agent, the driver's own work ----


@attrs.frozen(kw_only=True)
class MessageIn:
    """A control message: on the ROUTER (`reply_to`: the sender's identity) or on the DEALER to
    `source` (an endpoint)."""

    message: Message
    reply_to: bytes | None = None
    source: str = ""


@attrs.frozen(kw_only=True)
class NoticeIn:
    """A write's notification: its bytes have landed here."""

    notice: WriteNotice


@attrs.frozen(kw_only=True)
class LinkChanged:
    """The control connection to `endpoint` came up, or dropped (or was refused)."""

    endpoint: str
    up: bool


@attrs.frozen(kw_only=True)
class WriteEnded:
    """A posted write reached a final state (`error` None: DONE), or could not be posted."""

    write_id: int
    error: str | None = None


@attrs.frozen(kw_only=True)
class AgentLoaded:
    """ctx: the agent of a registering gen rank is loaded, or could not be (`error`)."""

    info: RankInfo
    reply_to: bytes
    error: str | None = None


@attrs.frozen(kw_only=True)
class StagingReserved:
    """gen: room in the staging buffer for `key` (`offset`), or why there is none."""

    key: int
    offset: int | None
    error: str = ""


@attrs.frozen(kw_only=True)
class Scattered:
    """gen: a bounced receive's staged KV is copied into its blocks (or the copy failed)."""

    key: int
    error: str | None = None


@attrs.frozen(kw_only=True)
class Tick:
    """Time passed: deadlines, probes and stale held messages are looked at."""


Event = (
    KvExpected
    | KvReady
    | SendAbandoned
    | ReceiveAsked
    | TransferCancelled
    | MessageIn
    | NoticeIn
    | LinkChanged
    | WriteEnded
    | AgentLoaded
    | StagingReserved
    | Scattered
    | Tick
)

# ---- effects ----


@attrs.frozen(kw_only=True)
class Send:
    """A control message to a peer rank's endpoint (on the DEALER to it)."""

    endpoint: str
    message: Message


@attrs.frozen(kw_only=True)
class Reply:
    """A control message back to whoever sent one on our ROUTER."""

    reply_to: bytes
    message: Message


@attrs.frozen(kw_only=True)
class StagedSend:
    """ctx, bounce path: pack `runs` of `block_ids` into this rank's staging room first; the
    write's fragments read from that room (their sources are offsets into it)."""

    runs: tuple[StagedRun, ...]
    block_ids: tuple[int, ...]
    first_token: int
    num_tokens: int
    num_bytes: int


@attrs.frozen(kw_only=True, eq=False)
class WriteOrder:
    """One write of ctx's KV to a gen rank, whose notification is `notice`."""

    write_id: int
    key: int
    peer: tuple[str, int]  # the gen rank written to: its agent, and where its result goes
    fragments: Fragments
    notice: bytes
    dst_memory_type: str
    dst_device_id: int
    deadline: float
    staged: StagedSend | None = None


@attrs.frozen(kw_only=True)
class PrepareWrite:
    """ctx: have the agent prepare `order` now; it is posted (or released) later."""

    order: WriteOrder


@attrs.frozen(kw_only=True)
class PostWrite:
    """ctx: start `order` (from its preparation, when one was made under its id)."""

    order: WriteOrder


@attrs.frozen(kw_only=True)
class ReleasePrepared:
    """ctx: the write prepared under `write_id` will never be posted."""

    write_id: int


@attrs.frozen(kw_only=True)
class LoadAgent:
    """ctx: load a registering gen rank's agent, then say so (AgentLoaded)."""

    info: RankInfo
    reply_to: bytes


@attrs.frozen(kw_only=True)
class ForgetPeer:
    """Close the dealers to `endpoints`; `instance` (None: no instance was met there) is gone,
    so unload its agents once no write to them is in flight."""

    instance: str | None
    endpoints: tuple[str, ...]


@attrs.frozen(kw_only=True)
class ReserveStaging:
    """gen: reserve `num_bytes` of the staging buffer for `key` by `deadline`, then say so."""

    key: int
    num_bytes: int
    deadline: float


@attrs.frozen(kw_only=True)
class ReleaseStaging:
    offset: int


@attrs.frozen(kw_only=True)
class StagedReceive:
    """gen: where a bouncing receive lands in staging, and where it goes afterwards."""

    offset: int
    num_bytes: int
    block_ids: tuple[int, ...]
    first_token: int
    num_tokens: int


@attrs.frozen(kw_only=True)
class ScatterStaged:
    """gen: copy `staged` into its blocks, free its room, then say so (Scattered)."""

    key: int
    staged: StagedReceive


@attrs.frozen(kw_only=True)
class Sent:
    """ctx: a send is over and its blocks may be freed: for `check_context_transfer_status`."""

    outcome: TransferOutcome


@attrs.frozen(kw_only=True)
class Received:
    """gen: a receive is over (or failed, `blocks_held`): for `check_gen_transfer_status`."""

    outcome: TransferOutcome


@attrs.frozen(kw_only=True)
class Wake:
    """The executor has something to look at."""


WAKE = Wake()


Effect = (
    Send
    | Reply
    | PrepareWrite
    | PostWrite
    | ReleasePrepared
    | LoadAgent
    | ForgetPeer
    | ReserveStaging
    | ReleaseStaging
    | ScatterStaged
    | Sent
    | Received
    | Wake
)
