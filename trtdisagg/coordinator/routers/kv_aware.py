"""KV-cache-aware routing: send a prompt where its prefix is already cached. Pure.

Each server's set of cached block hashes is rebuilt from the events its shell drains from the
worker (``stored`` adds hashes, ``removed`` discards them). For a request, the router computes
the chained hashes of the prompt's reusable blocks (`trtdisagg.kv.hashing.reusable_block_hashes`,
the same function the workers' block pool uses, rooted at the request's `cache_salt`) and scores
every candidate::

    score = matched_tokens / padded_prompt_tokens - active_requests / max_batch_size

where ``matched_tokens`` is ``tokens_per_block`` times the number of leading prompt blocks the
server holds (matching stops at the first miss) and ``padded_prompt_tokens`` is the prompt
length rounded up to whole blocks. The highest score wins; ties go round robin.

Without the prompt's token ids (the coordinator could not load the model's tokenizer) every
match is 0 and the score is minus the load: least-loaded, round robin among equals.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from trtdisagg.coordinator.config import RouterConfig, RouterType
from trtdisagg.coordinator.routers.base import (
    KvEvent,
    Router,
    RouteRequest,
    Selection,
    ServerView,
)
from trtdisagg.kv.hashing import reusable_block_hashes

DEFAULT_MAX_BATCH_SIZE = 64
DEFAULT_TOKENS_PER_BLOCK = 32


def leading_matches(hashes: Sequence[int], cached: set[int]) -> int:
    """How many of `hashes`, from the first, are in `cached` (stops at the first miss)."""
    count = 0
    for h in hashes:
        if h not in cached:
            break
        count += 1
    return count


class KvCacheAwareRouter(Router):
    type: ClassVar[RouterType] = RouterType.KV_CACHE_AWARE
    needs_kv_events: ClassVar[bool] = True

    def __init__(self, config: RouterConfig, *, role: str) -> None:
        super().__init__(config, role=role)
        self._cached: dict[str, set[int]] = {}

    @property
    def uses_prompt_tokens(self) -> bool:
        return True

    def reset_server(self, url: str) -> None:
        self._cached.pop(url, None)

    def apply_kv_events(self, url: str, events: Sequence[KvEvent]) -> None:
        cached = self._cached.setdefault(url, set())
        for event in events:
            if event.kind == "stored":
                cached.update(event.block_hashes)
            else:
                cached.difference_update(event.block_hashes)

    def cached_blocks(self, url: str) -> int:
        return len(self._cached.get(url, ()))

    def _tokens_per_block(self, server: ServerView) -> int:
        return self.config.tokens_per_block or server.tokens_per_block or DEFAULT_TOKENS_PER_BLOCK

    def _max_batch_size(self, server: ServerView) -> int:
        return self.config.max_batch_size or server.max_batch_size or DEFAULT_MAX_BATCH_SIZE

    def matched_tokens(self, server: ServerView, tokens: Sequence[int], hashes: list[int]) -> int:
        tokens_per_block = self._tokens_per_block(server)
        matched = leading_matches(hashes, self._cached.get(server.url, set())) * tokens_per_block
        return min(matched, len(tokens))

    def _choose(self, candidates: list[ServerView], request: RouteRequest) -> Selection:
        tokens = request.prompt_token_ids
        hashes_by_block_size: dict[int, list[int]] = {}
        scored: list[tuple[float, int, ServerView]] = []
        for server in candidates:
            matched = 0
            padded = 1
            if tokens:
                tokens_per_block = self._tokens_per_block(server)
                if tokens_per_block not in hashes_by_block_size:
                    hashes_by_block_size[tokens_per_block] = reusable_block_hashes(
                        tokens, tokens_per_block, salt=request.cache_salt
                    )
                hashes = hashes_by_block_size[tokens_per_block]
                matched = self.matched_tokens(server, tokens, hashes)
                blocks = -(-len(tokens) // tokens_per_block)
                padded = max(blocks * tokens_per_block, 1)
            load = self._active_requests[server.url] / self._max_batch_size(server)
            scored.append((matched / padded - load, matched, server))
        best = max(score for score, _, _ in scored)
        tied = [server for score, _, server in scored if score == best]
        choice = self._round_robin(tied)
        matched = next(m for _, m, s in scored if s is choice)
        return Selection(server=choice.url, matched_tokens=matched)
