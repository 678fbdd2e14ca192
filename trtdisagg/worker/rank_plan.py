"""What rank 0 tells the other ranks of a multi-rank instance each step, and what they answer.

Only rank 0 schedules. Every step it broadcasts one `StepCommand`: the forward's inputs (each
scheduled request's new tokens, first position and block ids) plus the transfer work it decided
(sends and receives to start, cancels). Every rank applies the same command to its own shard,
so no rank needs scheduler state or Request objects.

Each rank then answers with a `RankReport`: the transfers its own transceiver finished (and, with
test hooks, digests of the KV it moved). A request changes transfer state only when every rank
has reported it (`OutcomeGate`): success is the intersection, failure and cancellation the
union. Pure: no torch, trio or sockets.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Iterable, Sequence

import attrs

from trtdisagg.kv.block_pool import BlockCopy
from trtdisagg.transfer.protocol.sessions import TransferOutcome


@attrs.frozen(kw_only=True)
class ItemInputs:
    """One request's part of a step: tokens [start, start + len(token_ids)) in `block_ids`."""

    request_id: int
    token_ids: tuple[int, ...]
    start: int
    block_ids: tuple[int, ...]
    samples: bool
    # Prompt logprobs (`SamplingParams.prompt_logprobs`): this many top tokens each (None:
    # none), and the prompt token each position of the chunk predicts, from the first on.
    prompt_logprobs: int | None = None
    prompt_targets: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def num_extra_rows(self) -> int:
        """Logits rows it needs besides its last position's: its other positions that predict
        a prompt token (the last one predicts one too unless the chunk samples)."""
        if self.prompt_logprobs is None or not self.prompt_targets:
            return 0
        return len(self.prompt_targets) - (0 if self.samples else 1)


def logit_rows(items: Sequence[ItemInputs]) -> int:
    """Rows of a step's logits: each item's last position, then every item's extra rows."""
    return len(items) + sum(item.num_extra_rows for item in items)


@attrs.frozen(kw_only=True)
class SendCommand:
    """ctx: `key`'s prompt KV is pinned in `block_ids`; serve gen's REQUEST_DATA for it."""

    key: int
    block_ids: tuple[int, ...]
    num_tokens: int
    first_tokens: tuple[int, ...] = ()  # sent with every rank's result (generation_first)


@attrs.frozen(kw_only=True)
class ReceiveCommand:
    """gen: ask the ctx instance at `endpoint` to write `key`'s KV into `block_ids`."""

    key: int
    endpoint: str
    block_ids: tuple[int, ...]
    num_tokens: int
    ctx_instance: str | None = None  # the ctx instance rank 0 was told of (http/handoff.py)


@attrs.frozen(kw_only=True)
class StepCommand:
    items: tuple[ItemInputs, ...] = ()
    copies: tuple[BlockCopy, ...] = ()  # forks' copy-on-write, made before the forward
    sends: tuple[SendCommand, ...] = ()
    receives: tuple[ReceiveCommand, ...] = ()
    cancels: tuple[int, ...] = ()  # transfer keys; applied after this step's sends/receives
    stop: bool = False  # the instance is shutting down: leave the loop

    @property
    def has_forward(self) -> bool:
        return bool(self.items)

    @property
    def num_tokens(self) -> int:
        return sum(len(item.token_ids) for item in self.items)


class Side(enum.Enum):
    SEND = "send"
    RECEIVE = "receive"


@attrs.frozen(kw_only=True)
class RankOutcome:
    """One rank's final state of one transfer, on the ctx (SEND) or gen (RECEIVE) side."""

    side: Side
    outcome: TransferOutcome


@attrs.frozen(kw_only=True)
class WriteRecord:
    """One KV write a follower rank finished: what its ctx metrics would have counted."""

    num_bytes: int
    num_descriptors: int
    seconds: float
    peer: str  # the gen rank written to, "instance#rank"


@attrs.frozen(kw_only=True)
class HeadDigest:
    """sha256 of one (global layer, global kv head)'s K and V bytes of one transfer."""

    layer: int
    head: int
    digest: str


@attrs.frozen(kw_only=True)
class RankDigest:
    key: int
    parts: tuple[HeadDigest, ...]


