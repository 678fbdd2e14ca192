"""Loopback agent, agent registry, and the purity of the transfer layer's pure modules."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.rank_infos import make_instance
from trtdisagg.faults.agent import FaultyAgent
from trtdisagg.faults.spec import FaultInjector, parse_faults
from trtdisagg.transfer.errors import AgentError
from trtdisagg.transfer.protocol.fragments import Fragments
from trtdisagg.transfer.protocol.peers import PeerRegistrar
from trtdisagg.transfer.protocol.wire import WriteNotice, decode, encode
from trtdisagg.transfer.runtime.agents.base import (
    MemoryRegion,
    XferStatus,
    make_agent,
    pool_regions,
)
from trtdisagg.transfer.runtime.agents.loopback import (
    QUICK_COPY_BYTES,
    LoopbackAgent,
    LoopbackFabric,
)

PURE = (
    "trtdisagg.transfer.errors",
    "trtdisagg.transfer.protocol.rank_info",
    "trtdisagg.transfer.protocol.wire",
    "trtdisagg.transfer.protocol.peers",
    "trtdisagg.transfer.protocol.fragments",
    "trtdisagg.transfer.protocol.mappers",
    "trtdisagg.transfer.protocol.sessions",
    "tests.rank_infos",
    "trtdisagg.transfer.runtime.agents.base",
    "trtdisagg.transfer.runtime.agents.loopback",
)


def test_pure_modules_import_no_io_or_torch() -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {PURE!r}: importlib.import_module(m)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'trio', 'zmq', 'nixl'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _fragments(rows: list[tuple[int, int, int]]) -> Fragments:
    return Fragments(np.array(rows, dtype=np.int64).reshape(-1, 3))


def _agents() -> tuple[LoopbackAgent, LoopbackAgent]:
    fabric = LoopbackFabric()
    ctx = make_agent("LOOPBACK", "ctx/0", fabric=fabric)
    gen = make_agent("LOOPBACK", "gen/0", fabric=fabric)
    assert isinstance(ctx, LoopbackAgent)
    assert isinstance(gen, LoopbackAgent)
    return ctx, gen


def test_loopback_write_through_a_mapper() -> None:
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    # one slot = 2 layers x K/V x 2 heads x 4 tokens x 4 dims x 4 bytes = 512 bytes
    ctx_info, gen_info = (
        make_instance(
            instance_name=name,
            tp_size=1,
            pp_size=1,
            layer_num_per_pp=(2,),
            num_kv_heads=2,
            head_dim=4,
            tokens_per_block=4,
            num_slots=8,
            element_bytes=4,
            base_address=lambda rank, memory=memory: memory.ctypes.data,  # type: ignore[misc]
        )[0]
        for name, memory in (("ctx", src), ("gen", dst))
    )
    ctx, gen = _agents()
    ctx.register_memory(pool_regions(ctx_info.page_table))
    gen.register_memory(pool_regions(gen_info.page_table))
    remote = ctx.add_remote(gen.local_metadata())
    plan = PeerRegistrar(ctx_info).register(gen_info)
    fragments = plan.fragments(src_blocks=[[2, 3, 5]], dst_blocks=[[0, 1, 6]], num_tokens=12)
    assert len(fragments) == 2  # [2, 3] -> [0, 1] merged, [5] -> [6]
    notice = encode(WriteNotice(key=9, instance_name="ctx", instance_rank=0))
    handle = ctx.submit(fragments, remote, notice)
    assert ctx.poll(handle) is XferStatus.DONE
    ctx.release(handle)
    assert bytes(dst[0:1024]) == bytes(src[1024:2048])
    assert bytes(dst[3072:3584]) == bytes(src[2560:3072])
    assert not dst[1024:3072].any()
    assert not dst[3584:].any()
    ((sender, payload),) = gen.get_notifications()
    assert sender == "ctx/0"
    assert decode(payload) == WriteNotice(key=9, instance_name="ctx", instance_rank=0)
    assert gen.get_notifications() == []


def test_loopback_can_notify_from_the_first_poll_that_finds_a_write_done() -> None:
    """As NIXL's UCX backend does for a write still in flight when posted."""
    fabric = LoopbackFabric()
    ctx = LoopbackAgent("ctx/0", fabric=fabric, notify_on_poll=True)
    gen = LoopbackAgent("gen/0", fabric=fabric)
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    ctx.register_memory([MemoryRegion(address=int(src.ctypes.data), size=64)])
    gen.register_memory([MemoryRegion(address=int(dst.ctypes.data), size=64)])
    remote = ctx.add_remote(gen.local_metadata())
    rows = Fragments(np.array([[src.ctypes.data, dst.ctypes.data, 64]], dtype=np.int64))
    handle = ctx.submit(rows, remote, b"polled")
    assert (dst == src).all() and gen.get_notifications() == []  # landed, not yet told
    assert ctx.poll(handle) is XferStatus.DONE
    assert gen.get_notifications() == [("ctx/0", b"polled")]
    assert ctx.poll(handle) is XferStatus.DONE and gen.get_notifications() == []  # once
    ctx.release(handle)
    never = ctx.submit(rows, remote, b"never polled")
    ctx.release(never)
    assert gen.get_notifications() == [] and ctx.handles == {}


