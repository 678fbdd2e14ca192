"""A prompt's `n` choices: one prefill, one KV transfer, then forks (pure).

The service submits a prompt's choices together (`Executor.submit_group`). Choice 0 leads: its
request is the one the scheduler prefills (or, on gen, the one whose KV comes from ctx). The
others wait in the leader's `forks`, with no request in the scheduler, until their first tokens
are known:

- on a worker alone, the step that samples the leader's first token samples one for every
  choice, each with its own spec (seed stream, grammar) from the same logits row
  (`SampleSpec.forks`);
- on gen, ctx's answer (or its KV transfer, under generation_first) brings one per choice.

Then `start_choices` gives each fork its first token and forks the leader's blocks
(`Scheduler.fork`, copy-on-write): from there on each choice is a request of its own. On ctx the
choices never decode: they ride the leader's hand-over (`hand_over_together`): every choice's
first token goes to gen with ctx's answer, and the prompt's KV once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from trtdisagg.worker.engine.ending import Blocks, Ending
from trtdisagg.worker.request import RequestType

if TYPE_CHECKING:
    from trtdisagg.worker.engine.live import Live
    from trtdisagg.worker.engine.outputs import Processed, Token
    from trtdisagg.worker.scheduler import Scheduler


def start_choices(scheduler: Scheduler, leader: Live, firsts: Sequence[Token]) -> None:
    """The leader has its first token (output 0); `firsts` are its forks' first tokens, one
    per fork, in order. Each fork takes its own as output 0 and, unless the request is ctx's
    (context_only), starts from the leader's KV as a request of its own."""
    forks = leader.forks
    if [token.live for token in firsts] != forks:
        raise AssertionError(
            f"request {leader.request_id}: first tokens for {len(firsts)} forks, "
            f"it has {len(forks)}"
        )
    for token in firsts:
        token.live.request.output_token_ids.append(token.token_id)
        token.live.state.prompt_logprobs = leader.state.prompt_logprobs  # one prompt for all
    if leader.request.request_type is RequestType.CONTEXT_ONLY:
        return  # they ride the leader's hand-over: nothing of theirs enters the scheduler
    scheduler.fork(leader.request, [fork.request for fork in forks])
    for fork in forks:
        fork.leader = None
    leader.forks = []


def hand_over_together(processed: Sequence[Processed]) -> list[Processed]:
    """ctx: a context_only request's choices end at their first tokens together. When any of
    them goes on (its ending hands over), they all do: each output becomes a context_done one,
    and the leader's ending hands its KV over, even when its own token ended it (gen ends
    that choice again when it replays the token). When none goes on, each ends as it said."""
    groups: dict[int, list[Processed]] = {}
    for item in processed:
        lead = item.live.leader or item.live
        groups.setdefault(id(lead), []).append(item)
    out: list[Processed] = []
    for group in groups.values():
        first = group[0].live
        lead = first.leader or first
        if (
            len(group) == 1
            or lead.request.request_type is not RequestType.CONTEXT_ONLY
            or not any(
                item.ending is not None and item.ending.blocks is Blocks.SEND for item in group
            )
        ):
            out += group
            continue
        group.sort(key=lambda item: item.live is not lead)  # the leader sends the KV first
        for item in group:
            output = attrs.evolve(item.output, finish_reason=None, context_done=True)
            out.append(attrs.evolve(item, output=output, ending=Ending.handed_over()))
    return out
