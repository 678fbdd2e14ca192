"""Placement: where the service gets servers from, as an interface.

`LocalPlacement` (`local.py`) implements it: this process owns the cluster state, the health
checks, the routers and the KV event polling (alone, or as one front end of a fleet); tests
may put their own behind the same interface.

A `Lease` is one reservation on one server; whoever holds it releases it exactly once, in a
``finally``, shielded from cancellation and bounded in time, so in-flight counts never leak.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

import attrs
import trio

from trtdisagg.coordinator.cluster import ServerInfo, ServerRole
from trtdisagg.coordinator.config import RouterType
from trtdisagg.coordinator.routers import RouteRequest, Selection
from trtdisagg.errors import TrtDisaggError

Json = dict[str, Any]

RELEASE_TIMEOUT: Final = 2.0


class CoordinatorUnavailable(TrtDisaggError):
    """The coordinator cannot serve now: the cluster is not ready (HTTP 503)."""


class Placement(Protocol):
    def is_ready(self) -> bool: ...

    def not_ready_reason(self) -> str: ...

    def cluster_info(self) -> Json: ...

    def membership_status(self) -> Json | None:
        """With servers from etcd: where, and whether the view is stale (None: static lists)."""
        ...

    def server_info(self, url: str) -> ServerInfo | None: ...

    def model_info(self) -> ServerInfo | None:
        """Some healthy server's info: served model name and model path (for the tokenizer)."""
        ...

    def router_type(self, role: ServerRole) -> RouterType: ...

    def uses_prompt_tokens(self, role: ServerRole) -> bool: ...

    async def select(
        self,
        role: ServerRole,
        request: RouteRequest,
        *,
        exclude: str | None,
        pair_with: str | None = None,
    ) -> Selection:
        """Choose a server of `role` other than `exclude` that can exchange KV with
        `pair_with`, the server already chosen for the request's other leg.

        Raises NoServerAvailable (naming `pair_with` and why, when no server can pair with it)
        or CoordinatorUnavailable.
        """
        ...

    async def finish(self, role: ServerRole, key: int, *, success: bool) -> None:
        """Release the reservation `key`; never raises for transport failures."""
        ...

    def report_unreachable(self, role: ServerRole, url: str, reason: str) -> None:
        """A request could not reach `url`: take it out of rotation until it is healthy."""
        ...

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run background work; `started()` once the cluster is ready to serve."""
        ...


@attrs.define(eq=False, kw_only=True)
class Lease:
    placement: Placement
    role: ServerRole
    key: int
    selection: Selection
    handed_off: bool = False
    """Ownership moved to a streaming body, which releases it when the stream ends."""
    _released: bool = False

    @property
    def server(self) -> str:
        return self.selection.server

    async def release(self, *, success: bool) -> None:
        if self._released:
            return
        self._released = True
        with trio.CancelScope(shield=True), trio.move_on_after(RELEASE_TIMEOUT):
            await self.placement.finish(self.role, self.key, success=success)

    async def release_unless_handed_off(self, *, success: bool) -> None:
        if not self.handed_off:
            await self.release(success=success)
