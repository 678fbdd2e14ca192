"""TransferAgent: the data-plane seam (one-sided WRITE plus a notification). Pure.

Per rank: `make_agent` (backend from `cache_transceiver_config.backend`), `register_memory` once
(before `local_metadata()` goes into the RankInfo), `add_remote` per peer written to, then per
write `submit` -> `poll` until DONE or ERROR -> `release`; the target sees the notification in
`get_notifications()` once the bytes landed. Methods are synchronous; `register_memory`,
`add_remote` and `submit` may block (call them from a worker thread), the others return quickly.
Never call one agent from two threads at once (runtime/pump.py).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NewType, Protocol

import attrs

from trtdisagg.transfer.errors import AgentError

if TYPE_CHECKING:
    from trtdisagg.kv.page_table import PageTable
    from trtdisagg.transfer.protocol.fragments import Fragments
    from trtdisagg.transfer.runtime.agents.loopback import LoopbackFabric

XferHandle = NewType("XferHandle", int)


class XferStatus(enum.Enum):
    PENDING = "PENDING"
    DONE = "DONE"
    ERROR = "ERROR"


@attrs.frozen(kw_only=True)
class MemoryRegion:  # a contiguous range of registered memory
    address: int
    size: int
    memory_type: str = "DRAM"  # "DRAM" | "VRAM", as NIXL names them
    device_id: int = 0


def pool_regions(page_table: PageTable) -> list[MemoryRegion]:
    """The memory to register for a page table: one region per physical pool."""
    pools = [group.pool for group in page_table.layer_groups]
    return [
        MemoryRegion(address=p.base_address, size=p.total_bytes, memory_type=p.memory_type,
                     device_id=p.device_id) for p in pools
    ]  # fmt: skip


def find_region(regions: Sequence[MemoryRegion], fragments: Fragments, *,
                column: int = 0) -> MemoryRegion:  # fmt: skip
    """The one region holding every fragment's source (`column=0`) or destination (`1`);
    AgentError if there is none."""
    rows = fragments.rows
    start = int(rows[:, column].min())
    end = int((rows[:, column] + rows[:, 2]).max())
    for region in regions:
        if region.address <= start and end <= region.address + region.size:
            return region
    side = "source" if column == 0 else "destination"
    raise AgentError(
        f"{len(fragments)} fragments' {side}s [{start:#x}, {end:#x}) are not inside one "
        "registered region"
    )


class TransferAgent(Protocol):
    """One rank's data-plane endpoint. See the module docstring for lifecycle and threading."""

    @property
    def name(self) -> str: ...

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None: ...

    def local_metadata(self) -> bytes: ...

    def add_remote(self, metadata: bytes) -> str: ...  # a peer's agent: its name (`remote`)

    def remove_remote(self, name: str) -> None: ...

    def submit_is_quick(self, fragments: Fragments, remote: str) -> bool:
        """Whether submitting this write returns within about 0.1 ms (a thread hop costs more
        than submitting a few descriptors to a connected peer)."""

    def submit(self, fragments: Fragments, remote: str, notif: bytes, *,
               dst_memory_type: str = "DRAM", dst_device_id: int = 0) -> XferHandle:  # fmt: skip
        """Start a write of every fragment (local src -> remote dst); `notif` reaches the remote
        once all bytes landed (an empty write is DONE at once and notifies nobody). AgentError:
        a fragment outside registered memory, an unknown remote, a backend refusal (nothing is
        left to release then)."""

    def poll(self, handle: XferHandle) -> XferStatus: ...

    def release(self, handle: XferHandle) -> None: ...

    def get_notifications(self) -> list[tuple[str, bytes]]: ...  # (remote name, payload)

    def close(self) -> None: ...


class AgentBase:
    """What both agents keep: their name, registered regions, loaded remotes and handle ids."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._regions: list[MemoryRegion] = []
        self.remotes: set[str] = set()  # loaded with `add_remote` (read it, never change it)
        self._ids = itertools.count(1)

    @property
    def name(self) -> str:
        return self._name

    def _check_remote(self, remote: str) -> None:
        if remote not in self.remotes:
            raise AgentError(f"{self._name}: unknown remote agent {remote!r}")


def make_agent(backend: str, name: str, *, fabric: LoopbackFabric | None = None,
               progress_thread: bool = True) -> TransferAgent:  # fmt: skip
    """The agent named by config (`"NIXL"`, or `"LOOPBACK"` whose agents reach one another
    through `fabric`), importing its backend only now; AgentError for another name. Blocking
    (NIXL creates its UCX context): call it from a worker thread."""
    if backend == "NIXL":
        from trtdisagg.transfer.runtime.agents.nixl import NixlAgent

        return NixlAgent(name, progress_thread=progress_thread)
    if backend != "LOOPBACK":
        raise AgentError(f"unknown transfer backend {backend!r}; known: ['LOOPBACK', 'NIXL']")
    if fabric is None:
        raise AgentError("the LOOPBACK agent needs a LoopbackFabric shared by its peers")
    from trtdisagg.transfer.runtime.agents.loopback import LoopbackAgent

    return LoopbackAgent(name, fabric=fabric)
