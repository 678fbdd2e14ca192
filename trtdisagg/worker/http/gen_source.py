"""What a generation_only request carries from ctx's answer, checked as any peer's input is.

ctx's answer (`disaggregated_params`) names the transfer (`transfer_key`), where the KV comes
from (`ctx_info_endpoint`, and ctx's instance in `opaque_state`: handoff.py), the first token ctx
sampled for each of the request's choices, and what ctx computed that gen cannot (the first
tokens' logprobs). Each is a 400 naming the field when it does not fit this request and vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from trtdisagg.api.errors import bad_request
from trtdisagg.api.protocol import DisaggregatedParams, FirstTokenLogprobs
from trtdisagg.transfer.protocol.rank_info import is_tcp_endpoint
from trtdisagg.worker.engine.live import GenerationSource
from trtdisagg.worker.http.handoff import ctx_instance_of
from trtdisagg.worker.token_logprobs import TokenLogprobs

MAX_TOP_LOGPROBS: Final = 20


def generation_source(
    params: DisaggregatedParams, vocab_size: int, n: int, prompt: Sequence[int]
) -> GenerationSource:
    """Validate what a generation_only request must carry from ctx's answer."""
    field = "disaggregated_params"
    firsts = _first_tokens(params, vocab_size, n)
    if not firsts and params.schedule_style != "generation_first":
        raise bad_request(
            f"{field}.first_gen_tokens: required for generation_only (unless "
            f"{field}.schedule_style is generation_first: then ctx sends it with the KV)",
            param=field,
        )
    if not params.ctx_info_endpoint:
        raise bad_request(f"{field}.ctx_info_endpoint: required for generation_only", param=field)
    if not is_tcp_endpoint(params.ctx_info_endpoint):
        endpoint = params.ctx_info_endpoint
        raise bad_request(
            f"{field}.ctx_info_endpoint: expected tcp://host:port, got {endpoint!r}", param=field
        )
    key = params.transfer_key or params.disagg_request_id
    if key is None or not 0 < key < 2**64:
        raise bad_request(
            f"{field}.transfer_key: required for generation_only (ctx's answer has it), or the "
            f"disagg_request_id the ctx leg was given",
            param=field,
        )
    return GenerationSource(
        key=key,
        ctx_info_endpoint=params.ctx_info_endpoint,
        first_tokens=firsts,
        ctx_instance=ctx_instance_of(params.opaque_state),
        first_logprobs=_first_logprobs(params, firsts, vocab_size),
        num_choices=n,
        prompt_logprobs=_prompt_logprobs(params, prompt, vocab_size),
    )


def _prompt_logprobs(
    params: DisaggregatedParams, prompt: Sequence[int], vocab_size: int
) -> tuple[TokenLogprobs, ...]:
    """ctx's logprobs of prompt tokens 1, 2, ... (echo with logprobs), one for each."""
    field = "disaggregated_params.prompt_logprobs"
    carried = params.prompt_logprobs
    if carried is None:
        return ()
    if len(carried) != len(prompt) - 1:
        raise bad_request(
            f"{field}: {len(carried)} entries for a prompt of {len(prompt)} tokens (one for "
            "each but the first)",
            param="disaggregated_params",
        )
    return tuple(
        _checked_logprobs(entry, token, f"{field}[{i}]", vocab_size)
        for i, (entry, token) in enumerate(zip(carried, prompt[1:], strict=True))
    )


def _first_tokens(params: DisaggregatedParams, vocab_size: int, n: int) -> tuple[int, ...]:
    """ctx's first token of each of the request's `n` choices (none: generation_first)."""
    field = "disaggregated_params"
    single = params.first_gen_tokens[:1] if params.first_gen_tokens else []
    by_choice = params.first_gen_tokens_by_choice
    if by_choice is None:
        if n > 1 and single:
            raise bad_request(
                f"{field}.first_gen_tokens_by_choice: required for n = {n} (ctx's first token "
                "of each choice)",
                param=field,
            )
        firsts = tuple(single)
    else:
        if len(by_choice) != n:
            raise bad_request(
                f"{field}.first_gen_tokens_by_choice: {len(by_choice)} tokens for n = {n}",
                param=field,
            )
        if single and single[0] != by_choice[0]:
            raise bad_request(
                f"{field}.first_gen_tokens: {single[0]} is not choice 0's first token "
                f"({by_choice[0]})",
                param=field,
            )
        firsts = tuple(by_choice)
    bad = next((t for t in firsts if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"{field}.first_gen_tokens: token {bad} outside the vocabulary", param=field
        )
    return firsts


def _first_logprobs(
    params: DisaggregatedParams, firsts: tuple[int, ...], vocab_size: int
) -> tuple[TokenLogprobs | None, ...]:
    """ctx's logprobs of each first token, checked as any peer's input is."""
    field = "disaggregated_params.first_gen_logprobs"
    carried = params.first_gen_logprobs
    if not carried:
        return ()
    if len(carried) != len(firsts):
        raise bad_request(
            f"{field}: {len(carried)} entries for {len(firsts)} first tokens",
            param="disaggregated_params",
        )
    return tuple(
        _checked_logprobs(entry, token, f"{field}[{i}]", vocab_size)
        for i, (entry, token) in enumerate(zip(carried, firsts, strict=True))
    )


def _checked_logprobs(
    entry: FirstTokenLogprobs, token: int | None, where: str, vocab_size: int
) -> TokenLogprobs:
    """One token's logprobs from a peer: its id (`token`, when known), a bounded top list, ids
    of this vocabulary and logprobs that are logprobs."""
    if token is not None and entry.token_id != token:
        raise bad_request(
            f"{where}.token_id: {entry.token_id} is not its token ({token})",
            param="disaggregated_params",
        )
    if len(entry.top_logprobs) > MAX_TOP_LOGPROBS:
        raise bad_request(
            f"{where}.top_logprobs: at most {MAX_TOP_LOGPROBS} entries",
            param="disaggregated_params",
        )
    top = tuple((t.token_id, t.logprob) for t in entry.top_logprobs)
    for tid, value in ((entry.token_id, entry.logprob), *top):
        if not 0 <= tid < vocab_size or math.isnan(value) or value > 0:
            raise bad_request(
                f"{where}: token {tid} with logprob {value} is not a token of this "
                f"vocabulary ({vocab_size}) with a logprob <= 0",
                param="disaggregated_params",
            )
    if entry.rank is not None and not 1 <= entry.rank <= vocab_size:
        raise bad_request(
            f"{where}.rank: {entry.rank} is not a rank in a vocabulary of {vocab_size}",
            param="disaggregated_params",
        )
    return TokenLogprobs(logprob=entry.logprob, top=top, rank=entry.rank)
