"""Routers that need nothing but the server list: round robin and least load. Pure."""

from __future__ import annotations

from typing import ClassVar

from trtdisagg.coordinator.config import RouterType
from trtdisagg.coordinator.routers.base import Router, RouteRequest, Selection, ServerView


class RoundRobinRouter(Router):
    """Each call takes the candidate chosen least recently: the next in turn, skipping the
    excluded and the unpairable. Needs no state shared across processes, so fleet front ends
    run it locally."""

    type: ClassVar[RouterType] = RouterType.ROUND_ROBIN

    def _choose(self, candidates: list[ServerView], request: RouteRequest) -> Selection:
        return Selection(server=self._round_robin(candidates).url)


class LoadBalancingRouter(Router):
    """The server with the least load: active requests, or active prompt tokens with
    ``use_tokens`` (tokens when the coordinator tokenized the prompt, else characters). Ties go
    round robin."""

    type: ClassVar[RouterType] = RouterType.LOAD_BALANCING

    @property
    def uses_prompt_tokens(self) -> bool:
        return self.config.use_tokens

    def _choose(self, candidates: list[ServerView], request: RouteRequest) -> Selection:
        load = self._active_tokens if self.config.use_tokens else self._active_requests
        least = min(load[s.url] for s in candidates)
        tied = [s for s in candidates if load[s.url] == least]
        return Selection(server=self._round_robin(tied).url)
