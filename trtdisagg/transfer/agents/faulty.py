"""FaultyAgent: a transfer agent that injects a test's data-plane faults. Tests only.

It wraps the real agent (NIXL or loopback) and asks a `FaultInjector` (`transfer/faults.py`) at
two points: before each `submit_write` (`fail_submit` raises AgentError instead;
`stall_transfer` submits, then reports the write PENDING until the stall has passed), and for
each notification received (a WRITE_NOTICE: dropped, duplicated, or held back for a while).
Everything else goes straight to the wrapped agent. Same threading contract as `base`; nothing
here blocks, so a stalled write costs the caller's polls, not a thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from trtdisagg.transfer.agents.base import (
    MemoryRegion,
    TransferAgent,
    XferHandle,
    XferStatus,
    posts_quickly,
)
from trtdisagg.transfer.errors import AgentError
from trtdisagg.transfer.faults import FaultAction, FaultInjector

if TYPE_CHECKING:
    from trtdisagg.transfer.fragments import Fragments


class FaultyAgent:
    def __init__(
        self,
        inner: TransferAgent,
        faults: FaultInjector,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._inner = inner
        self._faults = faults
        self._clock = clock
        self._stalled: dict[XferHandle, float] = {}  # handle -> when it may report DONE
        self._held: list[tuple[float, str, bytes]] = []  # delayed notifications, by due time

    @property
    def name(self) -> str:
        return self._inner.name

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        self._inner.register_memory(regions)

    def deregister_memory(self) -> None:
        self._inner.deregister_memory()

    def local_metadata(self) -> bytes:
        return self._inner.local_metadata()

    def add_remote(self, metadata: bytes) -> str:
        return self._inner.add_remote(metadata)

    def remove_remote(self, name: str) -> None:
        self._inner.remove_remote(name)

    def submit_is_quick(self, fragments: Fragments, remote: str) -> bool:
        return posts_quickly(self._inner, fragments, remote)

    def submit_write(
        self,
        fragments: Fragments,
        remote: str,
        notif: bytes,
        *,
        dst_memory_type: str = "DRAM",
        dst_device_id: int = 0,
    ) -> XferHandle:
        fault = self._faults.submit()
        if fault is not None and fault.action is FaultAction.FAIL_SUBMIT:
            raise AgentError(f"{self.name}: injected fault: write to {remote} not submitted")
        handle = self._inner.submit_write(
            fragments, remote, notif, dst_memory_type=dst_memory_type, dst_device_id=dst_device_id
        )
        if fault is not None and fault.action is FaultAction.STALL_TRANSFER:
            self._stalled[handle] = self._clock() + fault.seconds
        return handle

    def poll(self, handle: XferHandle) -> XferStatus:
        until = self._stalled.get(handle)
        if until is not None and self._clock() < until:
            return XferStatus.PENDING
        return self._inner.poll(handle)

    def release(self, handle: XferHandle) -> None:
        self._stalled.pop(handle, None)
        self._inner.release(handle)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        now = self._clock()
        due = [(remote, payload) for at, remote, payload in self._held if at <= now]
        self._held = [held for held in self._held if held[0] > now]
        for remote, payload in self._inner.get_notifications():
            # Every notification of ours carries a WRITE_NOTICE (wire.py).
            fault = self._faults.message("WRITE_NOTICE")
            if fault is None:
                due.append((remote, payload))
            elif fault.action is FaultAction.DUPLICATE:
                due += [(remote, payload), (remote, payload)]
            elif fault.action is FaultAction.DELAY:
                self._held.append((now + fault.seconds, remote, payload))
        return due

    def close(self) -> None:
        self._stalled.clear()
        self._held.clear()
        self._inner.close()
