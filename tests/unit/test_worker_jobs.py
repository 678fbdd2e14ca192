"""A choice's reader (`jobs.ChoiceRun`): outputs that queued up while its client was behind come
out as one, so a slow stream costs one chunk and one write per read, not one per token."""

from __future__ import annotations

import math

import attrs
import trio
import trio.testing

from trtdisagg.api.fanout import ChoicePlan
from trtdisagg.worker.engine.live import RequestHandle
from trtdisagg.worker.engine.outputs import RequestOutput
from trtdisagg.worker.http.jobs import ChoiceRun
from trtdisagg.worker.request import FinishReason, Request, SamplingParams
from trtdisagg.worker.token_logprobs import TokenLogprobs


@attrs.define
class Aborts:
    """Stands in for the executor: records aborts."""

    aborted: list[int] = attrs.Factory(list)

    def abort(self, request_id: int) -> None:
        self.aborted.append(request_id)


def output(
    token: int, *, reason: FinishReason | None = None, error: str | None = None
) -> RequestOutput:
    return RequestOutput(
        token_ids=(token,),
        text=chr(token),
        logprobs=(TokenLogprobs(logprob=-float(token), top=()),),
        finish_reason=reason,
        num_prompt_tokens=3,
        num_cached_tokens=0,
        num_output_tokens=token - 96,
        error=error,
    )


def run_with(*outputs: RequestOutput) -> tuple[ChoiceRun, Aborts]:
    send, receive = trio.open_memory_channel[RequestOutput](math.inf)
    for out in outputs:
        send.send_nowait(out)
    request = Request(
        request_id=1,
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=8),
        arrival_time=0.0,
    )
    aborts = Aborts()
    plan = ChoicePlan(index=0, prompt_index=0, sample_index=0, prompt=None, seed=None)
    run = ChoiceRun(
        plan=plan,
        handle=RequestHandle(request=request, outputs=receive),
        engine=aborts,  # type: ignore[arg-type]
    )
    return run, aborts


async def test_queued_outputs_come_out_as_one() -> None:
    run, aborts = run_with(output(97), output(98), output(99, reason=FinishReason.LENGTH))
    outs = [out async for out in run]
    assert len(outs) == 1
    (joined,) = outs
    assert joined.token_ids == (97, 98, 99) and joined.text == "abc"
    assert [lp.logprob for lp in joined.logprobs if lp is not None] == [-97.0, -98.0, -99.0]
    assert joined.finish_reason is FinishReason.LENGTH and joined.num_output_tokens == 3
    assert run.done and not aborts.aborted


async def test_queued_outputs_keep_the_prompt_s_logprobs_of_the_first() -> None:
    prompt = (TokenLogprobs(logprob=-1.0, top=()), TokenLogprobs(logprob=-2.0, top=()))
    first = attrs.evolve(output(97), prompt_logprobs=prompt)  # echo: only the first has them
    run, _ = run_with(first, output(98), output(99, reason=FinishReason.LENGTH))
    (joined,) = [out async for out in run]
    assert joined.token_ids == (97, 98, 99) and joined.prompt_logprobs == prompt


async def test_an_error_is_read_after_the_text_before_it() -> None:
    run, _ = run_with(output(97), output(98), output(99, reason=FinishReason.ERROR, error="boom"))
    outs = [out async for out in run]
    assert [out.token_ids for out in outs] == [(97, 98), (99,)]
    assert outs[0].error is None and outs[1].error == "boom"


async def test_a_reader_that_keeps_up_gets_each_output() -> None:
    send, receive = trio.open_memory_channel[RequestOutput](math.inf)
    run, _ = run_with()
    run.handle = RequestHandle(request=run.handle.request, outputs=receive)
    got: list[tuple[int, ...]] = []
    async with trio.open_nursery() as nursery:

        async def read() -> None:
            async for out in run:
                got.append(out.token_ids)

        nursery.start_soon(read)
        for token in (97, 98):
            await send.send(output(token))
            await trio.testing.wait_all_tasks_blocked()
        await send.send(output(99, reason=FinishReason.STOP))
    assert got == [(97,), (98,), (99,)]


async def test_a_stream_interval_holds_later_outputs_until_enough_tokens() -> None:
    send, receive = trio.open_memory_channel[RequestOutput](math.inf)
    run, _ = run_with()
    run.handle = RequestHandle(request=run.handle.request, outputs=receive)
    run.interval = 3
    got: list[tuple[int, ...]] = []
    async with trio.open_nursery() as nursery:

        async def read() -> None:
            async for out in run:
                got.append(out.token_ids)

        nursery.start_soon(read)
        for token in range(97, 104):  # the first alone (TTFT), then three at a time
            await send.send(output(token))
            await trio.testing.wait_all_tasks_blocked()
        await send.send(output(104, reason=FinishReason.STOP))  # the end comes out at once
    assert got == [(97,), (98, 99, 100), (101, 102, 103), (104,)]