@attrs.frozen(kw_only=True)
class RankReport:
    rank: int
    outcomes: tuple[RankOutcome, ...] = ()
    digests: tuple[RankDigest, ...] = ()
    # Writes since the last report: rank 0 exports every rank's bytes, not only its own.
    writes: tuple[WriteRecord, ...] = ()


def step_items(
    items: Iterable[tuple[int, tuple[int, ...], int, tuple[int, ...], bool]],
    tokens_per_block: int,
) -> tuple[ItemInputs, ...]:
    """Build the step's inputs from (request_id, new tokens, start, blocks, samples).

    Only the blocks the step can touch travel: those holding tokens [0, start + new).
    """
    built = []
    for request_id, new_tokens, start, blocks, samples in items:
        end = start + len(new_tokens)
        needed = math.ceil(end / tokens_per_block)
        if len(blocks) < needed:
            raise ValueError(
                f"request {request_id}: {len(blocks)} blocks cannot hold {end} tokens "
                f"of {tokens_per_block} per block"
            )
        built.append(
            ItemInputs(
                request_id=request_id,
                token_ids=new_tokens,
                start=start,
                block_ids=blocks[:needed],
                samples=samples,
            )
        )
    return tuple(built)


def merge_outcomes(outcomes: Iterable[TransferOutcome]) -> TransferOutcome:
    """Every rank's outcome of one transfer, as the instance's: ok only if all are; cancelled
    or failed if any is; bytes and descriptors summed; the slowest rank's time."""
    parts = list(outcomes)
    if not parts:
        raise ValueError("no outcomes to merge")
    errors = [p.error for p in parts if p.error]
    return TransferOutcome(
        key=parts[0].key,
        ok=all(p.ok for p in parts),
        cancelled=any(p.cancelled for p in parts),
        error="; ".join(dict.fromkeys(errors)) or None,
        num_bytes=sum(p.num_bytes for p in parts),
        num_descriptors=sum(p.num_descriptors for p in parts),
        seconds=max(p.seconds for p in parts),
        first_tokens=next((p.first_tokens for p in parts if p.first_tokens), ()),
        blocks_held=any(p.blocks_held for p in parts),
    )


@attrs.define(kw_only=True)
class OutcomeGate:
    """Holds each transfer's per-rank outcomes until every rank of the instance has one."""

    world_size: int
    _pending: dict[tuple[Side, int], dict[int, TransferOutcome]] = attrs.field(
        factory=dict, alias="pending"
    )
    _told: set[tuple[Side, int]] = attrs.field(factory=set, alias="told")

    def add(self, rank: int, reported: RankOutcome) -> RankOutcome | None:
        """File `rank`'s outcome; the merged outcome once all ranks have one, else None.

        A rank reporting the same transfer twice is a bug upstream, not a peer's doing: raise.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside an instance of {self.world_size} ranks")
        side, outcome = reported.side, reported.outcome
        slot = self._pending.setdefault((side, outcome.key), {})
        if rank in slot:
            raise ValueError(f"rank {rank} reported {side.value} {outcome.key} twice")
        slot[rank] = outcome
        if len(slot) < self.world_size:
            return None
        del self._pending[(side, outcome.key)]
        self._told.discard((side, outcome.key))
        return RankOutcome(side=side, outcome=merge_outcomes(slot[r] for r in sorted(slot)))

    def newly_failed(self, side: Side, key: int) -> bool:
        """True once per pending transfer that some rank failed: time to stop the others."""
        slot = self._pending.get((side, key), {})
        if (side, key) in self._told or all(o.ok for o in slot.values()):
            return False
        self._told.add((side, key))
        return True

    def __len__(self) -> int:
        return len(self._pending)


def compose_digest(parts: Iterable[HeadDigest]) -> str:
    """One digest of a transfer's whole KV from every rank's (layer, head) digests.

    Ranks that hold a duplicated head (kv heads < TP) report it more than once; the copies must
    agree, or the digest says so. Independent of how the instance is cut: TP1 and TP2 holding
    the same bytes compose the same digest.
    """
    by_slot: dict[tuple[int, int], str] = {}
    for part in parts:
        seen = by_slot.setdefault((part.layer, part.head), part.digest)
        if seen != part.digest:
            return f"mismatch:layer{part.layer}:head{part.head}"
    digest = hashlib.sha256()
    for slot in sorted(by_slot):
        digest.update(f"{slot[0]}:{slot[1]}:{by_slot[slot]};".encode())
    return digest.hexdigest()
