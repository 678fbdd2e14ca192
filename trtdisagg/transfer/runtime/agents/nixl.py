"""NixlAgent: the NIXL (UCX) transfer agent. The only module that imports nixl.

One `nixl_agent` per rank with the UCX backend and `NIXL_THREAD_SYNC_STRICT` (the agent locks
itself; callers still serialise, see `base`). Memory is registered once (DRAM for CPU pools,
VRAM for CUDA ones). A write builds a local and a remote descriptor list from the fragments,
`initialize_xfer("WRITE", ...)`, and posts it with `transfer`; `poll` reads `check_xfer_state`.
Blocking: construction, `register_memory`, `add_remote`, `close`, and `submit` unless
`submit_is_quick` says so (a few descriptors to a peer already written to); the rest is quick.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

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

_STATES = {"PROC": XferStatus.PENDING, "DONE": XferStatus.DONE, "ERR": XferStatus.ERROR}
_DONE = XferHandle(0)  # the handle of an empty write: nothing was submitted
# A submit is linear in the number of descriptors: up to this many, one to a connected peer costs
# less than the thread hop it would otherwise pay.
QUICK_SUBMIT_MAX_DESCRIPTORS = 16
# A post from host memory may copy the bytes itself (UCX's shared-memory transports without a
# progress thread), so from DRAM only a small write is quick; from VRAM a post only queues it.
QUICK_SUBMIT_MAX_DRAM_BYTES = 1 << 20
# UCX's cuda_ipc transport maps a same-node peer's GPU memory when its agent is loaded, and by
# default caches that mapping until the process exits, even once the agent is removed: a peer
# that exited then keeps its whole KV pool allocated on its GPU (openucx/ucx#11753). Without the
# cache, removing the agent drops the mapping. A value the user set in the environment wins.
CUDA_IPC_CACHE_ENV = ("UCX_CUDA_IPC_CACHE", "n")


class NixlAgent(AgentBase):
    def __init__(self, name: str, *, progress_thread: bool = True) -> None:
        super().__init__(name)
        os.environ.setdefault(*CUDA_IPC_CACHE_ENV)  # read when UCX starts, in nixl_agent below
        # NIXL's progress thread spins a core while idle; without it, our own polling of
        # transfers and notifications drives progress (enough for CPU/shared-memory paths).
        strict = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        config = nixl_agent_config(
            enable_prog_thread=progress_thread, backends=["UCX"], sync_mode=strict
        )
        self._agent = nixl_agent(name, config)
        self._registrations: list[Any] = []  # nixlRegDList per registered region
        # Remotes a write was posted to: their UCX connection is up, so posting is quick.
        self._connected: set[str] = set()
        self._handles: dict[XferHandle, Any] = {}  # our id -> nixl_xfer_handle

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        for region in regions:
            row = [(region.address, region.size, region.device_id, "")]
            try:
                descs = self._agent.register_memory(row, region.memory_type)
            except Exception as exc:
                raise AgentError(f"{self._name}: cannot register {region}: {exc}") from exc
            self._registrations.append(descs)
            self._regions.append(region)

    def local_metadata(self) -> bytes:
        metadata: bytes = self._agent.get_agent_metadata()
        return metadata

    def add_remote(self, metadata: bytes) -> str:
        try:
            raw: str | bytes = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise AgentError(f"{self._name}: cannot load remote agent: {exc}") from exc
        name = raw.decode() if isinstance(raw, bytes) else raw  # nixl 1.5 returns bytes
        self.remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        if name in self.remotes:
            self.remotes.discard(name)
            self._connected.discard(name)
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:
                raise AgentError(f"{self._name}: cannot unload remote agent {name}: {exc}") from exc

    def submit_is_quick(self, fragments: Fragments, remote: str) -> bool:
        """A few descriptors to a peer written to before (no connection set-up), from VRAM or few
        bytes of DRAM: see `QUICK_SUBMIT_MAX_DESCRIPTORS` and `QUICK_SUBMIT_MAX_DRAM_BYTES`."""
        if remote not in self._connected or len(fragments) > QUICK_SUBMIT_MAX_DESCRIPTORS:
            return False
        if fragments.num_bytes <= QUICK_SUBMIT_MAX_DRAM_BYTES:
            return True
        try:
            return find_region(self._regions, fragments).memory_type == "VRAM"
        except AgentError:
            return False  # submit reports it

    def submit(self, fragments: Fragments, remote: str, notif: bytes, *,
               dst_memory_type: str = "DRAM", dst_device_id: int = 0) -> XferHandle:  # fmt: skip
        self._check_remote(remote)
        if not len(fragments):
            return _DONE
        source = find_region(self._regions, fragments)
        # [n, 3] rows of (address, size, device id): the array form get_xfer_descs takes
        rows = fragments.rows
        local = np.empty((len(rows), 3), dtype=np.uint64)
        local[:, 0], local[:, 1], local[:, 2] = rows[:, 0], rows[:, 2], source.device_id
        target = np.empty((len(rows), 3), dtype=np.uint64)
        target[:, 0], target[:, 1], target[:, 2] = rows[:, 1], rows[:, 2], dst_device_id
        try:
            handle = self._agent.initialize_xfer(
                "WRITE", self._agent.get_xfer_descs(local, source.memory_type),
                self._agent.get_xfer_descs(target, dst_memory_type), remote,
            )  # fmt: skip
        except Exception as exc:
            raise AgentError(f"{self._name}: write to {remote} not initialized: {exc}") from exc
        try:
            state = self._agent.transfer(handle, notif)
        except Exception as exc:
            self._agent.release_xfer_handle(handle)
            raise AgentError(f"{self._name}: write to {remote} not submitted: {exc}") from exc
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise AgentError(f"{self._name}: write to {remote} failed when posted")
        self._connected.add(remote)
        xfer = XferHandle(next(self._ids))
        self._handles[xfer] = handle
        return xfer

    def poll(self, handle: XferHandle) -> XferStatus:
        if handle == _DONE:
            return XferStatus.DONE
        try:  # NIXL_ERR_REMOTE_DISCONNECT when the peer died mid-write, among others
            return _STATES[self._agent.check_xfer_state(self._handles[handle])]
        except Exception as exc:
            raise AgentError(f"{self._name}: polling a write failed: {exc!r}") from exc

    def release(self, handle: XferHandle) -> None:
        nixl_handle = self._handles.pop(handle, None)
        if nixl_handle is not None:
            self._agent.release_xfer_handle(nixl_handle)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        notifs: dict[str, list[bytes]] = self._agent.get_new_notifs()
        return [(name, payload) for name, payloads in notifs.items() for payload in payloads]

    def close(self) -> None:
        """Release every handle (aborting unfinished writes), forget remotes, deregister."""
        for handle in list(self._handles):
            self.release(handle)
        for name in list(self.remotes):
            self.remove_remote(name)
        registrations, self._registrations = self._registrations, []
        self._regions.clear()
        for descs in registrations:
            self._agent.deregister_memory(descs)
