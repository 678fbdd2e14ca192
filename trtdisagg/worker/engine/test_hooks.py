"""Test-only hooks, wrapped around the engine's edges: exact KV digests; failed model steps.

Built only with `enable_test_hooks` (the TRTDISAGG_TEST_HOOKS=1 environment variable), never in
production, and never by the loop: the builder wraps the runner and the transceivers with them.

KV digests (`GET /debug/kv_digests`): each rank's transceiver is wrapped (`DigestingTransceiver`).
ctx digests a request's prompt KV as it starts the send; gen digests the same token range when its
receive reports the KV landed, before decoding writes anything. A test compares the two for the
same transfer key: equal digests mean equal bytes. The digest is independent of layout and of how
an instance is cut: each rank hashes every (global layer, global kv head) it holds, followers
report theirs with their step reports, and rank 0 composes the instance's digest once every rank's
parts are in (`rank_plan.compose_digest`). So a TP1 ctx and a TP2 or PP2 gen holding the same
bytes give the same digest.

Failed model steps (`POST /debug/step_failures`): the runner of a one-rank worker is wrapped
(`FaultyRunner`): the next N steps raise `InjectedStepFailure` in the step's worker thread, where
a real failure (a CUDA error, a sampling bug) would, so a test sees exactly what such a failure
does to requests.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs
import torch

from trtdisagg.kv.cache import KVCache
from trtdisagg.transfer.protocol.sessions import TransferOutcome
from trtdisagg.worker.engine.ports import Transceiver
from trtdisagg.worker.rank_plan import HeadDigest, RankDigest, RankReport, compose_digest

if TYPE_CHECKING:
    from trtdisagg.worker.engine.local import StepRunner
    from trtdisagg.worker.launched import LaunchedStep, StepOutput
    from trtdisagg.worker.sampling import SampleSpec
    from trtdisagg.worker.scheduler import StepPlan
    from trtdisagg.worker.step_inputs import StepInputs

MAX_DIGESTS = 4096


class InjectedStepFailure(RuntimeError):
    """A model step failed on purpose (test hooks only)."""


def head_digests(
    cache: KVCache,
    *,
    layer_ids: Sequence[int],
    head_ids: Sequence[int],
    block_ids: Sequence[int],
    num_tokens: int,
) -> tuple[HeadDigest, ...]:
    """sha256 of K then V of tokens [0, num_tokens) for every local (layer, kv head).

    `layer_ids` and `head_ids` are the global ids of the pool's local layers and heads.
    """
    blocks = torch.tensor(list(block_ids), dtype=torch.long, device=cache.pool.device)
    parts = []
    for local_layer, layer in enumerate(layer_ids):
        keys, values = cache.gather(local_layer, blocks, num_tokens)  # [H, T, D] each
        for local_head, head in enumerate(head_ids):
            digest = hashlib.sha256()
            for part in (keys[local_head], values[local_head]):
                digest.update(part.contiguous().view(torch.uint8).cpu().numpy().tobytes())
            parts.append(HeadDigest(layer=layer, head=head, digest=digest.hexdigest()))
    return tuple(parts)


@attrs.define(eq=False, kw_only=True)
class TestHooks:
    """Rank 0's test hooks: the digests a test reads, and the step failures it armed."""

    __test__ = False  # not a pytest class

    world_size: int = 1  # ranks whose parts make one digest
    digests: collections.OrderedDict[int, str] = attrs.Factory(collections.OrderedDict)
    step_failures: int = 0  # model steps still to fail on purpose
    _parts: collections.OrderedDict[int, dict[int, tuple[HeadDigest, ...]]] = attrs.field(
        factory=collections.OrderedDict, alias="parts"
    )

    def take_step_failure(self) -> bool:
        """Whether the step about to run must fail; uses up one armed failure if so."""
        if self.step_failures <= 0:
            return False
        self.step_failures -= 1
        return True

    def add_parts(self, rank: int, key: int, parts: Iterable[HeadDigest]) -> None:
        """One rank's digests of transfer `key`; the digest is stored once every rank's are in."""
        slot = self._parts.setdefault(key, {})
        slot[rank] = tuple(parts)
        if len(slot) == self.world_size:
            del self._parts[key]
            self.store(key, [part for rank_parts in slot.values() for part in rank_parts])
        while len(self._parts) > MAX_DIGESTS:
            self._parts.popitem(last=False)

    def take_reports(self, reports: Iterable[RankReport]) -> None:
        """The followers' digests, from a tick's reports (rank 0 adds its own as it digests)."""
        for report in reports:
            for rank_digest in report.digests:
                self.add_parts(report.rank, rank_digest.key, rank_digest.parts)

    def store(self, key: int, parts: Iterable[HeadDigest]) -> None:
        self.digests[key] = compose_digest(parts)
        while len(self.digests) > MAX_DIGESTS:
            self.digests.popitem(last=False)


