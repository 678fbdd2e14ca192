"""A slow reference of `trtdisagg.worker.sampling`: one row at a time, each control written out
as its definition (Python loops over the listed tokens), for the tests to hold the batched
sampler equal to.

Arithmetic is float32 throughout, as on the device, so that equal inputs give equal tokens, not
merely close ones. The random draw is the row's own: `noise` is that row's `V` exponentials.
"""

from __future__ import annotations

import collections

import attrs
import torch

from trtdisagg.worker.request import MIN_TEMPERATURE, SamplingParams
from trtdisagg.worker.sampling import (
    SampleSpec,
    TokenHistory,
    make_generator,
)
from trtdisagg.worker.token_logprobs import TokenLogprobs

CPU = torch.device("cpu")
NEG_INF = float("-inf")


@attrs.frozen(kw_only=True)
class Row:
    """One row's request, from which a fresh spec (and a fresh seeded generator) is made."""

    params: SamplingParams
    suppress: frozenset[int] = frozenset()
    prompt: tuple[int, ...] = (1,)
    output: tuple[int, ...] = ()
    allowed: tuple[int, ...] | None = None  # mask words

    def spec(self) -> SampleSpec:
        seed = self.params.seed
        history = TokenHistory(prompt=list(self.prompt), output=list(self.output))
        mask = None if self.allowed is None else torch.tensor(self.allowed, dtype=torch.int32)
        return SampleSpec(
            params=self.params,
            generator=None if seed is None else make_generator(seed, CPU),
            suppress=self.suppress,
            history=history if self.params.penalized else None,
            allowed=mask,
        )

    def noise(self, width: int) -> torch.Tensor | None:
        if self.params.seed is None:
            return None
        return torch.empty(width).exponential_(generator=make_generator(self.params.seed, CPU))


def f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def reference_logits(row: torch.Tensor, spec: SampleSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits the draw starts from, the log-softmax logprobs report) for one row; the
    first is the raw logits with the mask applied until the logprobs are taken."""
    x = row.float().clone()
    width = x.numel()
    if spec.allowed is not None:
        words = spec.allowed.tolist()
        for token in range(width):
            word = token // 32
            if word >= len(words) or not (words[word] >> (token % 32)) & 1:
                x[token] = NEG_INF
    logprobs = torch.log_softmax(x, dim=-1)
    params = spec.params
    for token in spec.suppress:
        x[token] = NEG_INF
    for token, bias in params.logit_bias:
        x[token] = x[token] + f32(bias)
    if params.penalized:
        assert spec.history is not None
        counts = collections.Counter(spec.history.output)
        if params.repetition_penalty != 1.0:
            r = f32(params.repetition_penalty)
            for token in set(spec.history.prompt) | set(counts):
                x[token] = x[token] / r if x[token] > 0 else x[token] * r
        for token, count in counts.items():
            x[token] = x[token] - f32(params.frequency_penalty) * f32(count)
            x[token] = x[token] - f32(params.presence_penalty)
    return x, logprobs


def reference_truncated(x: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    """The tempered logits of a random row, with the tokens min_p, top_k and top_p drop at -inf."""
    params = spec.params
    scaled = x / f32(params.temperature)
    if params.min_p > 0:
        scaled[scaled < scaled.max() + torch.log(f32(params.min_p))] = NEG_INF
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled[scaled < kth] = NEG_INF
    if params.top_p < 1.0:
        ordered = torch.sort(scaled, descending=True).values
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        kept = 1
        while kept < ordered.numel() and before[kept] < params.top_p and ordered[kept] > NEG_INF:
            kept += 1
        scaled[scaled < ordered[kept - 1]] = NEG_INF
    return scaled


def reference_sample(
    row: torch.Tensor, spec: SampleSpec, noise: torch.Tensor | None
) -> tuple[int, TokenLogprobs | None]:
    """One row's token and logprobs. `noise` is needed unless the row is greedy."""
    params = spec.params
    x, logprobs = reference_logits(row, spec)
    if params.temperature < MIN_TEMPERATURE or params.top_k == 1:
        token = int(torch.argmax(x))
    else:
        assert noise is not None
        scaled = reference_truncated(x, spec)
        tiny = torch.finfo(torch.float32).tiny
        token = int(torch.argmax(scaled - noise.clamp(min=tiny).log()))
    if params.logprobs is None:
        return token, None
    top: tuple[tuple[int, float], ...] = ()
    n = min(params.logprobs, row.numel())
    if n > 0:
        values, ids = torch.topk(logprobs, n)
        top = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True) if v > NEG_INF)
    return token, TokenLogprobs(logprob=float(logprobs[token]), top=top)


def reference_probabilities(row: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    """The exact distribution a random row's token is drawn from."""
    x, _ = reference_logits(row, spec)
    return torch.softmax(reference_truncated(x, spec).double(), dim=-1)
