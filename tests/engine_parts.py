"""Requests as the engine holds them (`Live`), for the pure engine parts' unit tests.

No model and no tokenizer: a stand-in detokenizer turns token `t` into the letter `chr(t)` and
holds back the "first byte" of a two-token character (`HOLD`), as a real one holds back an
incomplete UTF-8 sequence.
"""

from __future__ import annotations

import itertools
import math

import attrs
import trio

from trtdisagg.kv.block_pool import BlockPool
from trtdisagg.transfer.protocol.sessions import TransferOutcome
from trtdisagg.worker.engine.live import GenerationSource, Live
from trtdisagg.worker.engine.outputs import OutputState, RequestOutput
from trtdisagg.worker.request import Request, RequestType, SamplingParams
from trtdisagg.worker.sampling import SampleSpec
from trtdisagg.worker.scheduler import Scheduler
from trtdisagg.worker.stopping import StopStrings

TOKENS_PER_BLOCK = 4
VOCAB = 1000
HOLD = 1  # a token that completes no character by itself: the next one completes it


@attrs.define(eq=False)
class LetterDetokenizer:
    """Token t is the letter chr(t); HOLD waits for the next token, and both give '+' + it."""

    held: bool = False

    def add(self, token_id: int) -> str:
        if token_id == HOLD:
            self.held = True
            return ""
        text = ("+" if self.held else "") + chr(token_id)
        self.held = False
        return text

    def flush(self) -> str:
        held, self.held = self.held, False
        return "+" if held else ""


def make_scheduler(num_blocks: int = 16, *, max_batch_size: int = 8) -> Scheduler:
    pool = BlockPool(
        num_blocks=num_blocks, tokens_per_block=TOKENS_PER_BLOCK, enable_block_reuse=True
    )
    return Scheduler(pool=pool, max_batch_size=max_batch_size, max_num_tokens=64, max_seq_len=256)


_ids = itertools.count(1)


def make_live(
    prompt: list[int] | None = None,
    *,
    request_type: RequestType = RequestType.CONTEXT_AND_GENERATION,
    source: GenerationSource | None = None,
    transfer_key: int | None = None,
    arrival: float = 0.0,
    **sampling: object,
) -> tuple[Live, trio.MemoryReceiveChannel[RequestOutput]]:
    """A request the engine would hold, and the channel its handler would read."""
    params = SamplingParams(**{"max_tokens": 8, **sampling})
    request = Request(
        request_id=next(_ids),
        prompt_token_ids=list(prompt or range(100, 110)),
        sampling=params,
        request_type=request_type,
        arrival_time=arrival,
    )
    send, receive = trio.open_memory_channel[RequestOutput](math.inf)
    state = OutputState(detokenizer=LetterDetokenizer(), stops=StopStrings(stops=params.stop))
    live = Live(
        request=request,
        outputs=send,
        state=state,
        spec=SampleSpec(params=params, generator=None),
        source=source,
        transfer_key=transfer_key,
    )
    return live, receive


def gen_live(
    key: int, *, first_token: int | None = 7, prompt_len: int = 10, forks: tuple[int, ...] = ()
) -> Live:
    """A generation_only request whose KV comes under `key`; with `forks`, a request of
    1 + len(forks) choices, whose other choices' first tokens ctx sent too."""
    firsts = () if first_token is None else (first_token, *forks)
    source = GenerationSource(
        key=key, ctx_info_endpoint="tcp://ctx:1", first_tokens=firsts, num_choices=1 + len(forks)
    )
    prompt = list(range(100, 100 + prompt_len))
    live, _ = make_live(prompt, request_type=RequestType.GENERATION_ONLY, source=source)
    for choice in range(1, 1 + len(forks)):
        fork, _ = make_live(prompt, request_type=RequestType.GENERATION_ONLY)
        fork.choice, fork.leader = choice, live
        live.forks.append(fork)
    return live


def outcome(key: int, *, ok: bool = True, **fields: object) -> TransferOutcome:
    return TransferOutcome(key=key, ok=ok, **fields)
