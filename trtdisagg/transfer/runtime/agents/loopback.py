"""LoopbackAgent: in-process writes between agents of one process, for single-process tests.

Agents find each other through a `LoopbackFabric` that the test (or a single-process cluster)
passes to each: no module-level registry. A write checks its sources and destinations against
both agents' registered memory, copies with `ctypes.memmove` and queues the notification on the
target; it is DONE once submitted. DRAM only; nothing here blocks. `notify_on_poll=True` sends the
notification only from the first `poll` that finds the write done, as NIXL's UCX backend does
for a GPU write.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING

from trtdisagg.transfer.errors import AgentError
from trtdisagg.transfer.runtime.agents.base import (
    AgentBase,
    MemoryRegion,
    XferHandle,
    XferStatus,
    find_region,
)

if TYPE_CHECKING:
    from trtdisagg.transfer.protocol.fragments import Fragments


QUICK_COPY_BYTES = 1 << 20


class LoopbackFabric:
    """The agents of one process that can write to each other, by name."""

    def __init__(self) -> None:
        self._agents: dict[str, LoopbackAgent] = {}

    def attach(self, agent: LoopbackAgent) -> None:
        if agent.name in self._agents:
            raise AgentError(f"loopback agent {agent.name!r} already exists")
        self._agents[agent.name] = agent

    def detach(self, name: str) -> None:
        self._agents.pop(name, None)

    def get(self, name: str) -> LoopbackAgent:
        agent = self._agents.get(name)
        if agent is None:
            raise AgentError(f"no loopback agent {name!r}")
        return agent


class LoopbackAgent(AgentBase):
    def __init__(self, name: str, *, fabric: LoopbackFabric, notify_on_poll: bool = False) -> None:
        super().__init__(name)
        self._fabric = fabric
        self._notify_on_poll = notify_on_poll
        self._unsent: dict[XferHandle, tuple[str, bytes]] = {}  # notify_on_poll: not polled yet
        self._notifications: list[tuple[str, bytes]] = []
        self.handles: dict[XferHandle, XferStatus] = {}  # not yet released
        fabric.attach(self)

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        for region in regions:
            if region.memory_type != "DRAM":
                raise AgentError(f"loopback agent copies host memory only, not {region}")
        self._regions.extend(regions)

    def local_metadata(self) -> bytes:
        return self._name.encode()

    def add_remote(self, metadata: bytes) -> str:
        name = metadata.decode(errors="replace")
        self._fabric.get(name)
        self.remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        self.remotes.discard(name)

    def submit_is_quick(self, fragments: Fragments, remote: str) -> bool:
        # `submit` copies: quick only while the copy is small (~0.1 ms).
        return fragments.num_bytes <= QUICK_COPY_BYTES

    def submit(self, fragments: Fragments, remote: str, notif: bytes, *,
               dst_memory_type: str = "DRAM", dst_device_id: int = 0) -> XferHandle:  # fmt: skip
        self._check_remote(remote)
        target = self._fabric.get(remote)
        handle = XferHandle(next(self._ids))
        if len(fragments):
            find_region(self._regions, fragments)
            try:
                find_region(target._regions, fragments, column=1)
            except AgentError as exc:
                raise AgentError(f"{self._name} -> {remote}: {exc}") from None
            for src, dst, size in fragments.rows.tolist():
                ctypes.memmove(dst, src, size)
            if self._notify_on_poll:
                self._unsent[handle] = (remote, notif)
            else:
                target._notifications.append((self._name, notif))
        self.handles[handle] = XferStatus.DONE
        return handle

    def poll(self, handle: XferHandle) -> XferStatus:
        unsent = self._unsent.pop(handle, None)
        if unsent is not None:
            remote, notif = unsent
            self._fabric.get(remote)._notifications.append((self._name, notif))
        return self.handles[handle]

    def release(self, handle: XferHandle) -> None:
        self.handles.pop(handle, None)
        self._unsent.pop(handle, None)  # never polled: never sent (as NIXL's)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        notifications, self._notifications = self._notifications, []
        return notifications

    def close(self) -> None:
        self.handles.clear()
        self._unsent.clear()
        self.remotes.clear()
        self._regions.clear()
        self._fabric.detach(self._name)
