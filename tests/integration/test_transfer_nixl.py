"""Real NIXL (UCX, DRAM) writes: in-process, under trio, and from a `spawn`ed child process.

Pools are torch tensors `[num_blocks, layers, 2, H, T, D]` described by `make_page_table`, so the
fragments come from the real registrar and mapper; bytes are compared exactly.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import attrs
import pytest
import torch
import trio

from tests.rank_infos import make_instance
from trtdisagg.kv.page_table import Layout
from trtdisagg.transfer.errors import AgentError
from trtdisagg.transfer.protocol.fragments import Fragments
from trtdisagg.transfer.protocol.peers import PeerRegistrar
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.wire import WriteNotice, decode, encode
from trtdisagg.transfer.runtime.agents.base import (
    TransferAgent,
    XferHandle,
    XferStatus,
    pool_regions,
)
from trtdisagg.transfer.runtime.agents.nixl import NixlAgent

BLOCKS, LAYERS, HEADS, TOKENS, DIM = 8, 3, 2, 4, 8
SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS = [1, 2, 3, 6], [4, 5, 6, 0], 15


def _pool(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BLOCKS, LAYERS, 2, HEADS, TOKENS, DIM, generator=generator)


def _info(name: str, pool: torch.Tensor, agent: TransferAgent | None = None) -> RankInfo:
    (info,) = make_instance(
        instance_name=name,
        tp_size=1,
        pp_size=1,
        layer_num_per_pp=(LAYERS,),
        num_kv_heads=HEADS,
        head_dim=DIM,
        tokens_per_block=TOKENS,
        num_slots=BLOCKS,
        layout=Layout.HND,
        base_address=lambda rank: pool.data_ptr(),
        agent_metadata=lambda rank: agent.local_metadata() if agent else b"",
    )
    return info


def _wait(agent: TransferAgent, handle: XferHandle, timeout: float = 20.0) -> XferStatus:
    deadline = time.monotonic() + timeout
    while (status := agent.poll(handle)) is XferStatus.PENDING:
        assert time.monotonic() < deadline, "write did not finish"
        time.sleep(0.001)
    agent.release(handle)
    return status


def _notifications(agent: TransferAgent, timeout: float = 20.0) -> list[tuple[str, bytes]]:
    deadline = time.monotonic() + timeout
    while not (found := agent.get_notifications()):
        assert time.monotonic() < deadline, "no notification"
        time.sleep(0.001)
    return found


def _expected(src: torch.Tensor, dst_before: torch.Tensor) -> torch.Tensor:
    expected = dst_before.clone()
    expected[DST_BLOCKS] = src[SRC_BLOCKS]
    return expected


@attrs.frozen
class _Pair:
    """Two in-process agents over two pools, ctx able to write to gen."""

    ctx: NixlAgent
    gen: NixlAgent
    remote: str
    src: torch.Tensor
    dst: torch.Tensor
    before: torch.Tensor  # dst as it was


@contextlib.contextmanager
def _agent_pair(name: str, seed: int) -> Iterator[_Pair]:
    src, dst = _pool(seed), _pool(seed + 1)
    ctx, gen = NixlAgent(f"{name}-ctx"), NixlAgent(f"{name}-gen")
    try:
        ctx.register_memory(pool_regions(_info("ctx", src).page_table))
        gen.register_memory(pool_regions(_info("gen", dst).page_table))
        remote = ctx.add_remote(gen.local_metadata())
        yield _Pair(ctx=ctx, gen=gen, remote=remote, src=src, dst=dst, before=dst.clone())
    finally:
        ctx.close()
        gen.close()


def _fragments(pair: _Pair) -> Fragments:
    plan = PeerRegistrar(_info("ctx", pair.src)).register(_info("gen", pair.dst))
    return plan.fragments(src_blocks=[SRC_BLOCKS], dst_blocks=[DST_BLOCKS], num_tokens=NUM_TOKENS)


def test_in_process_write() -> None:
    with _agent_pair("nixl-test", seed=1) as pair:
        ctx, gen, remote = pair.ctx, pair.gen, pair.remote
        assert remote == "nixl-test-gen"
        fragments = _fragments(pair)
        assert len(fragments) == 2  # blocks 1-3 -> 4-6 merged, 6 -> 0
        notice = WriteNotice(key=5, instance_name="ctx", instance_rank=0)
        status = _wait(ctx, ctx.submit(fragments, remote, encode(notice)))
        assert status is XferStatus.DONE
        assert [(n, decode(p)) for n, p in _notifications(gen)] == [("nixl-test-ctx", notice)]
        assert torch.equal(pair.dst, _expected(pair.src, pair.before))
        with pytest.raises(AgentError, match="unknown remote agent 'nobody'"):
            ctx.submit(fragments, "nobody", b"")


async def test_write_driven_from_trio() -> None:
    """The calling pattern the transceiver uses: blocking calls in a thread, polls on the loop."""
    src, dst = _pool(3), _pool(4)
    before = dst.clone()
    limiter = trio.CapacityLimiter(1)  # one agent call at a time
    ctx = await trio.to_thread.run_sync(NixlAgent, "nixl-trio-ctx")
    gen = await trio.to_thread.run_sync(NixlAgent, "nixl-trio-gen")
    try:
        ctx_info, gen_info = _info("ctx", src), _info("gen", dst)
        await trio.to_thread.run_sync(ctx.register_memory, pool_regions(ctx_info.page_table))
        await trio.to_thread.run_sync(gen.register_memory, pool_regions(gen_info.page_table))
        remote = await trio.to_thread.run_sync(ctx.add_remote, gen.local_metadata())
        fragments = (
            PeerRegistrar(ctx_info)
            .register(gen_info)
            .fragments(src_blocks=[SRC_BLOCKS], dst_blocks=[DST_BLOCKS], num_tokens=NUM_TOKENS)
        )
        handle = await trio.to_thread.run_sync(
            ctx.submit, fragments, remote, b"done", limiter=limiter
        )
        with trio.fail_after(20):
            # NIXL offers no completion event: one poller with a short sleep, as the shell does
            while ctx.poll(handle) is XferStatus.PENDING:  # noqa: ASYNC110
                await trio.sleep(0.001)
            ctx.release(handle)
            while not (notes := gen.get_notifications()):  # noqa: ASYNC110
                await trio.sleep(0.001)
        assert notes == [("nixl-trio-ctx", b"done")]
        assert torch.equal(dst, _expected(src, before))
    finally:
        ctx.close()
        gen.close()


def _child(gen_info: RankInfo, results: Any) -> None:
    """ctx rank in a spawned process: build its own pool, write into the parent's pool."""
    agent = NixlAgent("nixl-spawn-ctx")
    try:
        src = _pool(7)
        ctx_info = _info("ctx", src)
        agent.register_memory(pool_regions(ctx_info.page_table))
        remote = agent.add_remote(gen_info.agent_metadata)
        fragments = (
            PeerRegistrar(ctx_info)
            .register(gen_info)
            .fragments(src_blocks=[SRC_BLOCKS], dst_blocks=[DST_BLOCKS], num_tokens=NUM_TOKENS)
        )
        notice = encode(WriteNotice(key=11, instance_name="ctx", instance_rank=0))
        status = _wait(agent, agent.submit(fragments, remote, notice))
        results.put(("ok", status.value, fragments.num_bytes))
    except BaseException as exc:
        results.put(("error", repr(exc), 0))
        raise
    finally:
        agent.close()


@pytest.mark.slow
def test_spawned_process_writes_into_parent_tensors() -> None:
    dst = _pool(8)
    before = dst.clone()
    context = mp.get_context("spawn")
    results = context.Queue()
    child: BaseProcess | None = None
    gen = NixlAgent("nixl-spawn-gen")
    try:
        gen.register_memory(pool_regions(_info("gen", dst).page_table))
        # the metadata names the registered memory, so it is read after registration
        child = context.Process(target=_child, args=(_info("gen", dst, gen), results), daemon=True)
        child.start()
        try:
            outcome, status, num_bytes = results.get(timeout=120)
        except queue.Empty:
            pytest.fail("the child reported nothing within 120 s")
        assert (outcome, status) == ("ok", "DONE"), status
        ((sender, payload),) = _notifications(gen)
        assert sender == "nixl-spawn-ctx"
        assert decode(payload) == WriteNotice(key=11, instance_name="ctx", instance_rank=0)
        assert num_bytes == 4 * dst[0].numel() * dst.element_size()
        assert torch.equal(dst, _expected(_pool(7), before))
        child.join(timeout=30)
        assert child.exitcode == 0
    finally:
        if child is not None and child.is_alive():
            child.kill()
            child.join(timeout=10)
        gen.close()
