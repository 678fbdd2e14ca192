"""One sampled token's logprob and its best alternatives, as the engine reports them.

Its own module, free of torch: the HTTP API's front processes read and write it too, and they
load no torch (`tests/unit/test_pure_imports.py`).
"""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class TokenLogprobs:
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first
    # How many tokens are at least as likely (1: the most likely), as vLLM counts it; prompt
    # tokens only (vLLM's `prompt_logprobs` shows it)
    rank: int | None = None
