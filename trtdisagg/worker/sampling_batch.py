"""The batched tensor work of `sampling.launch`: the rows' controls gathered on the host, sent to
the device in (at most) two copies, then applied to every row at once.

No stage loops over rows on the device except the seeded rows' draws (one `exponential_` each,
from the row's own generator); a stage no row needs is skipped. Per-row token lists (suppressed
tokens, biases, the penalties' token history, allowed-token masks) travel as flat indices into
the [S, V] logits (row · V + token), so each stage is one scatter. The order of the stages, and
what each means, is `sampling.py`'s docstring.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from trtdisagg.worker.request import MIN_TEMPERATURE, SamplingParams
from trtdisagg.worker.token_bans import BITS

if TYPE_CHECKING:
    from trtdisagg.worker.sampling import SampleSpec

NEG_INF: Final = float("-inf")
TOP_P_OFF: Final = 2.0
"""A row without top_p compares its cumulative mass with this: above any sum of probabilities, so
rounding can never drop a token of it (1.0 could, once the sum rounds up to 1 early)."""
TINY: Final = torch.finfo(torch.float32).tiny
"""Exponential draws are clamped to this: log(0) would make a masked token's -inf logit NaN."""

IntArray = npt.NDArray[np.int64]


def is_greedy(params: SamplingParams) -> bool:
    """Whether the token is the argmax (no random draw)."""
    return params.temperature < MIN_TEMPERATURE or params.top_k == 1


@attrs.define(eq=False, kw_only=True)
class HostRows:
    """The step's rows as the host gathers them from the specs; `upload` sends them."""

    width: int  # V: the logits' width
    greedy: list[int] = attrs.Factory(list)  # 1: argmax
    temperature: list[float] = attrs.Factory(list)  # 1.0 for greedy rows (never used)
    top_k: list[int] = attrs.Factory(list)  # 0: off
    top_p: list[float] = attrs.Factory(list)  # TOP_P_OFF: off
    min_p: list[float] = attrs.Factory(list)
    repetition: list[float] = attrs.Factory(list)
    frequency: list[float] = attrs.Factory(list)
    presence: list[float] = attrs.Factory(list)
    top_logprobs: list[int] = attrs.Factory(list)  # -1: no logprobs
    named: list[tuple[int, IntArray]] = attrs.Factory(list)  # rows naming their alternatives
    suppress: list[IntArray] = attrs.Factory(list)  # flat indices
    bias_index: list[IntArray] = attrs.Factory(list)
    bias_value: list[npt.NDArray[np.float32]] = attrs.Factory(list)
    output_index: list[IntArray] = attrs.Factory(list)  # one entry per occurrence
    prompt_index: list[IntArray] = attrs.Factory(list)  # distinct prompt tokens
    allowed: list[tuple[int, npt.NDArray[np.int32]]] = attrs.Factory(list)
    seeded: list[tuple[int, torch.Generator]] = attrs.Factory(list)  # random rows only
    unseeded: list[int] = attrs.Factory(list)  # random rows drawing from the shared generator
    any_penalty: bool = False

    @classmethod
    def gather(cls, specs: Sequence[SampleSpec], width: int) -> HostRows:
        rows = cls(width=width)
        for row, spec in enumerate(specs):
            rows._add(row, spec)
        return rows

    def _add(self, row: int, spec: SampleSpec) -> None:
        params, width = spec.params, self.width
        greedy = is_greedy(params)
        random = not greedy
        self.greedy.append(int(greedy))
        self.temperature.append(params.temperature if random else 1.0)
        self.top_k.append(min(params.top_k, width) if random and params.top_k > 0 else 0)
        self.top_p.append(params.top_p if random and params.top_p < 1.0 else TOP_P_OFF)
        self.min_p.append(params.min_p if random else 0.0)
        self.repetition.append(params.repetition_penalty)
        self.frequency.append(params.frequency_penalty)
        self.presence.append(params.presence_penalty)
        n = params.logprobs
        named = params.logprob_token_ids if n is not None else None
        if named:
            self.named.append((row, _in_vocab(named, width, "logprob_token_ids")))
            n = len(named)
        self.top_logprobs.append(-1 if n is None else min(n, width))
        base = row * width
        if spec.suppress:
            self.suppress.append(_in_vocab(sorted(spec.suppress), width, "suppressed") + base)
        if params.logit_bias:
            tokens = _in_vocab([t for t, _ in params.logit_bias], width, "logit_bias")
            self.bias_index.append(tokens + base)
            self.bias_value.append(np.array([b for _, b in params.logit_bias], np.float32))
        if params.penalized:
            assert spec.history is not None, "SampleSpec checks it"
            self.any_penalty = True
            self.output_index.append(np.asarray(spec.history.output, np.int64) + base)
            if params.repetition_penalty != 1.0:
                prompt = _in_vocab(spec.history.unique_prompt(), width, "prompt")
                self.prompt_index.append(prompt + base)
        if spec.allowed is not None:
            self.allowed.append((row, spec.allowed.numpy()))
        if random:
            if spec.generator is None:
                self.unseeded.append(row)
            else:
                self.seeded.append((row, spec.generator))

    @property
    def num_rows(self) -> int:
        return len(self.greedy)

    @property
    def any_random(self) -> bool:
        return not all(self.greedy)

    @property
    def any_greedy(self) -> bool:
        return any(self.greedy)

    @property
    def max_logprobs(self) -> int:
        """The most top logprobs a row asks for; -1 when no row asks for logprobs."""
        return max(self.top_logprobs)

    @property
    def writes(self) -> bool:
        """Whether a stage writes into the logits in place (they must be a copy)."""
        return bool(self.allowed or self.suppress or self.bias_index)


