"""The output processor: a step's tokens in, each request's text, stop decision and timings out.

Token t reads as the letter chr(t) (tests/engine_parts.py), so texts are easy to state.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tests.engine_parts import HOLD, make_live
from trtdisagg.worker.engine.ending import Blocks, Ending
from trtdisagg.worker.engine.live import Live
from trtdisagg.worker.engine.outputs import OutputProcessor, Processed, RequestOutput, Token
from trtdisagg.worker.request import FinishReason, RequestType
from trtdisagg.worker.token_logprobs import TokenLogprobs

A, B, C = (ord(c) for c in "abc")
EOS = 2


def processor(
    ttft: list[float] | None = None, itl: list[float] | None = None, max_seq_len: int = 256
) -> OutputProcessor:
    return OutputProcessor(
        eos_token_ids=frozenset({EOS}),
        max_seq_len=max_seq_len,
        observe_first_token=(ttft if ttft is not None else []).append,
        observe_inter_token=(itl if itl is not None else []).append,
    )


def feed(
    outputs: OutputProcessor, live: Live, tokens: Sequence[int], now: float = 1.0
) -> list[Processed]:
    """Each token as its own step, appended first as the loop does."""
    done = []
    for token in tokens:
        live.request.output_token_ids.append(token)
        (processed,) = outputs.process([Token(live=live, token_id=token)], now)
        done.append(processed)
    return done


def text(processed: Sequence[Processed]) -> str:
    return "".join(p.output.text for p in processed)


def test_text_streams_and_the_last_token_ends_at_max_tokens() -> None:
    live, _ = make_live(max_tokens=3)
    done = feed(processor(), live, [A, HOLD, B])
    assert [p.output.text for p in done] == ["a", "", "+b"]
    assert [p.ending for p in done] == [None, None, Ending.finished(FinishReason.LENGTH)]
    last = done[-1].output
    assert last.finish_reason is FinishReason.LENGTH and last.num_output_tokens == 3
    assert last.perf is not None and done[0].output.perf is None  # timings with the last only


def test_the_held_back_text_comes_out_when_the_request_ends() -> None:
    live, _ = make_live(max_tokens=2)
    assert text(feed(processor(), live, [A, HOLD])) == "a+"


def test_a_stop_string_is_never_shown_and_ends_the_request() -> None:
    live, _ = make_live(stop=["bc"])
    done = feed(processor(), live, [A, B, C])
    assert [p.output.text for p in done] == ["a", "", ""]  # "b" might start the stop string
    assert done[-1].ending == Ending.finished(FinishReason.STOP)


def test_text_held_for_a_stop_string_that_never_matched_is_released() -> None:
    live, _ = make_live(stop=["bc"], max_tokens=2)
    assert text(feed(processor(), live, [A, B])) == "ab"


@pytest.mark.parametrize(("ignore_eos", "ends"), [(False, True), (True, False)])
def test_eos_stops_unless_ignored(ignore_eos: bool, ends: bool) -> None:
    live, _ = make_live(ignore_eos=ignore_eos)
    (done,) = feed(processor(), live, [EOS])
    assert (done.ending is not None) is ends
    assert done.output.token_ids == (EOS,)


def test_a_stop_token_id_stops() -> None:
    live, _ = make_live(stop_token_ids=[C])
    done = feed(processor(), live, [A, C])
    assert done[-1].ending == Ending.finished(FinishReason.STOP) and text(done) == "a"


def test_the_context_length_ends_a_request_before_its_max_tokens() -> None:
    live, _ = make_live(list(range(100, 110)), max_tokens=8)
    done = feed(processor(max_seq_len=12), live, [A, B])
    assert done[-1].ending == Ending.finished(FinishReason.LENGTH)


def test_a_context_only_request_hands_over_at_its_first_token() -> None:
    live, _ = make_live(request_type=RequestType.CONTEXT_ONLY, transfer_key=3)
    (done,) = feed(processor(), live, [A])
    assert done.ending == Ending.handed_over() and done.ending.blocks is Blocks.SEND
    assert done.output.context_done and done.output.finish_reason is None
    assert done.output.perf is not None


def test_a_context_only_request_stopped_at_its_first_token_just_finishes() -> None:
    live, _ = make_live(request_type=RequestType.CONTEXT_ONLY, transfer_key=3, max_tokens=1)
    (done,) = feed(processor(), live, [A])
    assert done.ending == Ending.finished(FinishReason.LENGTH) and not done.output.context_done


def test_a_step_for_many_requests_and_its_latencies() -> None:
    ttft: list[float] = []
    itl: list[float] = []
    outputs = processor(ttft, itl)
    first, _ = make_live(arrival=10.0)
    second, _ = make_live(arrival=11.0)
    for live in (first, second):
        live.request.output_token_ids.append(A)
    done = outputs.process([Token(live=first, token_id=A), Token(live=second, token_id=A)], 12.0)
    assert [p.live for p in done] == [first, second]
    assert ttft == [2.0, 1.0] and itl == []
    first.request.output_token_ids.append(B)
    outputs.process([Token(live=first, token_id=B)], 12.5)
    assert itl == [0.5]


def test_timings_of_the_phases() -> None:
    live, _ = make_live(arrival=10.0, max_tokens=2)
    live.state.scheduled(11.0)
    live.state.scheduled(11.5)  # the first step counts
    outputs = processor()
    feed(outputs, live, [A], now=13.0)
    (last,) = feed(outputs, live, [B], now=16.0)
    perf = last.output.perf
    assert perf is not None
    assert (perf.queue_s, perf.prefill_s, perf.first_token_s, perf.decode_s) == (1.0, 2.0, 3.0, 3.0)


def test_a_gen_request_has_its_first_token_before_its_first_step() -> None:
    live, _ = make_live(arrival=10.0, max_tokens=1, request_type=RequestType.GENERATION_ONLY)
    live.state.transferred(4096, 0.5)
    (done,) = feed(processor(), live, [A], now=12.0)  # ctx's token, as its KV landed
    perf = done.output.perf
    assert perf is not None
    assert (perf.queue_s, perf.prefill_s, perf.first_token_s) == (2.0, 0.0, 2.0)
    assert (perf.kv_transfer_bytes, perf.kv_transfer_s) == (4096, 0.5)


def test_the_closing_output_of_a_request_ended_without_a_token() -> None:
    outputs = processor()
    live, _ = make_live(stop=["bc"])
    feed(outputs, live, [A, B])
    dropped = outputs.closing(live, Ending.dropped(FinishReason.LENGTH), 2.0)
    assert (dropped.text, dropped.token_ids, dropped.finish_reason) == (
        "b",
        (),
        FinishReason.LENGTH,
    )
    failed = outputs.closing(live, Ending.failed("the step raised"), 2.0)
    assert (failed.text, failed.error, failed.internal) == ("", "the step raised", True)
    assert failed.finish_reason is FinishReason.ERROR and failed.perf is not None
    upstream = outputs.closing(live, Ending.transfer_failed("ctx is gone"), 2.0)
    assert upstream.error == "ctx is gone" and not upstream.internal


def test_joined_outputs_keep_the_first_one_s_prompt_logprobs() -> None:
    """A reader that fell behind joins a choice's first output (which carries the echoed
    prompt's logprobs) with the next: the prompt's logprobs must survive the join."""
    prompt = (TokenLogprobs(logprob=-0.5, top=((3, -0.5),)),)

    def output(token: int, carried: tuple[TokenLogprobs, ...] | None = None) -> RequestOutput:
        return RequestOutput(
            token_ids=(token,), text=f"t{token}", logprobs=(None,), finish_reason=None,
            num_prompt_tokens=2, num_cached_tokens=0, num_output_tokens=token,
            prompt_logprobs=carried,
        )  # fmt: skip

    joined = output(1, prompt).then(output(2))
    assert joined.prompt_logprobs == prompt and joined.token_ids == (1, 2)
    assert output(1).then(output(2)).prompt_logprobs is None
