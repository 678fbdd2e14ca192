"""Conversation routing: keep a conversation on the server that holds its history. Pure.

Priority order for one request:

1. **Sticky**: a request carrying ``conversation_id`` goes where that conversation went before,
   if that server is still healthy and not excluded.
2. **Implicit prefix**: the prompt's chained block hashes are looked up in a map of hashes the
   router has placed before (a chained hash names a whole prefix, so a dict is a trie); the
   deepest hit wins when it covers at least ``match_threshold`` of the prompt's blocks.
3. Otherwise the server with the least active prompt tokens (characters without token ids);
   ties go round robin.

Without token ids the prompt text's code points are hashed instead, in blocks of
``4 * tokens_per_block`` characters. Both maps keep at most ``max_sessions`` entries and evict
the least recently used; a server that leaves the healthy set loses its entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar

from trtdisagg.coordinator.config import RouterConfig, RouterType
from trtdisagg.coordinator.routers.base import Router, RouteRequest, Selection, ServerView
from trtdisagg.coordinator.routers.kv_aware import BlockHasher
from trtdisagg.kv.hashing import block_hashes

DEFAULT_TOKENS_PER_BLOCK = 128
CHARS_PER_TOKEN = 4


class ConversationRouter(Router):
    type: ClassVar[RouterType] = RouterType.CONVERSATION

    def __init__(
        self, config: RouterConfig, *, role: str, hasher: BlockHasher = block_hashes
    ) -> None:
        super().__init__(config, role=role)
        self._hasher = hasher
        self._sessions: OrderedDict[str, str] = OrderedDict()
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
        self._sessions = OrderedDict((k, u) for k, u in self._sessions.items() if u in alive)
        self._prefixes = OrderedDict((k, u) for k, u in self._prefixes.items() if u in alive)

    def prompt_hashes(self, request: RouteRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return self._hasher(request.prompt_token_ids, self._tokens_per_block)
        if request.prompt_text is not None:
            points = [ord(c) for c in request.prompt_text]
            return self._hasher(points, self._tokens_per_block * CHARS_PER_TOKEN)
        return []

    def _choose(self, candidates: list[ServerView], request: RouteRequest) -> Selection:
        by_url = {s.url: s for s in candidates}
        hashes = self.prompt_hashes(request)
        choice = self._sticky(request, by_url) or self._implicit(hashes, by_url)
        if choice is None:
            least = min(self._active_tokens[s.url] for s in candidates)
            choice = self._round_robin(
                [s for s in candidates if self._active_tokens[s.url] == least]
            )
        self._remember(request, hashes, choice.url)
        return Selection(server=choice.url)

    def _sticky(self, request: RouteRequest, by_url: dict[str, ServerView]) -> ServerView | None:
        if request.conversation_id is None:
            return None
        url = self._sessions.get(request.conversation_id)
        return by_url.get(url) if url is not None else None

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

    def _remember(self, request: RouteRequest, hashes: list[int], url: str) -> None:
        limit = self.config.max_sessions
        if request.conversation_id is not None:
            self._sessions[request.conversation_id] = url
            self._sessions.move_to_end(request.conversation_id)
            while len(self._sessions) > limit:
                self._sessions.popitem(last=False)
        for h in hashes:
            self._prefixes[h] = url
            self._prefixes.move_to_end(h)
        while len(self._prefixes) > limit:
            self._prefixes.popitem(last=False)
