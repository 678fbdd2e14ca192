"""Token sampling for one step: every row on the device in a few batched ops, one host sync.

`sample(logits, specs)` picks one token per row; `launch` queues the same work and returns a
`PendingSample` whose `result()` is the step's only host sync (one copy of the chosen tokens, with
the logprobs in the same transfer when a row asks for them). The tensor work is
`sampling_batch.py`'s; this module is the interface the engine uses.

What a row's token is drawn from, in this order (vLLM's, whose semantics OpenAI clients expect):

1. the model's logits, in float32;
2. the allowed-token bitmask (structured output), when the row has one: other tokens get -inf;
3. *logprobs are read here*: log_softmax of these logits, the model's own distribution before
   any sampling control (vLLM's default `raw_logprobs`; vLLM too masks a grammar's disallowed
   tokens before its sampler, so they have no probability);
4. suppression (end-of-sequence before `min_tokens`): -inf;
5. `logit_bias`: each listed token's bias is added to its logit;
6. `repetition_penalty` r, over the tokens of the prompt and the output so far: a positive logit
   is divided by r, a negative one multiplied by r (r > 1 discourages repeats);
7. `frequency_penalty` f and `presence_penalty` p, over the output tokens so far: a token seen
   c > 0 times loses f·c + p from its logit (positive values discourage repeats);
8. greedy rows (temperature below `MIN_TEMPERATURE`, or `top_k` 1) take the argmax; the others:
9. the logits divided by the temperature; `min_p`: tokens whose probability is below min_p × the
   most likely token's are dropped; `top_k`: all but the k largest logits (and their ties) are
   dropped; `top_p`: all but the smallest set of most likely tokens whose mass reaches top_p;
10. the exponential race: token = argmax(logit - log E) over the tokens left, E ~ Exp(1) drawn
    independently per token. This is argmax(p / E), which picks token i with probability p_i.

Seeds. A seeded request owns a `torch.Generator` (`SampleSpec.generator`) that nothing else draws
from; each token sampled at a temperature draws exactly `V` exponentials from it (V: the logits'
width), in one call on that request's own row, and a greedy token draws none. Its noise thus
depends only on its seed and how many tokens it sampled, never on the batch it lands in, its
position there, or which other rows are seeded; everything else done to its row is per row
(elementwise ops and reductions along the vocabulary), so its token depends on its own logits
alone. Unseeded rows share one generator (the runner's), drawn once for the whole batch. Across
the split, ctx samples the first token, and gen's generator for the same seed skips one draw
(`new_spec(..., after_first_token=True)`), so gen continues the very stream ctx started.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

from trtdisagg.worker import sampling_batch
from trtdisagg.worker.request import Request, SamplingParams
from trtdisagg.worker.sampling_batch import is_greedy
from trtdisagg.worker.token_bans import allowed_mask
from trtdisagg.worker.token_logprobs import TokenLogprobs


@attrs.define(eq=False, kw_only=True)
class TokenHistory:
    """A request's token ids for the penalties: its own lists, by reference, so that each step
    reads the tokens appended so far (the engine only ever appends to them)."""

    prompt: Sequence[int]
    output: Sequence[int]
    _unique_prompt: npt.NDArray[np.int64] | None = attrs.field(default=None, init=False)

    def unique_prompt(self) -> npt.NDArray[np.int64]:
        """The prompt's distinct token ids, computed once: the prompt never changes."""
        if self._unique_prompt is None:
            self._unique_prompt = np.unique(np.asarray(self.prompt, dtype=np.int64))
        return self._unique_prompt


