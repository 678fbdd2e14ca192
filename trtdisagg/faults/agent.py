"""FaultyAgent: a transfer agent that injects a test's data-plane faults. Tests only.

It wraps the real agent (NIXL or loopback) and asks a `FaultInjector` (spec.py) at two points:
at each `submit` (`fail_submit` raises AgentError instead; `stall_transfer` holds the write
back: it is submitted at the first poll after the stall, so its bytes and notification land
only then, and until then the write reads PENDING), and for each notification received (a
WRITE_NOTICE: dropped, duplicated, or held back for a while).
Everything else goes straight to the wrapped agent. Same threading contract as `base`; nothing
here blocks, so a stalled write costs the caller's polls, not a thread.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from trtdisagg.faults.spec import FaultAction, FaultInjector
from trtdisagg.transfer.errors import AgentError
from trtdisagg.transfer.runtime.agents.base import (
    MemoryRegion,
    TransferAgent,
    XferHandle,
    XferStatus,
)

if TYPE_CHECKING:
    from trtdisagg.transfer.protocol.fragments import Fragments


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
        # Stalled writes: when each is submitted and how, then the wrapped agent's handle. Their
        # own handles are negative, so that none names one of the wrapped agent's.
        self._stalled_ids = itertools.count(-1, -1)
        self._stalled: dict[XferHandle, tuple[float, Callable[[], XferHandle]]] = {}
        self._submitted: dict[XferHandle, XferHandle] = {}
        self._held: list[tuple[float, str, bytes]] = []  # delayed notifications, by due time

    @property
    def name(self) -> str:
        return self._inner.name

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        self._inner.register_memory(regions)

    def local_metadata(self) -> bytes:
        return self._inner.local_metadata()

    def add_remote(self, metadata: bytes) -> str:
        return self._inner.add_remote(metadata)

    def remove_remote(self, name: str) -> None:
        self._inner.remove_remote(name)

    def submit_is_quick(self, fragments: Fragments, remote: str) -> bool:
        return self._inner.submit_is_quick(fragments, remote)

    def submit(
        self,
        fragments: Fragments,
        remote: str,
        notif: bytes,
        *,
        dst_memory_type: str = "DRAM",
        dst_device_id: int = 0,
    ) -> XferHandle:
        submit = functools.partial(
            self._inner.submit,
            fragments,
            remote,
            notif,
            dst_memory_type=dst_memory_type,
            dst_device_id=dst_device_id,
        )
        fault = self._faults.submit()
        if fault is not None and fault.action is FaultAction.FAIL_SUBMIT:
            raise AgentError(f"{self.name}: injected fault: write to {remote} not submitted")
        if fault is None or fault.action is not FaultAction.STALL_TRANSFER:
            return submit()
        handle = XferHandle(next(self._stalled_ids))
        self._stalled[handle] = (self._clock() + fault.seconds, submit)
        return handle

    def poll(self, handle: XferHandle) -> XferStatus:
        stalled = self._stalled.get(handle)
        if stalled is not None:
            until, submit = stalled
            if self._clock() < until:
                return XferStatus.PENDING
            del self._stalled[handle]
            self._submitted[handle] = submit()
        return self._inner.poll(self._submitted.get(handle, handle))

    def release(self, handle: XferHandle) -> None:
        if self._stalled.pop(handle, None) is not None:
            return  # never submitted: nothing landed, nothing to release
        self._inner.release(self._submitted.pop(handle, handle))

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
        self._submitted.clear()
        self._held.clear()
        self._inner.close()
