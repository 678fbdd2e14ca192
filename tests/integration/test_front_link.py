"""The front link in one process: a real executor (`tiny`) behind an `EngineServer`, reached by a
`RemoteEngine` over zmq on ipc://, as a front process reaches it.

Outputs come back equal to the executor's own, in batches (fewer messages than outputs); a
front that aborts frees its request's blocks; frames that are not well-formed messages, or that
name another front's request ids, are dropped and counted while the engine keeps serving.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest
import trio
import zmq

from tests.tiny_model import TinyModel, load_tiny
from trtdisagg.config import KvCacheConfig, WorkerConfig
from trtdisagg.worker.engine.executor import Executor, RequestHandle, RequestOutput
from trtdisagg.worker.front.client import RemoteEngine
from trtdisagg.worker.front.link import Link, open_socket
from trtdisagg.worker.front.server import EngineServer
from trtdisagg.worker.front.supervisor import engine_facts
from trtdisagg.worker.front.wire import Call, Kind, SubmitGroup, encode_submit, pack
from trtdisagg.worker.request import FinishReason, Request, SamplingParams

TIMEOUT_S = 60.0  # a whole test's requests, on a loaded 2-core machine
PROMPT = [10 + (7 * i) % 300 for i in range(24)]


@pytest.fixture(scope="module")
def model() -> TinyModel:
    return load_tiny()


def make_executor(model: TinyModel) -> Executor:
    config = WorkerConfig(
        max_num_tokens=256, kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=2048)
    )
    return model.executor(config)


@attrs.define(eq=False, kw_only=True)
class Linked:
    executor: Executor
    server: EngineServer
    front: RemoteEngine
    endpoint: str
    outputs_messages: int = 0  # OUTPUTS messages the front received


@pytest.fixture
async def linked(model: TinyModel, tmp_path: Path) -> AsyncIterator[Linked]:
    """An engine serving two fronts' worth of ids; this test is front 0."""
    executor = make_executor(model)
    endpoint = f"ipc://{tmp_path / 'engine'}"
    router = open_socket(zmq.ROUTER)
    router.bind(endpoint)
    server = EngineServer(
        executor=executor,
        num_fronts=2,
        tokenizer_json=model.tokenizer.to_json(),
        link=Link(socket=router),
    )
    dealer = open_socket(zmq.DEALER, identity=b"api0")
    dealer.connect(endpoint)
    front = RemoteEngine(
        facts=engine_facts(executor), registry=executor.metrics.registry, link=Link(socket=dealer)
    )
    linked = Linked(executor=executor, server=server, front=front, endpoint=endpoint)

    def counting(frames: list[bytes]) -> None:
        linked.outputs_messages += frames[0][1:2] == bytes([Kind.OUTPUTS])
        front.on_message(frames)

    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        await nursery.start(server.run)
        nursery.start_soon(front.link.run, counting)
        front.hello(0)
        with trio.fail_after(TIMEOUT_S):
            await front.connected.wait()
        yield linked
        nursery.cancel_scope.cancel()
    front.link.close()  # the pumps are done
    server.link.close()


def choices(ids: list[int], max_tokens: int) -> list[Request]:
    return [
        Request(
            request_id=i,
            prompt_token_ids=list(PROMPT),
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            arrival_time=time.monotonic(),
        )
        for i in ids
    ]


async def read(handle: RequestHandle) -> list[RequestOutput]:
    with trio.fail_after(TIMEOUT_S):
        return [output async for output in handle.outputs]


def token_ids(outputs: list[RequestOutput]) -> list[int]:
    assert outputs[-1].finish_reason is FinishReason.LENGTH, outputs[-1]
    return [t for out in outputs for t in out.token_ids]


def assert_idle(executor: Executor) -> None:
    pool = executor.scheduler.statistics().pool
    assert executor.num_active() == 0
    assert pool.free_blocks + pool.reusable_blocks == pool.total_blocks, pool


async def test_outputs_come_back_equal_to_the_executor_s_and_in_batches(linked: Linked) -> None:
    [direct] = linked.executor.submit_group(choices([1001], 8))
    expected = token_ids(await read(direct))
    handles = linked.front.submit_group(choices([0, 2], 8))
    outputs = [await read(handle) for handle in handles]
    assert [token_ids(outs) for outs in outputs] == [expected, expected]
    # Both choices' outputs of one step travel together: fewer messages than outputs.
    assert linked.outputs_messages < sum(len(outs) for outs in outputs)
    assert linked.server.bad_frames == 0


async def test_an_abort_from_the_front_frees_the_blocks(linked: Linked) -> None:
    [handle] = linked.front.submit_group(choices([4], 200))
    with trio.fail_after(TIMEOUT_S):
        await handle.outputs.receive()
    linked.front.abort(4)
    outputs = await read(handle)  # the rest, up to the closing record
    assert outputs[-1].finish_reason is FinishReason.ABORT
    # A step still in flight may hold its blocks: a later request's end comes after that step.
    [later] = linked.front.submit_group(choices([6], 2))
    assert len(token_ids(await read(later))) == 2
    assert_idle(linked.executor)


async def test_malformed_frames_are_counted_and_the_engine_keeps_serving(
    linked: Linked,
) -> None:
    rogue = open_socket(zmq.DEALER, identity=b"rogue")
    rogue.setsockopt(zmq.RCVTIMEO, int(TIMEOUT_S * 1000))  # a receive that waits in vain raises
    rogue.connect(linked.endpoint)
    group = SubmitGroup(
        request_ids=(1,),  # front 0 of 2 owns the even ids only
        prompt_token_ids=tuple(PROMPT),
        samplings=(SamplingParams(max_tokens=2),),
        request_type=choices([1], 2)[0].request_type,
        arrival_time=time.monotonic(),
    )
    frames = [
        b"\xc1",  # not msgpack
        pack([Kind.ABORT, 0]),  # before HELLO
        pack([Kind.HELLO, 7]),  # no such front
        pack([Kind.HELLO, 0]),
        encode_submit(group),  # another front's id
        pack([Kind.SUBMIT, {"request_ids": "x"}]),  # not a SubmitGroup
        pack([Kind.OUTPUTS, []]),  # not a front's message
    ]
    try:
        for frame in frames:
            rogue.send(frame)
        # One pipe delivers in order: once a call sent last is answered, all came before it.
        rogue.send(pack([Kind.CALL, 1, Call.METRICS, None]))
        while (await trio.to_thread.run_sync(rogue.recv_multipart))[0][1:2] != bytes([Kind.REPLY]):
            pass  # the STATE that answered its HELLO
    finally:
        rogue.close(linger=0)
    assert linked.server.bad_frames == len(frames) - 1
    [handle] = linked.front.submit_group(choices([6], 4))
    assert len(token_ids(await read(handle))) == 4
    assert_idle(linked.executor)