@attrs.frozen(kw_only=True, eq=False)
class SampleSpec:
    """How one request picks its next token.

    `allowed` is the mask of tokens it may sample (a request's `allowed_token_ids`, and for this
    step its grammar's), computed on the host: int32 words on the CPU, bit i of word i // 32 set
    when token i is allowed (llguidance's layout); tokens past its last word are not allowed.
    `suppress` holds tokens it may not sample now. `history` is required when a penalty acts.
    """

    params: SamplingParams
    generator: torch.Generator | None  # a seeded request's own; None: the step's shared one
    suppress: frozenset[int] = frozenset()  # e.g. EOS before min_tokens is reached
    history: TokenHistory | None = None
    allowed: torch.Tensor | None = None
    # A prompt's other choices, at its first token: each draws its own token from the same
    # logits row with its own spec (the runner samples the row once per spec: `rows`).
    forks: tuple[SampleSpec, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.params.penalized and self.history is None:
            raise ValueError("a penalty needs the request's token history")
        mask = self.allowed
        if mask is not None and (
            mask.dtype != torch.int32 or mask.dim() != 1 or mask.device.type != "cpu"
        ):
            raise ValueError(
                f"allowed must be a 1-D int32 CPU tensor, got {mask.dtype} {tuple(mask.shape)} "
                f"on {mask.device}"
            )


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator on `device`: seeded, or from fresh entropy when `seed` is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def new_spec(
    request: Request,
    *,
    device: torch.device,
    width: int,
    eos_token_ids: frozenset[int],
    after_first_token: bool = False,
) -> SampleSpec:
    """A request's spec for its whole life. `after_first_token`: a generation_only request,
    whose first token ctx sampled: a seeded one continues the stream ctx drew it from."""
    params = request.sampling
    generator = None
    if params.seed is not None:
        generator = make_generator(params.seed, device)
        if after_first_token:
            skip_sample(generator, params, width)
    history = None
    if params.penalized:
        history = TokenHistory(prompt=request.prompt_token_ids, output=request.output_token_ids)
    suppress = frozenset() if params.ignore_eos or params.min_tokens == 0 else eos_token_ids
    allowed = None
    if params.allowed_token_ids is not None:
        allowed = torch.from_numpy(allowed_mask(params.allowed_token_ids, width))
    return SampleSpec(
        params=params, generator=generator, suppress=suppress, history=history, allowed=allowed
    )


def skip_sample(generator: torch.Generator, params: SamplingParams, width: int) -> None:
    """Advance `generator` as sampling one token over `width` logits does, without the token:
    one draw of `width` exponentials, or none for a greedy token (`sampling_batch.noise`)."""
    if is_greedy(params):
        return
    torch.empty(width, device=generator.device).exponential_(generator=generator)


@attrs.define(eq=False, kw_only=True)
class PendingSample:
    """A step's tokens on their way to the host; `result()` waits for them (the one sync)."""

    host: torch.Tensor  # [S] token ids, or [S, 2 + 2K]: token, logprob, K top ids, K top logprobs
    ready: torch.cuda.Event | None  # recorded after the copy; None when `host` is computed
    top_logprobs: Sequence[int]  # per row: how many top logprobs, -1 for no logprobs
    device_tokens: torch.Tensor  # int64 [S], on the logits' device (a next step may read them)

    def result(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        if self.ready is not None:
            self.ready.synchronize()
        values = self.host.tolist()
        if self.host.dim() == 1:
            return [int(v) for v in values], [None] * len(values)
        width = (self.host.shape[1] - 2) // 2
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        for row, n in zip(values, self.top_logprobs, strict=True):
            tokens.append(int(row[0]))
            if n < 0:
                logprobs.append(None)
                continue
            ids, lps = row[2 : 2 + n], row[2 + width : 2 + width + n]
            # A grammar's disallowed tokens have logprob -inf: they are no alternative.
            top = tuple((int(i), lp) for i, lp in zip(ids, lps, strict=True) if lp != -np.inf)
            logprobs.append(TokenLogprobs(logprob=row[1], top=top))
        return tokens, logprobs


def launch(
    logits: torch.Tensor,
    specs: Sequence[SampleSpec],
    *,
    rows: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> PendingSample:
    """Queue the sampling of one token per spec; nothing here waits for the device.

    logits: [N, V], any float dtype, left unchanged. `rows`: which row of `logits` each spec
    samples (default: row i for spec i, N == len(specs)). `generator`: the unseeded rows' shared
    generator on the logits' device (default: torch's default generator for that device).
    """
    packed, top_logprobs = sampling_batch.sample_rows(logits, specs, rows=rows, generator=generator)
    tokens = packed if packed.dim() == 1 else packed[:, 0].long()
    if packed.device.type != "cuda":
        return PendingSample(
            host=packed, ready=None, top_logprobs=top_logprobs, device_tokens=tokens
        )
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(packed.device))
    return PendingSample(host=host, ready=ready, top_logprobs=top_logprobs, device_tokens=tokens)


def sample(
    logits: torch.Tensor,
    specs: Sequence[SampleSpec],
    *,
    rows: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """`launch`, then its result: token ids and optional logprobs, one per spec."""
    return launch(logits, specs, rows=rows, generator=generator).result()


def prompt_token_logprobs(
    rows: torch.Tensor, targets: Sequence[int], top_n: int
) -> list[TokenLogprobs]:
    """rows: float32 [K, V], the logits of K positions; targets: the prompt token each position
    is followed by. Each target's logprob and rank, with the `top_n` most likely tokens, in one
    host sync for the K of them."""
    logp = torch.log_softmax(rows.float(), dim=-1)
    index = torch.tensor(list(targets), device=rows.device).unsqueeze(1)
    chosen = logp.gather(1, index)
    ranks = (logp >= chosen).sum(dim=-1).tolist()
    values = chosen.squeeze(1).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(targets)
    if top_n > 0:
        top_values, top_ids = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)
        tops = [
            tuple(zip(ids, vals, strict=True))
            for ids, vals in zip(top_ids.tolist(), top_values.tolist(), strict=True)
        ]
    return [
        TokenLogprobs(logprob=v, top=t, rank=r) for v, t, r in zip(values, tops, ranks, strict=True)
    ]
