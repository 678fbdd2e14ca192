"""Conversation routing: keep a conversation on the server that holds its history. Pure.

Priority order for one request:

1. **By id**: a request carrying ``conversation_id`` goes to the candidate that ranks first for
   that id by rendezvous hashing (the highest hash of id and server URL). Every front end of a
   fleet, on any host, computes the same ranking from the same servers with no state to share,
   so a conversation stays on one server whichever front end each turn reaches. A server that
   joins takes over only the conversations it now ranks first for (about 1/N of them); one that
   leaves, or is excluded for a retry, hands each of its conversations to that conversation's
   next-ranked server: all front ends again agree.
2. **Implicit prefix**: the prompt's chained block hashes are looked up in a map of hashes the
   router has placed before (a chained hash names a whole prefix, so a dict is a trie); the
   deepest hit wins when it covers at least ``match_threshold`` of the prompt's blocks.
3. Otherwise the server with the least active prompt tokens (characters without token ids);
   ties go round robin.

Without token ids the prompt text's code points are hashed instead, in blocks of
``4 * tokens_per_block`` characters. The prefix map keeps at most ``max_sessions`` entries and
evicts the least recently used; a server that leaves the healthy set loses its entries. Prefix
maps are per front end: a fleet's front ends each learn the prefixes they placed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar

from trtdisagg.coordinator.config import RouterConfig, RouterType
from trtdisagg.coordinator.routers.base import Router, RouteRequest, Selection, ServerView
from trtdisagg.kv.hashing import block_hashes

DEFAULT_TOKENS_PER_BLOCK = 128
CHARS_PER_TOKEN = 4


class ConversationRouter(Router):
    type: ClassVar[RouterType] = RouterType.CONVERSATION

    def __init__(self, config: RouterConfig, *, role: str) -> None:
        super().__init__(config, role=role)
        self._prefixes: OrderedDict[int, str] = OrderedDict()

    @property
    def uses_prompt_tokens(self) -> bool:
        return True

    @property
    def _tokens_per_block(self) -> int:
        return self.config.tokens_per_block or DEFAULT_TOKENS_PER_BLOCK

    def update_servers(self, servers: Sequence[ServerView]) -> None:
        super().update_servers(servers)
        alive = {s.url for s in servers}
        self._prefixes = OrderedDict((k, u) for k, u in self._prefixes.items() if u in alive)

    def prompt_hashes(self, request: RouteRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return block_hashes(request.prompt_token_ids, self._tokens_per_block)
        if request.prompt_text is not None:
            points = [ord(c) for c in request.prompt_text]
            return block_hashes(points, self._tokens_per_block * CHARS_PER_TOKEN)
        return []

    def _choose(self, candidates: list[ServerView], request: RouteRequest) -> Selection:
        hashes = self.prompt_hashes(request)
        if request.conversation_id is not None:
            url = rendezvous_choice(request.conversation_id, [s.url for s in candidates])
            choice = next(s for s in candidates if s.url == url)
        else:
            choice = self._implicit(hashes, {s.url: s for s in candidates}) or self._least_loaded(
                candidates
            )
        self._remember(hashes, choice.url)
        return Selection(server=choice.url)

    def _least_loaded(self, candidates: list[ServerView]) -> ServerView:
        least = min(self._active_tokens[s.url] for s in candidates)
        return self._round_robin([s for s in candidates if self._active_tokens[s.url] == least])

    def _implicit(self, hashes: list[int], by_url: dict[str, ServerView]) -> ServerView | None:
        depth, owner = 0, None
        for i, h in enumerate(hashes):
            url = self._prefixes.get(h)
            if url is None:
                break
            depth, owner = i + 1, url
        if owner is None or owner not in by_url:
            return None
        if depth / len(hashes) < self.config.match_threshold:
            return None
        return by_url[owner]

    def _remember(self, hashes: list[int], url: str) -> None:
        for h in hashes:
            self._prefixes[h] = url
            self._prefixes.move_to_end(h)
        while len(self._prefixes) > self.config.max_sessions:
            self._prefixes.popitem(last=False)


def rendezvous_choice(key: str, urls: Sequence[str]) -> str:
    """The URL that ranks first for `key` (highest random weight): a keyed hash that is the same
    in every process, unlike Python's salted `hash`."""
    return max(urls, key=lambda url: _weight(key, url))


def _weight(key: str, url: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()
