"""Control-plane messages and their one codec. Pure.

Every message is a frozen attrs class; `Message` is their tagged union (tag key `"type"`, values
the protocol's message names such as `"REQUEST_DATA"`). `encode` and `decode` are the only path
between bytes and messages; `decode` raises nothing but `ProtocolError`, whatever the bytes.

    gen rank -> ctx rank 0    REQUEST_INSTANCE_INFO   -> INSTANCE_INFO (every ctx rank's RankInfo)
    gen rank -> each ctx rank REGISTER_PEER (own)     -> REGISTER_ACK (accepted, or refused+reason)
    gen rank -> ctx rank      REQUEST_DATA (key, destination block ids, token count)
    ctx rank -> gen rank      TRANSFER_RESULT (one per REQUEST_DATA, also when 0 bytes moved; the
                              answer to a CANCEL when no write to gen is in flight)
    either   -> either        CANCEL (key)
    ctx agent -> gen agent    WRITE_NOTICE: the agent notification of a write, seen once its
                              bytes landed; it says what the write moved and carries ctx's first
                              tokens, so gen may finish on it before TRANSFER_RESULT comes.
"""

from __future__ import annotations

import enum
import re
import typing
from collections.abc import Sequence
from typing import Any, Final

import attrs
import cattrs
import numpy as np
from cattrs.preconf.msgpack import make_converter
from cattrs.strategies import configure_tagged_union
from cattrs.v import format_exception

from trtdisagg.transfer.errors import ProtocolError
from trtdisagg.transfer.protocol.rank_info import RankInfo

# 7: transfer keys are random 64-bit values (`disaggregated_params.transfer_key`); 8:
# WRITE_NOTICE is msgpack like every other message
PROTOCOL_VERSION: Final = 8
MAX_KEY: Final = 2**64 - 1


def pack_block_ids(block_ids: Sequence[int]) -> bytes:
    return np.asarray(block_ids, dtype="<i8").tobytes()


def unpack_block_ids(data: bytes) -> tuple[int, ...]:
    """Inverse of `pack_block_ids` (RequestData's validator refuses a ragged length)."""
    return tuple(np.frombuffer(data, dtype="<i8").tolist())


_non_negative: Final = attrs.validators.ge(0)
_positive: Final = attrs.validators.gt(0)
_key: Final = attrs.validators.and_(_non_negative, attrs.validators.le(MAX_KEY))


def _token_ids(_inst: object, attr: attrs.Attribute[Any], value: tuple[int, ...]) -> None:
    if any(not 0 <= token < 2**31 for token in value):
        raise ValueError(f"{attr.name} holds a token id outside [0, 2**31): {value}")


def _packed_ids(_inst: object, attr: attrs.Attribute[Any], value: tuple[bytes, ...]) -> None:
    if any(len(ids) % 8 for ids in value):
        raise ValueError(f"{attr.name}: packed block ids must be multiples of 8 bytes")


# TRANSFER_RESULT's error, ERROR status, for a REQUEST_DATA from a gen rank that this ctx does
# not know (never registered, or forgotten as gone: transfer/liveness.py): gen meets the ctx
# instance again at its next request.
NOT_REGISTERED = "not registered with this ctx instance"


class ResultStatus(enum.Enum):
    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"


@attrs.frozen(kw_only=True)
class RequestInstanceInfo:
    protocol_version: int


@attrs.frozen(kw_only=True)
class InstanceInfo:
    protocol_version: int
    ranks: tuple[RankInfo, ...]  # ordered by instance_rank


@attrs.frozen(kw_only=True)
class RegisterPeer:
    info: RankInfo


@attrs.frozen(kw_only=True)
class FromRank:
    """A message that names the rank sending it: a secured control plane checks that against
    the rank its connection proved, and a peer's message touches only that peer's sessions."""

    instance_name: str
    instance_rank: int = attrs.field(validator=_non_negative)

    @property
    def sender(self) -> tuple[str, int]:
        return (self.instance_name, self.instance_rank)


@attrs.frozen(kw_only=True)
class TransferMessage(FromRank):  # ... about one transfer
    key: int = attrs.field(validator=_key)  # the transfer key


@attrs.frozen(kw_only=True)
class RegisterAck(FromRank):
    accepted: bool
    reason: str = ""