def test_loopback_refuses_out_of_bounds_and_unknown_remotes() -> None:
    src = np.ones(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    ctx, gen = _agents()
    ctx.register_memory([MemoryRegion(address=src.ctypes.data, size=64)])
    gen.register_memory([MemoryRegion(address=dst.ctypes.data, size=32)])
    good = (src.ctypes.data, dst.ctypes.data, 32)
    with pytest.raises(AgentError, match="unknown remote agent 'gen/0'"):
        ctx.submit(_fragments([good]), "gen/0", b"")
    remote = ctx.add_remote(gen.local_metadata())
    too_long = (src.ctypes.data, dst.ctypes.data, 33)
    with pytest.raises(
        AgentError, match=r"ctx/0 -> gen/0: 1 fragments' destinations .* not inside"
    ):
        ctx.submit(_fragments([too_long]), remote, b"")
    unregistered = (src.ctypes.data + 60, dst.ctypes.data, 8)
    with pytest.raises(AgentError, match=r"sources \[0x[0-9a-f]+, 0x[0-9a-f]+\) are not inside"):
        ctx.submit(_fragments([unregistered]), remote, b"")
    assert not dst.any()
    assert gen.get_notifications() == []
    empty = ctx.submit(_fragments([]), remote, b"never sent")
    assert ctx.poll(empty) is XferStatus.DONE
    assert gen.get_notifications() == []
    with pytest.raises(AgentError, match="no loopback agent 'nobody'"):
        ctx.add_remote(b"nobody")
    gen.close()
    with pytest.raises(AgentError, match="no loopback agent"):
        ctx.submit(_fragments([good]), remote, b"")


def test_registry_selects_by_config_name() -> None:
    with pytest.raises(AgentError, match=r"unknown transfer backend 'UCX'; known: \['LOOPBACK', "):
        make_agent("UCX", "x")
    with pytest.raises(AgentError, match="needs a LoopbackFabric"):
        make_agent("LOOPBACK", "x")
    fabric = LoopbackFabric()
    make_agent("LOOPBACK", "x", fabric=fabric)
    with pytest.raises(AgentError, match="already exists"):
        make_agent("LOOPBACK", "x", fabric=fabric)


def test_fragments() -> None:
    fragments = _fragments([(10, 20, 4), (14, 30, 2)])
    assert fragments.rows.tolist() == [[10, 20, 4], [14, 30, 2]]
    assert fragments == _fragments([(10, 20, 4), (14, 30, 2)]) != _fragments([(10, 20, 4)])
    assert (len(fragments), fragments.num_bytes) == (2, 6)
    assert len(_fragments([])) == 0
    with pytest.raises(ValueError, match="read-only"):
        fragments.rows[0, 0] = 1


def test_submit_is_quick_follows_the_agents_own_hint() -> None:
    ctx, gen = _agents()
    small = Fragments(np.array([[0, 0, QUICK_COPY_BYTES]], dtype=np.int64))
    large = Fragments(np.array([[0, 0, QUICK_COPY_BYTES + 1]], dtype=np.int64))
    # The loopback agent copies inside submit: quick only while the copy is small.
    assert ctx.submit_is_quick(small, gen.name)
    assert not ctx.submit_is_quick(large, gen.name)
    # A wrapper passes the question on.
    faulty = FaultyAgent(ctx, FaultInjector(plan=parse_faults("")))
    assert faulty.submit_is_quick(small, gen.name)
    assert not faulty.submit_is_quick(large, gen.name)


def test_a_nixl_post_is_quick_only_to_a_connected_peer_with_few_small_descriptors() -> None:
    pytest.importorskip("nixl")
    from trtdisagg.transfer.runtime.agents.nixl import (
        QUICK_SUBMIT_MAX_DESCRIPTORS,
        QUICK_SUBMIT_MAX_DRAM_BYTES,
        NixlAgent,
    )

    size = 2 * QUICK_SUBMIT_MAX_DRAM_BYTES
    src, dst = np.ones(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)
    ctx = NixlAgent("quick-test-ctx", progress_thread=False)
    gen = NixlAgent("quick-test-gen", progress_thread=False)
    try:
        ctx.register_memory([MemoryRegion(address=src.ctypes.data, size=size)])
        gen.register_memory([MemoryRegion(address=dst.ctypes.data, size=size)])
        remote = ctx.add_remote(gen.local_metadata())

        def rows(count: int, nbytes: int) -> Fragments:
            step = nbytes // count
            starts = np.arange(count, dtype=np.int64) * 2 * step  # gaps: nothing merges
            sizes = np.full(count, step, dtype=np.int64)
            return Fragments(
                np.stack([src.ctypes.data + starts, dst.ctypes.data + starts, sizes], 1)
            )

        one = rows(1, 4096)
        assert not ctx.submit_is_quick(one, remote)  # the first write sets up the connection
        handle = ctx.submit(one, remote, b"first")
        while ctx.poll(handle) is XferStatus.PENDING:
            gen.get_notifications()  # no progress thread: the target progresses when polled
        ctx.release(handle)
        assert ctx.submit_is_quick(one, remote)
        assert ctx.submit_is_quick(rows(QUICK_SUBMIT_MAX_DESCRIPTORS, 64 * 1024), remote)
        assert not ctx.submit_is_quick(rows(QUICK_SUBMIT_MAX_DESCRIPTORS + 1, 64 * 1024), remote)
        # From DRAM the post may copy the bytes itself: only a small one is quick.
        assert not ctx.submit_is_quick(rows(1, QUICK_SUBMIT_MAX_DRAM_BYTES + 8), remote)
    finally:
        ctx.close()
        gen.close()
