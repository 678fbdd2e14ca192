"""Output grammars with llguidance: compiled once per request, one matcher per choice.

A request that constrains its output (`response_format`, vLLM's structured outputs, a forced
tool call: `api/grammars.py` says which grammar) gets a `GrammarTemplate` from the worker's
`GrammarCompiler`, which builds llguidance's tokenizer once and keeps compiled grammars in a small
cache, so that a schema sent again is not compiled again. Compiling can take long for a big
schema: the service does it in a worker thread. Each choice then owns a `Matcher`, its state:

1. before a step samples the choice's next token, `allowed_tokens` gives the step's bitmasks
   (llguidance's format: int32 words, bit `i % 32` of word `i // 32` set when token `i` is
   allowed; end-of-sequence only once the grammar accepts), which the sampler applies;
2. the output processor advances the matcher with each token the choice gets, sampled here or
   sent by ctx (`advance`); a gen worker thus replays ctx's first token before it masks the next;
3. once the grammar admits nothing more (`is_stopped`), the choice finishes (`stop`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Collection, Sequence
from typing import Final

import attrs
import llguidance
import llguidance.numpy
import numpy as np
import numpy.typing as npt

from trtdisagg.api.grammars import OutputGrammar

CACHE_SIZE: Final = 64  # compiled grammars kept, least recently used dropped first


class GrammarError(ValueError):
    """A grammar llguidance cannot compile (a bad schema, regex or Lark grammar)."""


@attrs.frozen(kw_only=True, eq=False)
class GrammarTemplate:
    """A compiled grammar at its start; each choice gets its own copy (`matcher`)."""

    grammar: OutputGrammar
    _start: llguidance.LLMatcher = attrs.field(alias="start")
    vocab_size: int  # the model's logits width: the bitmask's bits

    def matcher(self) -> Matcher:
        return Matcher(state=self._start.deep_copy(), vocab_size=self.vocab_size)


@attrs.define(eq=False, kw_only=True)
class Matcher:
    """One choice's place in its grammar."""

    state: llguidance.LLMatcher
    vocab_size: int

    def advance(self, token: int) -> bool:
        """Take the choice's next token; False when the grammar does not allow it."""
        return bool(self.state.consume_token(token)) and not self.state.is_error()

    @property
    def is_stopped(self) -> bool:
        """Nothing more can follow: the output is complete."""
        return bool(self.state.is_stopped())

    @property
    def error(self) -> str:
        return str(self.state.get_error())


def allowed_tokens(matchers: Sequence[Matcher]) -> npt.NDArray[np.int32]:
    """The allowed-token bitmask of each of a step's rows that has a grammar, from each
    matcher's state after the row's previous token: int32 [rows, ceil(vocab / 32)] (module
    docstring). In numpy, not torch: the API's front processes compile grammars and load no
    torch; the engine wraps the rows as tensors."""
    words = -(-matchers[0].vocab_size // 32) if matchers else 0
    masks = np.zeros((len(matchers), words), dtype=np.int32)
    for row, matcher in enumerate(matchers):
        llguidance.numpy.fill_next_token_bitmask(matcher.state, masks, row)
    return masks


def allows_other_than(mask: npt.NDArray[np.int32], tokens: Collection[int]) -> bool:
    """Whether bitmask `mask` allows some token outside `tokens`."""
    words = mask.view(np.uint32).copy()
    for token in tokens:
        if token // 32 < words.size:
            words[token // 32] &= ~np.uint32(1 << (token % 32))
    return bool(words.any())


class GrammarCompiler:
    """Compiles `OutputGrammar`s for one tokenizer; thread-safe (the service compiles in worker
    threads).

    Args:
        tokenizer_json: the tokenizer, as `tokenizer.json` holds it.
        vocab_size: the model's logits width (bits of a bitmask; ids past the tokenizer's are
            never allowed).
        eos_token_ids: end-of-sequence ids, allowed once the grammar accepts.
    """

    def __init__(
        self, *, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        self._vocab_size = vocab_size
        self._cache: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, grammar: OutputGrammar) -> GrammarTemplate:
        """Raises:
        GrammarError: llguidance refuses the grammar; its message says why.
        """
        with self._lock:
            start = self._cache.get(grammar.grammar)
            if start is not None:
                self._cache.move_to_end(grammar.grammar)
        if start is None:
            start = llguidance.LLMatcher(self._tokenizer, grammar.grammar, log_level=0)
            if start.is_error():
                raise GrammarError(start.get_error())
            with self._lock:
                self._cache[grammar.grammar] = start
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return GrammarTemplate(grammar=grammar, start=start, vocab_size=self._vocab_size)

    def cached(self, grammar: OutputGrammar) -> bool:
        with self._lock:
            return grammar.grammar in self._cache