@attrs.frozen(kw_only=True)
class RequestData(TransferMessage):
    """`block_ids[g]`: the packed destination block ids of gen's layer group `g`, a suffix of
    the request's blocks `[0, ceil(num_tokens / tokens_per_block))` (a shorter list skips
    blocks gen already has, e.g. from its prefix cache)."""

    block_ids: tuple[bytes, ...] = attrs.field(validator=_packed_ids, repr=False)
    num_tokens: int = attrs.field(validator=_positive)
    # The bounce path (transfer/bounce.py): where in my staging buffer my canonical region is.
    # 0 bytes: write straight into the blocks.
    staging_address: int = attrs.field(default=0, validator=_non_negative)
    staging_bytes: int = attrs.field(default=0, validator=_non_negative)


@attrs.frozen(kw_only=True)
class TransferResult(TransferMessage):
    status: ResultStatus
    num_bytes: int = attrs.field(default=0, validator=_non_negative)
    num_descriptors: int = attrs.field(default=0, validator=_non_negative)
    error: str = ""
    # The request's first generated token(s), from the ctx rank that sampled them (rank 0): a
    # generation_first gen request was posted before ctx had them, and learns them here.
    first_tokens: tuple[int, ...] = attrs.field(default=(), validator=_token_ids)


@attrs.frozen(kw_only=True)
class Cancel(TransferMessage):
    reason: str = ""


@attrs.frozen(kw_only=True)
class WriteNotice(TransferMessage):
    num_bytes: int = attrs.field(default=0, validator=_non_negative)
    num_descriptors: int = attrs.field(default=0, validator=_non_negative)  # 0: no summary
    first_tokens: tuple[int, ...] = attrs.field(default=(), validator=_token_ids)


Message = (
    RequestInstanceInfo | InstanceInfo | RegisterPeer | RegisterAck | RequestData | TransferResult
    | Cancel | WriteNotice
)  # fmt: skip


def sender_of(message: Message) -> tuple[str, int] | None:
    """The (instance_name, instance_rank) that `message` names as its sender, if it names one."""
    if isinstance(message, RegisterPeer):
        return message.info.key
    return message.sender if isinstance(message, FromRank) else None


# each class's name in upper snake case: RequestData -> "REQUEST_DATA"
MESSAGE_TAGS: Final[dict[type, str]] = {
    kind: re.sub(r"(?<!^)(?=[A-Z])", "_", kind.__name__).upper()
    for kind in typing.get_args(Message)
}


def _exactly(value: object, kind: type) -> object:
    """A structure hook that accepts exactly `kind` (no int("5"), no bytes(5), no bool as int)."""
    if type(value) is not kind:
        raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value


_converter: Final = make_converter(forbid_extra_keys=True)
for _scalar in (int, str, bytes, bool):
    _converter.register_structure_hook(_scalar, _exactly)
configure_tagged_union(Message, _converter, tag_generator=MESSAGE_TAGS.__getitem__, tag_name="type")


def encode(message: Message) -> bytes:
    """One message as bytes: a msgpack map with a `"type"` tag."""
    data: bytes = _converter.dumps(message, unstructure_as=Message)
    return data


def decode(data: bytes) -> Message:
    """Bytes from a peer as a message; ProtocolError for anything else (bad msgpack, trailing
    bytes, unknown tag, missing/extra/mistyped fields, failed validation), whatever the input."""
    try:
        # A union is not a `type[T]` to mypy; the tagged-union hook returns one of its members.
        message: Message = _converter.loads(data, Message)  # type: ignore[arg-type]
    except Exception as exc:  # untrusted input: every failure mode of msgpack/cattrs is one error
        why = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, cattrs.BaseValidationError):
            why = "; ".join(cattrs.transform_error(exc, format_exception=_format_leaf))
        raise ProtocolError(f"undecodable message ({len(data)} bytes): {why}") from exc
    return message


def _format_leaf(exc: BaseException, kind: type | None) -> str:
    # A validator's ValueError says what is wrong ("'key' must be >= 0: -1"); keep it.
    if type(exc) is ValueError and kind is None:
        return f"invalid value ({exc})"
    return format_exception(exc, kind)