@attrs.frozen(kw_only=True)
class DeviceRows:
    """`HostRows` on the device: per-row parameters [S] and flat index lists."""

    rows: torch.Tensor | None  # the logits rows to sample, when not all of them in order
    unseeded: torch.Tensor  # the unseeded random rows, when some random rows are seeded
    greedy: torch.Tensor  # bool
    top_k: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    suppress: torch.Tensor
    bias_index: torch.Tensor
    bias_value: torch.Tensor
    output_index: torch.Tensor
    prompt_index: torch.Tensor
    allowed: torch.Tensor  # [S, W] mask words, -1 (all allowed) for rows without a mask
    named: torch.Tensor  # [S, T] alternatives a row names, -1 for its most likely; T 0: none


def upload(host: HostRows, rows: Sequence[int] | None, device: torch.device) -> DeviceRows:
    """Two host-to-device copies (pinned, asynchronous on CUDA): one of ints, one of floats."""
    s = host.num_rows
    # Rows without a mask allow every token: all bits of enough words to cover the vocabulary.
    num_words = max([-(-host.width // BITS), *(mask.size for _, mask in host.allowed)])
    if not host.allowed:
        num_words = 0
    allowed = np.full((s, num_words), -1, np.int64)
    for row, mask in host.allowed:
        allowed[row, : mask.size] = mask
        allowed[row, mask.size :] = 0
    named = np.full((s, host.max_logprobs if host.named else 0), -1, np.int64)
    for row, ids in host.named:
        named[row, : ids.size] = ids
    ints = [
        np.asarray(rows if rows is not None else [], np.int64),
        np.asarray(host.unseeded if host.seeded else [], np.int64),
        np.asarray(host.greedy, np.int64),
        np.asarray(host.top_k, np.int64),
        _cat(host.suppress),
        _cat(host.bias_index),
        _cat(host.output_index),
        _cat(host.prompt_index),
        allowed.reshape(-1),
        named.reshape(-1),
    ]
    floats = [
        np.asarray(values, np.float32)
        for values in (
            host.temperature,
            host.top_p,
            host.min_p,
            host.repetition,
            host.frequency,
            host.presence,
        )
    ]
    floats.append(_cat(host.bias_value, np.float32))
    (row_ids, unseeded, greedy, top_k, suppress, bias_index, output_index, prompt_index, words,
     named_ids) = _send(ints, device)  # fmt: skip
    temperature, top_p, min_p, repetition, frequency, presence, bias_value = _send(floats, device)
    return DeviceRows(
        rows=row_ids if rows is not None else None,
        unseeded=unseeded,
        greedy=greedy.bool(),
        top_k=top_k,
        temperature=temperature,
        top_p=top_p,
        min_p=min_p,
        repetition=repetition,
        frequency=frequency,
        presence=presence,
        suppress=suppress,
        bias_index=bias_index,
        bias_value=bias_value,
        output_index=output_index,
        prompt_index=prompt_index,
        allowed=words.view(s, num_words),
        named=named_ids.view(named.shape),
    )


def sample_rows(
    logits: torch.Tensor,
    specs: Sequence[SampleSpec],
    *,
    rows: Sequence[int] | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, list[int]]:
    """Every stage for every row, on the logits' device. Returns the packed result (see
    `sampling.PendingSample.host`) and each row's number of top logprobs (-1: none)."""
    width = logits.shape[-1]
    if rows is not None and len(rows) != len(specs):
        raise ValueError(f"{len(rows)} rows for {len(specs)} specs")
    if rows is None and logits.shape[0] != len(specs):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(specs)} specs")
    if not specs:
        return torch.zeros(0, dtype=torch.int64, device=logits.device), []
    host = HostRows.gather(specs, width)
    plain = not (host.writes or host.any_penalty or host.any_random)
    if plain and rows is None and host.max_logprobs < 0:
        return argmax_rows(logits), host.top_logprobs  # plain greedy: nothing to send
    dev = upload(host, rows, logits.device)
    if dev.rows is not None:
        x = logits.index_select(0, dev.rows).float()
    else:
        x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=host.writes)
    if host.allowed:
        x.masked_fill_(~allowed_mask(dev.allowed, width), NEG_INF)
    logprobs = torch.log_softmax(x, dim=-1) if host.max_logprobs >= 0 else None
    if host.suppress:  # x is a contiguous copy whenever a stage writes into it
        x.view(-1).index_fill_(0, dev.suppress, NEG_INF)
    if host.bias_index:
        x.view(-1).index_add_(0, dev.bias_index, dev.bias_value)  # one entry per (row, token)
    if host.any_penalty:
        x = penalize(x, dev, with_prompt=bool(host.prompt_index))
    tokens = choose(x, host, dev, generator)
    named = dev.named if host.named else None
    return pack(tokens, logprobs, host.max_logprobs, named), host.top_logprobs


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first of equal maxima. On CUDA in two passes over vocabulary parts:
    one pass over [S, V] reduces each row in one block, leaving most SMs idle for a few rows."""
    parts = math.gcd(x.shape[-1], 64)
    if x.device.type != "cuda" or parts < 8 or not x.is_contiguous():
        return x.argmax(dim=-1)
    return argmax_in_parts(x, parts)


def argmax_in_parts(x: torch.Tensor, parts: int) -> torch.Tensor:
    """`x.argmax(-1)` of [S, V] as the first part holding the row maximum (`parts` divides V),
    then the first maximum within that part."""
    rows, width = x.shape
    size = width // parts
    values, within = x.view(rows, parts, size).max(dim=-1)
    part = values.argmax(dim=-1, keepdim=True)
    return (part * size + within.gather(1, part)).squeeze(1)


def allowed_mask(words: torch.Tensor, width: int) -> torch.Tensor:
    """[S, W] mask words → [S, V] bool, True where the token is allowed."""
    shifts = torch.arange(BITS, device=words.device, dtype=torch.int32)
    bits = (words.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    mask = bits.view(words.shape[0], -1) != 0
    if mask.shape[1] >= width:
        return mask[:, :width]
    return torch.nn.functional.pad(mask, (0, width - mask.shape[1]), value=False)


def penalize(x: torch.Tensor, dev: DeviceRows, *, with_prompt: bool) -> torch.Tensor:
    """Repetition, then frequency and presence penalties (rows without them are unchanged:
    their factors are 1 and 0, exact in floating point)."""
    counts = torch.zeros(x.numel(), device=x.device, dtype=torch.float32)
    counts.index_add_(0, dev.output_index, torch.ones_like(dev.output_index, dtype=torch.float32))
    counts = counts.view_as(x)
    seen = counts > 0
    if with_prompt:
        seen.view(-1).index_fill_(0, dev.prompt_index, True)
    repetition = dev.repetition.unsqueeze(1)
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - dev.frequency.unsqueeze(1) * counts
    return x - dev.presence.unsqueeze(1) * (counts > 0).float()


def choose(
    x: torch.Tensor, host: HostRows, dev: DeviceRows, generator: torch.Generator | None
) -> torch.Tensor:
    """Greedy rows: the argmax; the others: temperature, min_p, top_k, top_p, then the race."""
    greedy = argmax_rows(x) if host.any_greedy else None
    if not host.any_random:
        assert greedy is not None
        return greedy
    scaled = x / dev.temperature.unsqueeze(1)
    if any(p > 0.0 for p in host.min_p):
        threshold = scaled.amax(dim=-1, keepdim=True) + torch.log(dev.min_p).unsqueeze(1)
        scaled.masked_fill_(scaled < threshold, NEG_INF)
    if any(host.top_k):  # before top_p, whose mass is then the top-k distribution's
        truncate_top_k(scaled, dev.top_k, max(host.top_k))
    if any(p != TOP_P_OFF for p in host.top_p):
        truncate_top_p(scaled, dev.top_p)
    scores = scaled - noise(scaled.shape, host, dev, generator).log()
    drawn = scores.argmax(dim=-1)
    return drawn if greedy is None else torch.where(dev.greedy, greedy, drawn)


def truncate_top_k(scaled: torch.Tensor, top_k: torch.Tensor, largest: int) -> None:
    """Drop all but each row's k largest logits (ties with the k-th stay); k = 0: keep all."""
    values = scaled.topk(largest, dim=-1).values
    kth = values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
    kth.masked_fill_((top_k == 0).unsqueeze(1), NEG_INF)
    scaled.masked_fill_(scaled < kth, NEG_INF)


def truncate_top_p(scaled: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keep each row's smallest prefix of most likely tokens whose mass reaches top_p (ties
    with the last kept logit stay). The first token always stays: a top_p too small for float32
    would otherwise drop every token."""
    ordered = scaled.sort(dim=-1, descending=True).values
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # the mass of the tokens more likely than this one
    # Tokens already dropped (-inf) are never kept: a row without top_p keeps its finite ones.
    keep = (before < top_p.unsqueeze(1)) & (ordered > NEG_INF)
    keep[:, 0] = True
    last = keep.sum(dim=-1, keepdim=True) - 1  # keep is a prefix: its length - 1
    scaled.masked_fill_(scaled < ordered.gather(1, last), NEG_INF)


def noise(
    shape: torch.Size, host: HostRows, dev: DeviceRows, generator: torch.Generator | None
) -> torch.Tensor:
    """E ~ Exp(1) per token: one batched draw from the shared generator for the unseeded rows,
    one per seeded row from its own generator (exactly `V` values: what `sampling.skip_sample`
    mirrors). Greedy rows' values are never used."""
    device = dev.greedy.device
    if not host.seeded:
        drawn = torch.empty(shape, device=device).exponential_(generator=generator)
        return drawn.clamp_(min=TINY)
    drawn = torch.ones(shape, device=device)
    if host.unseeded:
        shared = torch.empty((len(host.unseeded), shape[1]), device=device)
        drawn.index_copy_(0, dev.unseeded, shared.exponential_(generator=generator))
    for row, own in host.seeded:
        drawn[row].exponential_(generator=own)
    return drawn.clamp_(min=TINY)


def pack(
    tokens: torch.Tensor,
    logprobs: torch.Tensor | None,
    top: int,
    named: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tokens alone ([S] int64), or with logprobs as one [S, 2 + 2·top] float64 tensor:
    token, its logprob, the top ids, their logprobs (token ids are exact in float64). `named`
    [S, top]: ids a row names as its alternatives (`logprob_token_ids`), -1 where its most
    likely ones stand."""
    if logprobs is None:
        return tokens
    parts = [tokens.unsqueeze(1).double(), logprobs.gather(1, tokens.unsqueeze(1)).double()]
    if top > 0:
        values, ids = logprobs.topk(top, dim=-1)
        if named is not None:
            ids = torch.where(named >= 0, named, ids)
            values = logprobs.gather(1, ids)
        parts += [ids.double(), values.double()]
    return torch.cat(parts, dim=1)


def _in_vocab(tokens: Sequence[int] | IntArray, width: int, what: str) -> IntArray:
    ids = np.asarray(tokens, np.int64)
    if ids.size and not (ids.min() >= 0 and ids.max() < width):
        raise ValueError(f"{what} token ids must be in [0, {width})")
    return ids


def _cat(parts: Sequence[npt.NDArray[Any]], dtype: type[np.generic] = np.int64) -> npt.NDArray[Any]:
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _send(parts: Sequence[npt.NDArray[Any]], device: torch.device) -> list[torch.Tensor]:
    """One host-to-device copy of `parts` concatenated; returns a device view of each part."""
    host = torch.from_numpy(np.concatenate(parts))
    if device.type == "cuda":
        moved = host.pin_memory().to(device, non_blocking=True)
    else:
        moved = host.to(device)
    return list(moved.split([part.size for part in parts]))
