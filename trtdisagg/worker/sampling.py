"""Token sampling from one step's logits: greedy, temperature, top-k, top-p, seeded.

Each request owns a `torch.Generator`. A request draws only when a step produces its next token,
so its random stream does not depend on batch composition or on preemption, and a seeded
request repeats exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs
import torch

from trtdisagg.worker.request import SamplingParams


@attrs.frozen(kw_only=True)
class TokenLogprobs:
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


@attrs.frozen(kw_only=True)
class SampleSpec:
    params: SamplingParams
    generator: torch.Generator | None
    suppress: frozenset[int] = frozenset()  # e.g. EOS before min_tokens is reached
    # A prompt's other choices, at its first token: each draws its own token from the same
    # logits row with its own spec (the runner samples the row once per spec).
    forks: tuple[SampleSpec, ...] = ()
    # The tokens its grammar allows next (`worker/grammar.py`): llguidance's bitmask, int32
    # [ceil(V / 32)] on the host, bit i % 32 of word i // 32 set when token i is allowed.
    allowed: torch.Tensor | None = None


MIN_TEMPERATURE: Final = 1e-5
"""Below this a temperature samples greedily: logits / temperature overflows float32, the softmax
turns to NaN and `torch.multinomial` raises (greedy is the limit as the temperature goes to 0)."""


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor, specs: Sequence[SampleSpec]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: float32 [S, V], one row per spec. Returns token ids and optional logprobs."""
    tokens: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    for row, spec in zip(logits, specs, strict=True):
        shown = row
        if spec.suppress:
            row = shown = row.clone()
            row[list(spec.suppress)] = float("-inf")
        if spec.allowed is not None:
            masked = mask_disallowed(row, spec.allowed)
            # EOS suppressed before min_tokens where the grammar allows nothing else: the
            # grammar wins (the output must end).
            row = (
                masked
                if bool(torch.isfinite(masked).any())
                else mask_disallowed(shown, spec.allowed)
            )
        token = _sample_row(row, spec)
        tokens.append(token)
        # A grammar changes which token is drawn, not its logprob (an allowed token's logprob
        # under the model; a masked one would be -inf).
        logprobs.append(
            _logprobs(shown if spec.allowed is not None else row, token, spec.params.logprobs)
        )
    return tokens, logprobs


def mask_disallowed(row: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """`row` (logits [V]) with every token its bitmask does not allow at -inf: one masked_fill.
    (The batched sampler applies the same bitmasks on the device, for every row at once.)"""
    shifts = torch.arange(32, dtype=torch.int32, device=row.device)
    bits = (allowed.to(row.device).unsqueeze(-1) >> shifts) & 1  # [W, 32]
    keep = bits.flatten()[: row.shape[-1]].bool()
    return row.masked_fill(~keep, float("-inf"))


def _sample_row(row: torch.Tensor, spec: SampleSpec) -> int:
    params = spec.params
    if params.temperature < MIN_TEMPERATURE or params.top_k == 1:
        return int(torch.argmax(row).item())
    scaled = row / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays (a
        # top_p below float32's smallest value compares as 0, which would drop every token).
        drop = cumulative - sorted_probs >= params.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    choice = torch.multinomial(probs, 1, generator=spec.generator)
    return int(choice.item())


def skip_sample(generator: torch.Generator, params: SamplingParams, width: int) -> None:
    """Advance `generator` as `sample` drawing one token over `width` logits does, without the
    token: a seeded generation_only request continues the random stream its first token (ctx's)
    was drawn from. Mirrors `_sample_row`: greedy draws nothing, and `multinomial` with one
    sample takes `width` exponentials whatever the probabilities."""
    if params.temperature < MIN_TEMPERATURE or params.top_k == 1:
        return
    uniform = torch.ones(width, device=generator.device)
    torch.multinomial(uniform, 1, generator=generator)


def _logprobs(row: torch.Tensor, token: int, top_n: int | None) -> TokenLogprobs | None:
    if top_n is None:
        return None
    logp = torch.log_softmax(row.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        values, ids = torch.topk(logp, top_n)
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(logprob=float(logp[token].item()), top=top)


def prompt_token_logprobs(
    rows: torch.Tensor, targets: Sequence[int], top_n: int
) -> list[TokenLogprobs]:
    """rows: float32 [K, V], the logits of K positions; targets: the prompt token each position
    is followed by. Each target's logprob, with the `top_n` most likely tokens, in one host
    sync for the K of them."""
    logp = torch.log_softmax(rows.float(), dim=-1)
    index = torch.tensor(list(targets), device=rows.device).unsqueeze(1)
    values = logp.gather(1, index).squeeze(1).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(targets)
    if top_n > 0:
        top_values, top_ids = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)
        tops = [
            tuple(zip(ids, vals, strict=True))
            for ids, vals in zip(top_ids.tolist(), top_values.tolist(), strict=True)
        ]
    return [TokenLogprobs(logprob=v, top=t) for v, t in zip(values, tops, strict=True)]
