"""The engine as the HTTP side sees it: a `Protocol`, and its in-process implementation.

`WorkerService`, `Job` and the routes talk to an `Engine`: submit a prompt's choices and read
each one's outputs from a trio channel, abort, ask the few questions that need the engine's
state. `LocalEngine` wraps the `Executor` of the same process (`api_server_count: 0`);
`front.client.RemoteEngine` reaches the engine process from a front process. Calls that need an
answer from the engine are async, since a remote one waits for its reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from trtdisagg.transfer.protocol.rank_info import compat_fields

if TYPE_CHECKING:
    from trtdisagg.kv.block_pool import KvEvent
    from trtdisagg.worker.engine.executor import Executor
    from trtdisagg.worker.engine.live import GenerationSource, RequestHandle
    from trtdisagg.worker.grammar import GrammarTemplate
    from trtdisagg.worker.request import Request


class Engine(Protocol):
    """What the HTTP side needs of the engine."""

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits."""
        ...

    @property
    def stopped(self) -> str | None:
        """Why the engine stopped serving; None while it serves."""
        ...

    @property
    def kv_compat(self) -> dict[str, str | int] | None:
        """What a KV peer must match (`rank_info.compat_fields`); None without a transceiver."""
        ...

    @property
    def has_test_hooks(self) -> bool: ...

    def check_fits(self, request: Request) -> None:
        """Raise CapacityError when the prompt could never be served here."""
        ...

    def submit_group(
        self,
        choices: Sequence[Request],
        *,
        source: GenerationSource | None = None,
        transfer_key: int | None = None,
        grammar: GrammarTemplate | None = None,
    ) -> list[RequestHandle]:
        """Queue one prompt's choices (`Executor.submit_group`); one handle per choice."""
        ...

    def abort(self, request_id: int) -> None: ...

    async def release_send(self, key: int) -> bool: ...

    async def transfer_key_in_use(self, key: int, *, sending: bool) -> bool: ...

    async def render_metrics(self) -> bytes:
        """The Prometheus text of the engine's registry, gauges brought up to date."""
        ...

    async def drain_kv_events(self, after: int | None = None) -> list[dict[str, Any]]:
        """KV events as `/kv_cache_events` answers them: those since the last drain, or with
        `after`, those after that event id (a reader's own cursor; drains do not touch it)."""
        ...

    async def kv_digests(self) -> dict[int, str]:
        """Test hooks: the digest of each transfer's KV."""
        ...

    async def fail_steps(self, count: int) -> None:
        """Test hooks: make the next `count` model steps raise."""
        ...


def kv_events_json(events: Sequence[KvEvent]) -> list[dict[str, Any]]:
    return [
        {
            "event_id": e.event_id,
            "kind": e.kind.value,
            "block_hashes": list(e.block_hashes),
            "parent_hash": e.parent_hash,
        }
        for e in events
    ]


@attrs.define(eq=False, kw_only=True)
class LocalEngine:
    """The `Engine` of a process that runs its executor itself."""

    executor: Executor

    @property
    def vocab_size(self) -> int:
        return self.executor.vocab_size

    @property
    def stopped(self) -> str | None:
        return self.executor.stopped

    @property
    def kv_compat(self) -> dict[str, str | int] | None:
        transceiver = self.executor.transceiver
        return None if transceiver is None else compat_fields(transceiver.local)

    @property
    def has_test_hooks(self) -> bool:
        return self.executor.test_hooks is not None

    def check_fits(self, request: Request) -> None:
        self.executor.check_fits(request)

    def submit_group(
        self,
        choices: Sequence[Request],
        *,
        source: GenerationSource | None = None,
        transfer_key: int | None = None,
        grammar: GrammarTemplate | None = None,
    ) -> list[RequestHandle]:
        return self.executor.submit_group(
            choices, source=source, transfer_key=transfer_key, grammar=grammar
        )

    def abort(self, request_id: int) -> None:
        self.executor.abort(request_id)

    async def release_send(self, key: int) -> bool:
        return self.executor.release_send(key)

    async def transfer_key_in_use(self, key: int, *, sending: bool) -> bool:
        return self.executor.transfer_key_in_use(key, sending=sending)

    async def render_metrics(self) -> bytes:
        return self.executor.metrics.render(self.executor.refresh_gauges)

    async def drain_kv_events(self, after: int | None = None) -> list[dict[str, Any]]:
        pool = self.executor.scheduler.pool
        return kv_events_json(pool.drain_events() if after is None else pool.events_after(after))

    async def kv_digests(self) -> dict[int, str]:
        hooks = self.executor.test_hooks
        return {} if hooks is None else dict(hooks.digests)

    async def fail_steps(self, count: int) -> None:
        if self.executor.test_hooks is not None:
            self.executor.test_hooks.step_failures = count