@attrs.define(eq=False, kw_only=True)
class DigestBuffer:
    """A follower rank's digests, until its next report takes them."""

    _pending: list[RankDigest] = attrs.field(factory=list, alias="pending")

    def add(self, key: int, parts: tuple[HeadDigest, ...]) -> None:
        self._pending.append(RankDigest(key=key, parts=parts))

    def take(self) -> tuple[RankDigest, ...]:
        taken = tuple(self._pending)
        self._pending.clear()
        return taken


class _Record(Protocol):
    def __call__(self, key: int, parts: tuple[HeadDigest, ...]) -> None: ...


@attrs.define(eq=False, kw_only=True)
class DigestingTransceiver:
    """A rank's transceiver, digesting the KV it sends and the KV it received (test hooks)."""

    inner: Transceiver
    cache: KVCache
    layer_ids: tuple[int, ...]  # this rank's global layer ids, in pool order
    head_ids: tuple[int, ...]  # this rank's global kv head ids, in pool order
    record: _Record  # where this rank's digests go (rank 0: `TestHooks`; a follower: its report)
    _receiving: collections.OrderedDict[int, tuple[list[int], int]] = attrs.field(
        factory=collections.OrderedDict, alias="receiving"
    )

    def _digest(self, key: int, block_ids: Sequence[Sequence[int]], num_tokens: int) -> None:
        parts = head_digests(
            self.cache,
            layer_ids=self.layer_ids,
            head_ids=self.head_ids,
            block_ids=block_ids[0],
            num_tokens=num_tokens,
        )
        self.record(key, parts)

    def respond_and_send_async(
        self,
        key: int,
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        first_tokens: Sequence[int] = (),
    ) -> None:
        self._digest(key, block_ids, num_tokens)
        self.inner.respond_and_send_async(key, block_ids, num_tokens, first_tokens)

    def request_and_receive_async(
        self,
        key: int,
        ctx_info_endpoint: str,
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        *,
        ctx_instance: str | None = None,
    ) -> None:
        self._receiving[key] = (list(block_ids[0]), num_tokens)
        while len(self._receiving) > MAX_DIGESTS:  # receives cancelled before they started
            self._receiving.popitem(last=False)
        self.inner.request_and_receive_async(
            key, ctx_info_endpoint, block_ids, num_tokens, ctx_instance=ctx_instance
        )

    def check_gen_transfer_status(self) -> list[TransferOutcome]:
        outcomes = self.inner.check_gen_transfer_status()
        for outcome in outcomes:
            receive = self._receiving.pop(outcome.key, None)
            if receive is not None and outcome.ok:
                self._digest(outcome.key, [receive[0]], receive[1])
        return outcomes

    def abandon_send(self, key: int, reason: str) -> None:
        self.inner.abandon_send(key, reason)

    def check_context_transfer_status(self) -> list[TransferOutcome]:
        return self.inner.check_context_transfer_status()

    def cancel_request(self, key: int) -> bool:
        return self.inner.cancel_request(key)


@attrs.define(eq=False, kw_only=True)
class FaultyRunner:
    """A one-rank worker's runner whose next `hooks.step_failures` steps raise (test hooks)."""

    runner: StepRunner
    hooks: TestHooks

    def prepare(self, plan: StepPlan) -> StepInputs:
        return self.runner.prepare(plan)

    def launch(self, inputs: StepInputs, specs: dict[int, SampleSpec]) -> LaunchedStep:
        if self.hooks.take_step_failure():
            raise InjectedStepFailure("step failure injected by the test hooks")
        return self.runner.launch(inputs, specs)

    def finish(self, launched: LaunchedStep) -> StepOutput:
        return self.runner.finish(launched)

    def kv_ready(self) -> None:
        self.runner.kv_ready()

    def lost(self) -> None:
        self.runner.lost()
